"""`ebb`: the desktop window. Shows the window at once; the model loads in the background."""
from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="ebb", description="Ebb: private, local, multimodal chat.")
    ap.add_argument("--model", default="default", help="GGUF path, or 'default' (SmolLM2-135M)")
    ap.add_argument("--ctx", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from PySide6.QtWidgets import QApplication, QMessageBox

    from app.window import MainWindow
    from engine.errors import EbbError
    from engine.models import resolve_model_path
    from engine.runtime import LoadParams

    app = QApplication(sys.argv[:1])
    app.setApplicationName("Ebb")
    try:
        params = LoadParams(model_path=resolve_model_path(args.model), n_ctx=args.ctx,
                            n_threads=args.threads)
    except EbbError as exc:
        QMessageBox.critical(None, "Ebb", str(exc))
        return 2
    window = MainWindow(params)
    window.show()
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
