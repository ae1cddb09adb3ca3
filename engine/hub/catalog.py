"""Finding GGUF models on the Hugging Face Hub (or a mirror): search, and a repo's files sorted
into quantisations (split files joined) and vision projectors, with sizes and LFS sha256.
`huggingface_hub`'s HfApi does the talking (search, listings, token, HF_ENDPOINT); this module
only sorts what it returns. Any thread.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from engine.errors import EbbError
from engine.hub import remote
from engine.hub.remote import check_reachable, hub_error

SORTS = {"downloads": "downloads", "updated": "lastModified"}
IMAGE_PIPELINES = frozenset({"image-text-to-text", "image-to-text", "visual-question-answering"})
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")
_QUANT = re.compile(r"(?i)(?:^|[-_.])((?:I?Q\d(?:_[A-Z0-9]+)*)|BF16|F16|F32|FP16|FP32)(?=[-_.])")


@dataclass(frozen=True)
class HubFile:
    name: str
    size_bytes: int
    sha256: str | None  # the Hub's LFS hash: what a finished download is checked against


@dataclass(frozen=True)
class Quant:
    """One quantisation of the model: one file, or the parts of a split one in order."""
    label: str  # Q4_K_M, F16, ... (the file's name when it says none)
    parts: tuple[HubFile, ...]
    missing: tuple[str, ...] = ()  # a split set's parts the repo lacks: it cannot be loaded

    @property
    def size_bytes(self) -> int:
        return sum(p.size_bytes for p in self.parts)


@dataclass(frozen=True)
class RepoFiles:
    repo: str
    quants: tuple[Quant, ...]
    projectors: tuple[HubFile, ...]  # mmproj files, best (largest, so least quantised) first


@dataclass(frozen=True)
class RepoHit:
    repo: str
    downloads: int
    last_modified: str
    sees_images: bool  # it has an mmproj file or an image-text pipeline tag


def is_projector(name: str) -> bool:
    return "mmproj" in name.lower()


def quant_label(name: str) -> str:
    m = _QUANT.search(name.rsplit("/", 1)[-1])
    return m.group(1).upper() if m else name.rsplit("/", 1)[-1].removesuffix(".gguf")


def sort_files(repo: str, files: list[HubFile]) -> RepoFiles:
    """GGUF files into quantisations (the parts of a split one together, in order) and
    projectors; an incomplete split set is kept with the names of its missing parts (listed,
    judged as "cannot be loaded", never downloaded)."""
    ggufs = [f for f in files if f.name.lower().endswith(".gguf")]
    projectors = sorted((f for f in ggufs if is_projector(f.name)), key=lambda f: -f.size_bytes)
    splits: dict[str, list[tuple[int, int, HubFile]]] = {}
    quants = []
    for f in ggufs:
        if is_projector(f.name):
            continue
        m = _SPLIT.match(f.name)
        if m is None:
            quants.append(Quant(quant_label(f.name), (f,)))
            continue
        splits.setdefault(m["stem"], []).append((int(m["part"]), int(m["count"]), f))
    for stem, parts in splits.items():
        parts.sort(key=lambda p: p[0])
        count = max(p[1] for p in parts)
        have = {p[0] for p in parts}
        missing = tuple(f"{stem}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1) if i not in have)
        quants.append(Quant(quant_label(stem + ".gguf"), tuple(p[2] for p in parts), missing))
    quants.sort(key=lambda q: q.size_bytes)
    return RepoFiles(repo, tuple(quants), tuple(projectors))


def _api(endpoint: str | None, token: str | None) -> Any:
    from huggingface_hub import HfApi

    with_timeouts()
    return HfApi(endpoint=endpoint, token=token)


def with_timeouts() -> None:
    """Every call through `huggingface_hub` gets connect and read timeouts (remote.py's
    HUB_CONNECT_S, HUB_READ_S): its own client waits for ever (`timeout=None`), and a hub that
    accepted the connection and never answered held `models search` and the dialog at
    "Searching…" for good (#52)."""
    global _timeouts_set
    if _timeouts_set:
        return
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import _http

    def enforce(request: Any) -> None:
        """huggingface_hub asks for no timeout on each request (timeout=None): the request's
        own timeouts, after it was built, are what the transport obeys."""
        asked = request.extensions.get("timeout") or {}
        request.extensions["timeout"] = {
            "connect": asked.get("connect") or remote.HUB_CONNECT_S,
            "pool": asked.get("pool") or remote.HUB_CONNECT_S,
            "read": asked.get("read") or remote.HUB_READ_S,
            "write": asked.get("write") or remote.HUB_READ_S}

    import httpx2

    class SilenceEnds(httpx2.HTTPTransport):
        """A hub that says nothing within the timeout is not asked again: huggingface_hub
        retries timeouts five times with backoff (over three minutes at 30 s each)."""

        def handle_request(self, request: Any) -> Any:
            try:
                return super().handle_request(request)
            except httpx2.TimeoutException as exc:
                raise remote.HubSilent(str(exc) or type(exc).__name__) from exc

    def factory() -> Any:  # called when huggingface_hub makes its client: its own, but these
        return httpx2.Client(event_hooks={"request": [_http.hf_request_event_hook, enforce]},
                             follow_redirects=True, timeout=None, transport=SilenceEnds())

    set_client_factory(factory)
    _timeouts_set = True


_timeouts_set = False


def search(query: str, sees_images: bool = False, sort: str = "downloads", limit: int = 20,
           endpoint: str | None = None, token: str | None = None) -> list[RepoHit]:
    """GGUF repositories whose name matches `query`, most downloaded (or recently updated)
    first; `sees_images`: only those that can see pictures."""
    from huggingface_hub import constants

    if sort not in SORTS:
        raise EbbError(f"unknown sort '{sort}'", f"use one of {', '.join(SORTS)}")
    check_reachable(endpoint or constants.ENDPOINT)
    try:
        found = list(_api(endpoint, token).list_models(
            search=query or None, filter="gguf", sort=SORTS[sort], limit=limit,
            expand=["downloads", "lastModified", "pipeline_tag", "tags", "siblings"]))
    except Exception as exc:  # noqa: BLE001 - HTTP and network errors of many kinds
        raise hub_error(exc, f"the search for {query!r}", endpoint or constants.ENDPOINT) from None
    hits = []
    for m in found:
        names = [s.rfilename for s in (getattr(m, "siblings", None) or [])]
        images = (getattr(m, "pipeline_tag", None) in IMAGE_PIPELINES
                  or any(is_projector(n) for n in names))
        if images or not sees_images:
            modified = getattr(m, "last_modified", None)
            hits.append(RepoHit(m.id, int(getattr(m, "downloads", 0) or 0),
                                modified.isoformat() if modified is not None else "", images))
    return hits


def repo_files(repo: str, endpoint: str | None = None, token: str | None = None) -> RepoFiles:
    """The repo's GGUF files with sizes and LFS sha256. A repo with none is an EbbError."""
    from huggingface_hub import constants
    from huggingface_hub.hf_api import RepoFile

    check_reachable(endpoint or constants.ENDPOINT)
    try:
        tree = list(_api(endpoint, token).list_repo_tree(repo, recursive=True, expand=True))
    except Exception as exc:  # noqa: BLE001 - HTTP and network errors of many kinds
        raise hub_error(exc, repo, endpoint or constants.ENDPOINT) from None
    files = [HubFile(e.path, int(e.size or 0), e.lfs.sha256 if e.lfs is not None else None)
             for e in tree if isinstance(e, RepoFile)]
    out = sort_files(repo, files)
    if not out.quants and not out.projectors:
        raise EbbError(f"{repo} has no GGUF files", "pick a repo whose files end in .gguf "
                       "(llama.cpp's format; many repos named -GGUF have them)")
    if not out.quants:
        raise EbbError(f"{repo} has only projector files (mmproj), no language model",
                       "find the model's own GGUF repo, or pick the projector beside a model")
    return out
