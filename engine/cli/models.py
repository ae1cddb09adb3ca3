"""`ebb-engine models search|show|get`: GGUF models on the Hugging Face Hub (or the mirror in
HF_ENDPOINT), judged for this machine from their headers before anything is downloaded, and
fetched so that nothing is lost (engine/hub)."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
from typing import TYPE_CHECKING, Any

from engine.cli.common import Subcommands, flag_parser, install_sigint
from engine.errors import EbbError
from engine.units import fmt_bytes

if TYPE_CHECKING:
    from engine.hub.catalog import Quant, RepoFiles


def _hub_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", default=None, metavar="URL",
                   help="a Hub mirror (default: HF_ENDPOINT, else huggingface.co)")
    p.add_argument("--token", default=None, help="for gated or private repos (default: HF_TOKEN)")


def cmd_search(args: argparse.Namespace) -> int:
    from engine.hub.catalog import search

    hits = search(args.query, args.images, args.sort, args.limit, args.endpoint, args.token)
    if args.json:
        print(json.dumps([h.__dict__ for h in hits]))
        return 0
    if not hits:
        print("no GGUF repositories found" + (" that see images" if args.images else ""))
    for h in hits:
        print(f"{h.repo:60s} {h.downloads:>10,} downloads  {h.last_modified[:10]}"
              + ("  [sees images]" if h.sees_images else ""))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """The repo's quantisations, each with this machine's verdict from its remote header."""
    from engine.hub.catalog import repo_files
    from engine.hub.verdict import judge_remote, remote_projector, this_machine

    files = repo_files(args.repo, args.endpoint, args.token)
    machine = this_machine(args.threads)
    projector = None
    if files.projectors:
        try:
            projector = remote_projector(args.repo, files.projectors[0], args.endpoint, args.token)
        except EbbError as exc:  # judged as text only, and said
            print(f"ebb-engine: the projector {files.projectors[0].name} cannot be read: {exc}",
                  file=sys.stderr)
    rows: list[dict[str, Any]] = []  # printed as JSON
    for q in files.quants:
        try:
            v: dict[str, Any] = judge_remote(args.repo, q, projector, machine, args.endpoint, args.token,
                                  args.ctx).to_dict()
        except EbbError as exc:
            v = {"text": f"cannot judge: {exc}", "fits": None}
        rows.append({"quant": q.label, "files": [p.name for p in q.parts],
                     "size_bytes": q.size_bytes, "verdict": v})
    if args.json:
        print(json.dumps({"repo": args.repo, "quants": rows, "projectors": [
            {"name": p.name, "size_bytes": p.size_bytes} for p in files.projectors]}))
        return 0
    print(f"{args.repo}: judged for this machine ({machine.accel or 'CPU only'}), context {args.ctx}")
    for r in rows:
        split = f" in {len(r['files'])} parts" if len(r["files"]) > 1 else ""
        print(f"  {r['quant']:10s} {fmt_bytes(r['size_bytes']):>10s}{split}  {r['verdict']['text']}")
    for p in files.projectors:
        print(f"  projector  {fmt_bytes(p.size_bytes):>10s}  {p.name}")
    if not files.projectors:
        print("  no projector: text only")
    return 0


def _recommended(args: argparse.Namespace, files: RepoFiles) -> Quant:
    """No quantisation named: the one `recommend` picks for this machine, said with why."""
    from engine.hub.verdict import judge_remote, recommend, remote_projector, this_machine

    machine = this_machine(getattr(args, "threads", None))
    projector = None
    if files.projectors and not args.no_mmproj:
        with contextlib.suppress(EbbError):  # judged as text only
            projector = remote_projector(args.repo, files.projectors[0], args.endpoint, args.token)
    judged, refused = [], []
    for q in files.quants:
        try:  # a header that cannot be read, or a broken set, is not picked
            judged.append((q.label, judge_remote(args.repo, q, projector, machine, args.endpoint,
                                                 args.token)))
        except EbbError as exc:
            refused.append(f"{q.label}: {exc.what}")
    pick = recommend(judged)
    if pick is None and not judged:
        raise EbbError(f"none of {args.repo}'s quantisations can be loaded: " + "; ".join(refused),
                       "pick another repo")
    if pick is None:
        raise EbbError(f"none of {args.repo}'s quantisations fits this machine",
                       "see `ebb-engine models show " + args.repo + "` for each one's verdict")
    label, why = pick
    print(f"ebb-engine: picked {label} for this machine: {why}", file=sys.stderr, flush=True)
    return next(q for q in files.quants if q.label == label)


def cmd_get(args: argparse.Namespace) -> int:
    """Download a quantisation (all its parts) and the projector, resumable; Ctrl-C pauses."""
    from engine.hub.catalog import repo_files
    from engine.hub.download import DownloadPaused, Progress
    from engine.hub.fetch import fetch_pair

    files = repo_files(args.repo, args.endpoint, args.token)
    quant: Quant | None
    if args.quant is None:
        quant = _recommended(args, files)
    else:
        quant = next((q for q in files.quants if q.label.lower() == args.quant.lower()
                      or q.parts[0].name == args.quant), None)
    if quant is None:
        raise EbbError(f"{args.repo} has no quantisation {args.quant!r}",
                       "pick one of " + ", ".join(q.label for q in files.quants))
    if args.quant is not None:  # a broken set or a file that is no GGUF: said before downloading
        from engine.hub.verdict import remote_model

        remote_model(args.repo, quant, args.endpoint, args.token)
    projector = None
    if not args.no_mmproj and files.projectors:
        projector = next((p for p in files.projectors if p.name == args.mmproj),
                         files.projectors[0]) if args.mmproj else files.projectors[0]
    cancel = threading.Event()
    install_sigint(cancel)

    def show(p: Progress) -> None:
        print(f"\r{p.words()}   ", end="", file=sys.stderr, flush=True)

    try:
        got = fetch_pair(args.repo, quant, projector, args.endpoint, args.token,
                         None if args.json else show, cancel)
    except DownloadPaused:
        print("\npaused: run the same command again to go on", file=sys.stderr)
        return 130
    if not args.json:
        print(file=sys.stderr)
    from engine.gguf.info import read_gguf

    read_gguf(got.model)  # "ready" only for what llama.cpp can load: the set on disk, checked
    out = {"model": str(got.model), "projector": str(got.projector) if got.projector else None}
    print(json.dumps(out) if args.json else
          f"ready: {got.model}" + (f"\n  with {got.projector}" if got.projector else "")
          + f"\nopen it: ebb --model {got.model}"
          + (f" --mmproj {got.projector}" if got.projector else ""))
    return 0


def register(sub: Subcommands) -> None:
    p = sub.add_parser("models", help="find GGUF models on the Hugging Face Hub, judge them for "
                                      "this machine, download them")
    models = p.add_subparsers(dest="models_command", required=True)
    s = models.add_parser("search", help="GGUF repositories by name", parents=[flag_parser("json")])
    s.add_argument("query", nargs="?", default="")
    s.add_argument("--images", action="store_true", help="only models that can see images")
    s.add_argument("--sort", choices=["downloads", "updated"], default="downloads")
    s.add_argument("--limit", type=int, default=20)
    _hub_flags(s)
    s.set_defaults(func=cmd_search)
    s = models.add_parser("show", help="a repo's quantisations and projectors, each judged for "
                                       "this machine from its header (nothing downloaded)",
                          parents=[flag_parser("json", "threads")])
    s.add_argument("repo")
    s.add_argument("--ctx", type=int, default=4096)
    _hub_flags(s)
    s.set_defaults(func=cmd_show)
    s = models.add_parser("get", help="download a quantisation and its projector (resumable)",
                          parents=[flag_parser("json")])
    s.add_argument("repo")
    s.add_argument("quant", nargs="?", default=None,
                   help="Q4_K_M, ... or a file name (default: the one that suits this machine "
                        "best, said with why)")
    s.add_argument("--mmproj", default=None, metavar="FILE", help="which projector (default: the "
                   "largest, so least quantised)")
    s.add_argument("--no-mmproj", action="store_true", help="the language model only")
    _hub_flags(s)
    s.set_defaults(func=cmd_get)
