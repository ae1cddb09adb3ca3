"""A GGUF on the Hugging Face Hub (or a mirror: HF_ENDPOINT), read without downloading it:
its header and tensor table sit at the front of the file, so HTTP range requests for the first
few hundred KB, grown until the table ends, give the same `GGUFFile` that `read_gguf` gives
for the downloaded file. Ebb's model reading and planning then judge it for this machine
before a byte of weights moves.

huggingface_hub builds the URLs, headers and token (HF_TOKEN, or the one passed) and owns the
HTTP session; the growing range read is Ebb's (the library downloads whole files). Any thread.
"""
from __future__ import annotations

from typing import Any

from engine.errors import EbbError
from engine.gguf.info import GGUFFile, HeaderIncomplete, parse_gguf_prefix

FIRST_BYTES = 512 << 10  # most headers end here; a 150k-token vocabulary needs a few MB
MAX_HEADER_BYTES = 64 << 20  # a header past this is not one Ebb will read remotely
TIMEOUT_S = 30.0
# every Hub call: how long to wait for the connection, and for each answer on it
HUB_CONNECT_S, HUB_READ_S = 10.0, 30.0


def check_reachable(endpoint: str, timeout_s: float = 3.0) -> None:
    """Fail at once, in one line, when the Hub's host does not answer at all (no network): the
    client's own retries would take half a minute to say the same. Behind a proxy the client
    goes through it, so nothing is checked here."""
    import os
    import socket
    import urllib.parse

    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy",
                                       "ALL_PROXY", "all_proxy")):
        return
    url = urllib.parse.urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=timeout_s).close()
    except OSError as exc:
        raise EbbError(f"cannot reach the Hub at {endpoint} ({exc.strerror or exc})",
                       "check the network, or set a mirror (HF_ENDPOINT, or Settings → Hugging "
                       "Face Hub mirror)") from None


class HubSilent(Exception):
    """The Hub took the connection and did not answer in time (not retried)."""


def hub_error(exc: Exception, what: str, endpoint: str) -> EbbError:
    """One clear line for what went wrong talking to the Hub."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status in (401, 403):
        return EbbError(f"{what} is gated or private ({status})",
                        "accept the licence on the model's page, then add a token "
                        "(HF_TOKEN, or Settings → Hugging Face Hub token)")
    if status == 404:
        return EbbError(f"{what} was not found on {endpoint} (404)", "check the name")
    if status is not None:
        return EbbError(f"the Hub answered {status} for {what}", "try again later")
    if isinstance(exc, HubSilent) or "timeout" in type(exc).__name__.lower():
        return EbbError(f"the Hub at {endpoint} took the connection but did not answer within "
                        f"{HUB_READ_S:.0f} s ({what})",
                        "try again later, or set a mirror (HF_ENDPOINT, or Settings → Hugging "
                        "Face Hub mirror)")
    return EbbError(f"cannot reach the Hub at {endpoint} ({type(exc).__name__}: {exc})",
                    "check the network, or set a mirror (HF_ENDPOINT, or Settings → Hugging "
                    "Face Hub mirror)")


def _read_range(session: Any, url: str, headers: dict[str, str], start: int,
                end: int) -> tuple[bytes, int]:
    """Bytes start..end-1 (fewer at the end of the file) and the file's size. A server that
    ignores Range sends the whole file: only what was asked is read from it."""
    with session.stream("GET", url, headers={**headers, "Range": f"bytes={start}-{end - 1}"},
                        follow_redirects=True, timeout=TIMEOUT_S) as r:
        r.raise_for_status()
        total = r.headers.get("content-range", "").rpartition("/")[2]
        if r.status_code == 206 and total.isdigit():
            size = int(total)
        elif r.status_code == 200 and start == 0:
            size = int(r.headers.get("content-length", "0") or 0)
        else:
            raise EbbError(f"the Hub answered {r.status_code} to a range request for {url}",
                           "try again later, or another mirror")
        data = bytearray()
        for part in r.iter_bytes():
            data += part
            if len(data) >= end - start:
                break
        return bytes(data[:end - start]), size


def remote_gguf(repo: str, filename: str, revision: str = "main", endpoint: str | None = None,
                token: str | None = None) -> GGUFFile:
    """The header and tensor table of `filename` in model repo `repo`, read by ranges."""
    from huggingface_hub import constants, get_session, hf_hub_url
    from huggingface_hub.utils import build_hf_headers  # type: ignore[attr-defined]

    endpoint = endpoint or constants.ENDPOINT
    url = hf_hub_url(repo, filename, revision=revision, endpoint=endpoint)
    headers = build_hf_headers(token=token)
    what = f"{repo}/{filename}"
    data, size, want = b"", 0, FIRST_BYTES
    try:
        while True:
            more, size = _read_range(get_session(), url, headers, len(data), want)
            data += more
            try:
                return parse_gguf_prefix(data, size, what)
            except HeaderIncomplete:
                if len(data) >= size or want >= MAX_HEADER_BYTES or not more:
                    raise EbbError(f"{what}'s header is longer than {len(data) >> 20} MiB or "
                                   "the file ends inside it", "pick another file") from None
                want = min(want * 4, MAX_HEADER_BYTES)
    except EbbError:
        raise
    except Exception as exc:  # noqa: BLE001 - HTTP and network errors of many kinds
        raise hub_error(exc, what, endpoint) from None
