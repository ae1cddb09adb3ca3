"""A chat written out: Markdown or JSON, the open branch or every branch, with what makes it
reproducible (the model, the system prompt, the sampling) and its pictures copied beside the
file (`NAME_files/`), so the export stands on its own and never points into Ebb's data folder.
No Qt here.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from app.core.store import Message, Store
from engine.media.kinds import PICTURE, kind_of


def export_chat(store: Store, conversation_id: int, out: Path, every_branch: bool = False,
                meta: dict[str, Any] | None = None) -> Path:
    """Write the chat to `out` (Markdown, or JSON for a .json name) and its pictures into a
    folder beside it. OSError when it cannot be written."""
    out = Path(out)
    branches = _branches(store, conversation_id, every_branch)
    pictures: dict[Path, str] = {}
    for branch in branches:
        for m in branch:
            for p in m.images:
                pictures.setdefault(p, f"{out.stem}_files/{p.name}")
    if pictures:
        folder = out.with_name(f"{out.stem}_files")
        folder.mkdir(exist_ok=True)
        for src, rel in pictures.items():
            if src.is_file():
                shutil.copyfile(src, out.parent / rel)
    fmt = "json" if out.suffix.lower() == ".json" else "md"
    out.write_text(render(store, conversation_id, fmt, every_branch, meta, pictures),
                   encoding="utf-8")
    return out


def _branches(store: Store, cid: int, every_branch: bool) -> list[list[Message]]:
    """The open branch first; with `every_branch`, then each other branch, oldest first."""
    open_branch = store.messages(cid)
    if not every_branch:
        return [open_branch]
    leaf = open_branch[-1].id if open_branch else 0
    others = [store.messages(cid, ids=store.branch_to(x)) for x in store.leaves(cid) if x != leaf]
    return [open_branch, *others]


def render(store: Store, cid: int, fmt: str, every_branch: bool = False,
           meta: dict[str, Any] | None = None, pictures: dict[Path, str] | None = None) -> str:
    """The chat as text; pictures by the names in `pictures` (else by their path)."""
    pictures = pictures or {}
    meta = dict(meta or {})
    branches = _branches(store, cid, every_branch)
    models = [m.stats.model for b in branches for m in b if m.stats.model]
    meta.setdefault("model", models[-1] if models else None)

    def pic(p: Path) -> str:
        return pictures.get(p) or p.as_posix()

    def item(m: Message) -> dict[str, Any]:
        d = {"id": m.id, "parent_id": m.parent_id, "role": m.role, "text": m.text,
             "images": [pic(p) for p in m.images], "stats": m.stats.to_json(), "state": m.state}
        if m.fragments:  # what was taken from a video or a PDF ("frames=0,2,4", "pages=3-5")
            d["taken"] = {pic(p): f for p, f in ((Path(k), v) for k, v in m.fragments.items())}
        if m.tool is not None:  # a tool's call: which, with what, how it went (text: its result)
            d["tool"] = m.tool
        return d

    def attachment(m: Message, p: Path) -> str:
        """A picture shown; a clip, a video or a document linked, with what was taken."""
        if kind_of(p) == PICTURE:
            return f"![{p.name}]({pic(p)})"
        taken = m.fragments.get(str(p), "")
        return f"[{m.shown_names.get(str(p), p.name)}]({pic(p)})" + (f" ({taken})" if taken else "")

    title = store.title(cid)
    if fmt == "json":
        doc: dict[str, Any] = {"title": title, **meta, "messages": [item(m) for m in branches[0]]}
        if every_branch:
            doc["other_branches"] = [[item(m) for m in b] for b in branches[1:]]
        return json.dumps(doc, indent=1, ensure_ascii=False)
    out = [f"# {title}", ""]
    about = [f"model: {meta['model']}" if meta.get("model") else "",
             f"system prompt: {meta['system_prompt']}" if meta.get("system_prompt") else "",
             ", ".join(f"{k} {v}" for k, v in (meta.get("sampling") or {}).items())]
    if any(about):
        out += ["> " + " · ".join(a for a in about if a), ""]
    level = "##"
    for k, branch in enumerate(branches):
        if every_branch:
            out += [f"## Branch {k + 1} of {len(branches)}" + (" (open)" if k == 0 else ""), ""]
            level = "###"
        for m in branch:
            if m.role == "tool":
                t = m.tool or {}
                out += [f"{level} Tool: {t.get('label', '?')} ({t.get('state', '')})", "",
                        "```json", json.dumps(t.get("arguments", {}), ensure_ascii=False), "```", ""]
                out += [attachment(m, p) for p in m.images]
                if m.text:
                    out += ["```", m.text, "```", ""]
                continue
            out += [f"{level} {'You' if m.role == 'user' else 'Ebb'}", ""]
            out += [attachment(m, p) for p in m.images]
            out += [m.text, ""]
    return "\n".join(out)
