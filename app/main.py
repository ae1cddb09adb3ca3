"""`ebb`: the desktop window. Shows at once; the model loads in the background."""
from __future__ import annotations

import time

STARTED = time.monotonic()

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="ebb", description="Ebb: private, local, multimodal chat.")
    ap.add_argument("--model", default=None, help="GGUF path, or 'default' (SmolLM2-135M); "
                                                  "default: the last used model")
    ap.add_argument("--mmproj", default=None, help="vision projector GGUF, or 'demo' (random weights)")
    ap.add_argument("--rpc", action="append", default=[], metavar="HOST:PORT")
    ap.add_argument("--ctx", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    return ap.parse_args(argv)


def session_config(store: Any, model: str, mmproj: str, ctx: int | None = None,
                   threads: int | None = None, rpc: list[str] | None = None) -> tuple[Any, list[str]]:
    """A SessionConfig from the saved settings (remembering this model as the last used)."""
    from app.dialogs import DEFAULTS
    from engine.session import SessionConfig
    from engine.units import parse_size

    s = {k: store.setting(k, v) for k, v in DEFAULTS.items()}
    store.set_setting("model", model)
    store.set_setting("mmproj", mmproj)
    cfg = SessionConfig(
        model_path=Path(model), mmproj_path=Path(mmproj) if mmproj else None,
        n_ctx=ctx or int(s["ctx"]), n_threads=threads or (int(s["threads"]) or None),
        vram_budget_bytes=parse_size(s["vram_budget"]) if s["vram_budget"] else None,
        vision=str(s["vision"]), flash_attn=bool(s["flash_attn"]),
        image_max_tokens=int(s["image_max_tokens"]),
        gpu_layers=int(s["gpu_layers"]) if int(s["gpu_layers"]) >= 0 else None,
        spread=bool(s["spread"]))
    return cfg, list(rpc or []) + [r for r in s["rpc"] if r not in (rpc or [])]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from PySide6.QtCore import QTimer
    from PySide6.QtGui import QIcon
    from PySide6.QtWidgets import QApplication

    from app.resources import resource_path
    from app.store import Store
    from app.window import MainWindow
    from engine.models import DEFAULT_NAME
    from engine.paths import data_dir

    app = QApplication(sys.argv[:1])
    app.setApplicationName("Ebb")
    app.setStyle("Fusion")  # follows the system's light or dark scheme
    app.setWindowIcon(QIcon(str(resource_path("ebb.svg"))))
    store = Store(data_dir())
    model = args.model or store.setting("model") or DEFAULT_NAME
    if args.mmproj is not None:
        mmproj = args.mmproj
    elif args.model is None and store.setting("model"):
        mmproj = store.setting("mmproj", "")
    else:
        mmproj = "demo" if model == DEFAULT_NAME else ""
    cfg, rpc = session_config(store, model, mmproj, args.ctx, args.threads, args.rpc)
    window = MainWindow(store, cfg, rpc)
    window.show()
    if os.environ.get("EBB_QUIT_WHEN_SHOWN") == "1":  # for the start-up time test
        print(f"shown {time.monotonic() - STARTED:.3f}", flush=True)
        QTimer.singleShot(0, app.quit)
    code = app.exec()
    if window.isVisible():
        window.close()  # stops the engine thread even when the loop ended some other way
    store.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
