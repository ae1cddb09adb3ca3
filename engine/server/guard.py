"""What keeps the local endpoint to the clients it is meant for, on a desktop where every web
page the user opens can reach loopback.

- A "simple" cross-origin POST (text/plain, form data) needs no CORS preflight: a page could
  run the model blind. So a body must be `application/json`, and a request that carries an
  `Origin` not allowed (`--cors`) is refused, whatever its method.
- DNS rebinding gives a page's own host name the address 127.0.0.1, and then its scripts may
  read the answers. So the `Host` header must name the address the server listens on: the
  loopback names when it listens on loopback, an address literal or an allowed name otherwise
  (a rebinding needs a name; `--allow-host NAME` adds one, e.g. behind a proxy).

Pure: `refusal` takes a request's method and headers and returns the error to send, or None.
`RequestGuard` is the ASGI middleware that applies it (uvicorn's event loop thread).
"""
from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.server.errors import ApiError

LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _address(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return None


def host_name(header: str) -> str:
    """The name in a Host header, without its port: "[::1]:8080" -> "::1"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else ""  # "[::1" is no name
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


@dataclass(frozen=True)
class Policy:
    """Who may call: the address the server listens on, names allowed beside it, and the
    origins whose browser pages may call it (none by default)."""
    listen_host: str = "127.0.0.1"
    allow_hosts: tuple[str, ...] = ()
    origins: tuple[str, ...] = ()

    def host_allowed(self, header: str) -> bool:
        name = host_name(header)
        if not name:
            return False
        if name in {h.lower() for h in self.allow_hosts} or name == self.listen_host.lower():
            return True
        address, listen = _address(name), _address(self.listen_host)
        if listen is None:  # listening on a name: that name (above) or the loopback ones
            return self.listen_host.lower() in LOOPBACK_NAMES and (
                name in LOOPBACK_NAMES or bool(address and address.is_loopback))
        if listen.is_loopback:
            return name in LOOPBACK_NAMES or bool(address and address.is_loopback)
        if listen.is_unspecified:  # every interface: any address literal, or localhost
            return address is not None or name in LOOPBACK_NAMES
        return False

    def origin_allowed(self, origin: str, host_header: str) -> bool:
        """An allowed origin, or the server's own (the same scheme-less host and port)."""
        if origin in self.origins or "*" in self.origins:
            return True
        scheme, sep, rest = origin.partition("://")
        return bool(sep) and scheme in ("http", "https") and rest.lower() == host_header.lower()


FORM_PATHS = ("/v1/audio/transcriptions",)  # OpenAI's shape there is a multipart form


def refusal(method: str, headers: Mapping[str, str], policy: Policy, path: str = "") -> ApiError | None:
    """The error for a request the endpoint must not answer, else None. `headers`: lower-case
    names. A body must be JSON (a web page cannot send that without asking first), except the
    form OpenAI's audio endpoint takes: a page can post a form unasked, so there the Origin
    check above (a browser sends it with every cross-site post) and the key stand guard."""
    host = headers.get("host", "")
    if not policy.host_allowed(host):
        return ApiError(403, f"this server does not answer to the host name {host_name(host)!r}: "
                             "it answers requests addressed to the address it listens on "
                             f"({policy.listen_host}); start it with --allow-host NAME to add "
                             "a name", code="host_not_allowed")
    origin = headers.get("origin")
    if origin is not None and origin.strip().lower() == "null" and not policy.origin_allowed(origin, host):
        # not one page: every sandboxed frame, local file and data: URL a browser opens says it
        return ApiError(403, "requests with Origin: null are refused: a browser sends it for "
                             "sandboxed frames, pages opened from files and data: URLs, any of "
                             "which could be any site's; serve the page from an address and "
                             "start the server with --cors http://THAT-ADDRESS",
                        code="origin_not_allowed")
    if origin is not None and not policy.origin_allowed(origin, host):
        return ApiError(403, f"requests from web pages at {origin} are refused: start the server "
                             f"with --cors {origin} to let that page call it",
                        code="origin_not_allowed")
    if method in BODY_METHODS:
        kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if kind == "multipart/form-data" and path in FORM_PATHS:
            return None
        if kind != "application/json":
            return ApiError(415, f"the request body must be JSON sent as Content-Type: "
                                 f"application/json (this one is {kind or 'not labelled'}); "
                                 "with curl, add -H 'Content-Type: application/json'",
                            code="unsupported_media_type")
    return None


class RequestGuard:
    """ASGI middleware: refused requests get the error as JSON and never reach a route."""

    def __init__(self, app: Any, policy: Policy) -> None:
        self.app, self.policy = app, policy

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                       for k, v in scope.get("headers", [])}
            error = refusal(scope.get("method", "GET"), headers, self.policy, scope.get("path", ""))
            if error is not None:
                body = json.dumps(error.body()).encode()
                await send({"type": "http.response.start", "status": error.status,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
