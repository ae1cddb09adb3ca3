"""A hub of our own on loopback that speaks the part of the Hugging Face Hub's HTTP API Ebb
uses, so the real `huggingface_hub` client can be tested with no network: model search
(`GET /api/models`), a repo's files with sizes and LFS sha256 (`GET /api/models/R/tree/REV`),
and file contents (`GET`/`HEAD /R/resolve/REV/F`, with Range, ETag and a redirect, as the Hub
sends a client to its CDN). Faults for the download tests: a 401 for gated repos.

Used as `with LoopbackHub() as hub: hub.add(repo, files, tags=...)`; `hub.endpoint` is what
HF_ENDPOINT would be.
"""
from __future__ import annotations

import hashlib
import http.server
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Repo:
    files: dict[str, Path]
    tags: list[str] = field(default_factory=list)
    pipeline_tag: str | None = None
    downloads: int = 0
    last_modified: str = "2026-01-01T00:00:00.000Z"
    gated: bool = False


class LoopbackHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, str]] = []  # (method, path, Range header)
        # faults: the next file responses drop the connection at these absolute byte offsets
        self.cuts: list[int] = []
        self.flip: dict[str, int] = {}  # file name -> offset of a byte served wrong
        self.stall: tuple[int, float] | None = None  # (offset, seconds): the next body stops there
        self._sha: dict[Path, str] = {}
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, head=True)

            def do_GET(self) -> None:
                hub._answer(self, head=False)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> LoopbackHub:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add(self, repo: str, files: dict[str, Path], **info: object) -> None:
        self.repos[repo] = Repo(files, **info)  # type: ignore[arg-type]

    def sha256(self, path: Path) -> str:
        if path not in self._sha:
            self._sha[path] = hashlib.sha256(path.read_bytes()).hexdigest()
        return self._sha[path]

    # ---------------------------------------------------------------- the routes

    def _answer(self, h: http.server.BaseHTTPRequestHandler, head: bool) -> None:
        url = urllib.parse.urlsplit(h.path)
        path = urllib.parse.unquote(url.path)
        query = urllib.parse.parse_qs(url.query)
        self.requests.append((h.command, path, h.headers.get("Range", "")))
        if path == "/api/models":
            return self._json(h, self._search(query))
        if path.startswith("/api/models/") and "/tree/" in path:
            repo, _, rest = path[len("/api/models/"):].partition("/tree/")
            return self._tree(h, repo)
        if "/resolve/" in path:
            repo, _, rest = path.lstrip("/").partition("/resolve/")
            _revision, _, filename = rest.partition("/")
            if path.startswith("/cdn/"):
                return self._file(h, repo[len("cdn/"):], filename, head)
            # as the Hub does for LFS files: a redirect to where the bytes are
            return self._send(h, 302, b"", {"Location": f"/cdn/{repo}/resolve/main/{filename}"})
        return self._json(h, {"error": "not found"}, 404)

    def _search(self, query: dict[str, list[str]]) -> list[dict[str, object]]:
        words = (query.get("search") or [""])[0].lower()
        wanted = set(query.get("filter", []))
        found = [(name, r) for name, r in self.repos.items()
                 if words in name.lower() and wanted <= set(r.tags)]
        key = (query.get("sort") or ["downloads"])[0]
        found.sort(key=lambda nr: nr[1].last_modified if key in ("lastModified", "last_modified")
                   else nr[1].downloads, reverse=True)
        limit = int((query.get("limit") or ["1000"])[0])
        return [{"id": name, "modelId": name, "private": False, "downloads": r.downloads,
                 "likes": 0, "tags": r.tags, "pipeline_tag": r.pipeline_tag,
                 "lastModified": r.last_modified, "gated": r.gated,
                 "siblings": [{"rfilename": f} for f in sorted(r.files)]}
                for name, r in found[:limit]]

    def _tree(self, h: http.server.BaseHTTPRequestHandler, repo: str) -> None:
        r = self.repos.get(repo)
        if r is None:
            return self._json(h, {"error": "Repository not found"}, 404)
        if r.gated and not h.headers.get("Authorization"):
            return self._json(h, {"error": "Access to this repo is restricted"}, 401)
        entries = [{"type": "file", "path": name, "size": p.stat().st_size,
                    "oid": hashlib.sha1(name.encode()).hexdigest(),
                    "lfs": {"oid": self.sha256(p), "size": p.stat().st_size, "pointerSize": 134}}
                   for name, p in sorted(r.files.items())]
        self._json(h, entries)

    def _file(self, h: http.server.BaseHTTPRequestHandler, repo: str, filename: str,
              head: bool) -> None:
        r = self.repos.get(repo)
        path = r.files.get(filename) if r else None
        if r is None or path is None:
            return self._json(h, {"error": "Entry not found"}, 404)
        if r.gated and not h.headers.get("Authorization"):
            return self._json(h, {"error": "Access to this repo is restricted"}, 401)
        size = path.stat().st_size
        start, end = 0, size - 1
        spec = h.headers.get("Range", "")
        status = 200
        if spec.startswith("bytes="):
            a, _, b = spec[len("bytes="):].partition("-")
            start, end = int(a or 0), min(int(b) if b else size - 1, size - 1)
            status = 206
        with open(path, "rb") as fh:
            fh.seek(start)
            body = fh.read(max(0, end - start + 1))
        if filename in self.flip and start <= self.flip[filename] <= end:
            i = self.flip[filename] - start
            body = body[:i] + bytes([body[i] ^ 0xFF]) + body[i + 1:]
        length = len(body)
        cut = next((c for c in self.cuts if start < c <= end), None)
        if cut is not None and not head:
            self.cuts.remove(cut)
            body = body[:cut - start]  # the connection drops there (Content-Length says more)
        headers = {"ETag": f'"{self.sha256(path)}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        stall, self.stall = (self.stall, None) if self.stall and start < self.stall[0] <= end \
            and not head else (None, self.stall)
        if stall is not None:  # the first bytes, then nothing for a while (a stalled link)
            self._send(h, status, body[:stall[0] - start], headers, length=length)
            time.sleep(stall[1])
            h.close_connection = True
            return
        self._send(h, status, b"" if head else body, headers,
                   length=length if not head else end - start + 1)
        if cut is not None:
            h.close_connection = True

    def _json(self, h: http.server.BaseHTTPRequestHandler, obj: object, status: int = 200) -> None:
        self._send(h, status, json.dumps(obj).encode(), {"Content-Type": "application/json"})

    @staticmethod
    def _send(h: http.server.BaseHTTPRequestHandler, status: int, body: bytes,
              headers: dict[str, str], length: int | None = None) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body) if length is None else length))
        h.end_headers()
        if body:
            try:
                h.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):  # the client read what it wanted
                pass
