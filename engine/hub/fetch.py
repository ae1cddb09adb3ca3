"""A model and its projector fetched as a pair into Ebb's models folder, where File → Open
model finds them (a projector beside its model is offered with it), with a note of what they
are. Any thread; `cancel` pauses between reads (download.py)."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.hub.catalog import HubFile, Quant
from engine.hub.download import Progress, download_file
from engine.json_file import read_object, write_object

PAIR_NOTE = "ebb-pair.json"


def repo_folder(repo: str, root: Path | None = None) -> Path:
    """Where a repo's files go: MODELS/hub/OWNER/NAME (Ebb's models folder by default)."""
    from engine.paths import models_dir

    return (root or models_dir()) / "hub" / Path(*repo.split("/"))


@dataclass(frozen=True)
class Fetched:
    model: Path  # the first part of a split model: llama.cpp finds the others beside it
    projector: Path | None


def fetch_pair(repo: str, quant: Quant, projector: HubFile | None, endpoint: str | None = None,
               token: str | None = None, on_progress: Callable[[Progress], None] | None = None,
               cancel: threading.Event | None = None, root: Path | None = None) -> Fetched:
    folder = repo_folder(repo, root)
    paths = [download_file(repo, part, folder / part.name, endpoint, token, on_progress, cancel)
             for part in quant.parts]
    proj = None
    if projector is not None:
        proj = download_file(repo, projector, folder / projector.name, endpoint, token,
                             on_progress, cancel)
    note = folder / PAIR_NOTE
    pairs = read_object(note)  # a damaged note is written anew, not a failure after a download
    pairs[paths[0].name] = {"repo": repo, "quant": quant.label,
                            "projector": proj.name if proj is not None else None}
    with contextlib.suppress(OSError):  # the files are there: the note only helps pair them
        write_object(note, pairs, indent=1)
    return Fetched(paths[0], proj)


def paired_projector(model: Path) -> Path | None:
    """The projector downloaded with `model` (its folder's pairing note), if it is still there:
    File → Open model offers it first."""
    entry = read_object(Path(model).parent / PAIR_NOTE).get(Path(model).name)
    name = entry.get("projector") if isinstance(entry, dict) else None
    if isinstance(name, str) and name and (Path(model).parent / name).is_file():
        return Path(model).parent / name
    return None
