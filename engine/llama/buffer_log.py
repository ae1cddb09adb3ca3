"""The device buffers llama.cpp allocated, read from its log ("CUDA0 model buffer size =
N MiB"): what a load or a context took on each device, by kind (model, KV, compute, output)."""
from __future__ import annotations

import re

from engine.llama import log as llama_log

_BUFFER_RE = re.compile(r"^\S+:\s+(\S+?)(?:\[([^\]]*)\])?\s+(model|KV|compute|output) buffer size =\s+([\d.]+) MiB")


def buffers_from_log() -> dict[tuple[str, str], int]:
    """{(device, kind): bytes} from llama.cpp's "X buffer size = N MiB" lines since clear()."""
    out: dict[tuple[str, str], int] = {}
    for _level, line in llama_log.recent(2000):
        m = _BUFFER_RE.match(line.strip())
        if m:
            dev = _device_of_buffer(m.group(1).replace("_Mapped", ""), m.group(2))
            key = (dev, m.group(3).lower())
            out[key] = out.get(key, 0) + int(float(m.group(4)) * 1024 * 1024)
    return out


def _device_of_buffer(name: str, endpoint: str | None) -> str:
    """ggml-rpc names buffers RPC<index on that server>[endpoint] and devices RPC<index in this
    process>: two servers both say RPC0. Map back to the device name."""
    if not endpoint or not name.startswith("RPC") or not name[3:].isdigit():
        return name
    from engine.llama.devices import remote_device_names

    on_server = remote_device_names(endpoint)
    i = int(name[3:])
    return on_server[i] if i < len(on_server) else name
