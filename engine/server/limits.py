"""The endpoint's defaults, once: `ebb-engine serve`'s flags, the window's Settings and the
server itself read them here (a module with no imports, so a parser or the settings can)."""
from __future__ import annotations

DEFAULT_PORT = 8089
DEFAULT_MAX_BODY = 32 << 20  # a request's body (a picture as base64 counts 4/3 of its bytes)
# a request that is not streamed waits in line at most this long, then gets a 503 with
# Retry-After (it saw nothing meanwhile; a stream sees its place in line every second instead)
DEFAULT_MAX_WAIT_S = 60.0
