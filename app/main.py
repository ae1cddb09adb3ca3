"""`ebb`: the desktop window. Shows at once; the model loads in the background."""
from __future__ import annotations

import os
import signal
import time

STARTED = time.monotonic()


def _interrupted(signum: int, frame: object) -> None:
    """Ctrl-C in the terminal: one line and exit 130 at once (start-up imports included). What
    was saved is saved: the store commits every message, and a streaming reply every second."""
    os.write(2, b"ebb: interrupted\n")
    from engine import crashlog

    crashlog.discard()  # ended on purpose: nothing to report at the next start
    os._exit(130)


signal.signal(signal.SIGINT, _interrupted)

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402
import sys  # noqa: E402
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PySide6.QtWidgets import QApplication

    from app.core.store import Store
    from app.mainwindow.window import MainWindow
    from app.single_instance import FolderLock
    from engine import crashlog
    from engine.config import SessionConfig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="ebb", description="Ebb: private, local, multimodal chat.")
    ap.add_argument("--model", default=None, help="GGUF path, or 'default' (SmolLM2-135M); "
                                                  "default: the last used model")
    ap.add_argument("--mmproj", default=None, help="vision projector GGUF, or 'demo' (random weights)")
    ap.add_argument("--rpc", action="append", default=[], metavar="HOST:PORT")
    ap.add_argument("--ctx", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("paths", nargs="*", metavar="FILE",
                    help="a .gguf model or projector to open, or pictures and sound clips to attach "
                         "(what the desktop passes when a file is opened with Ebb)")
    args = ap.parse_args(argv)
    args.images = []
    for name in args.paths:  # a model, a projector or a picture, told apart by what it is
        if name.lower().endswith(".gguf"):
            if _is_projector(Path(name)):
                args.mmproj = args.mmproj or name
            else:
                args.model = args.model or name
        else:
            args.images.append(Path(name))
    return args


def _is_projector(path: Path) -> bool:
    from engine.errors import EbbError
    from engine.gguf.info import read_gguf

    try:
        return read_gguf(path).architecture == "clip"
    except EbbError:  # unreadable: opened as the model, whose load then says what is wrong
        return False


def relaunch(message: str, lost: list[str]) -> None:
    """ggml is about to abort (a remote device died mid-step): start the window again on the
    devices left, saying why. Called on the failing thread; never returns."""
    from app.core.settings import LOST_RPC
    from engine.llama.fatal import describe

    env = dict(os.environ)
    restarts = int(env.get("EBB_RESTARTS", "0"))
    note = describe(message, lost)
    print(f"ebb: {note}", file=sys.stderr, flush=True)
    if restarts >= 2:  # it keeps failing: stop rather than loop
        os._exit(3)
    env["EBB_RESTARTS"] = str(restarts + 1)
    env["EBB_LOST_RPC"] = ",".join(sorted(LOST_RPC | set(lost)))
    env["EBB_NOTICE"] = (note[:1].upper() + note[1:] + ". Ebb restarted without it; your conversations are kept (a reply "
                         "that was being written, as far as it got). Settings still list the server.")
    frozen = getattr(sys, "frozen", False)
    os.execve(sys.executable, [sys.executable, *([] if frozen else ["-m", "app"]), *sys.argv[1:]], env)


def _test_hooks(window: MainWindow, app: QApplication, noticed: bool = False) -> None:
    """Test-only: EBB_TEST_SEND sends a message once the model is loaded (with the picture
    EBB_TEST_IMAGE attached, if set) and prints "streaming" at the first reply token;
    EBB_TEST_PRINT_NOTICE prints the notice and quits."""
    from PySide6.QtCore import QTimer

    from engine import events, testhooks

    if testhooks.value(testhooks.PRINT_NOTICE) and (os.environ.get("EBB_NOTICE") or noticed):
        print(f"notice: {window.notices.area.text()}", flush=True)
        QTimer.singleShot(0, app.quit)
        return
    text = testhooks.value(testhooks.SEND)
    if not text:
        return
    from PySide6.QtCore import QObject, Slot

    class Hook(QObject):  # lives on the GUI thread: the worker's signal is queued to it
        sent = False

        @Slot(object)
        def on_event(self, ev: events.Event) -> None:
            if isinstance(ev, events.ModelLoaded) and not self.sent:
                self.sent = True
                window.composer.edit.setPlainText(text)
                if image := testhooks.value(testhooks.IMAGE):
                    window.composer.attach(Path(image))
                QTimer.singleShot(0, window.sending.send)

    def say_streaming() -> None:
        if window.chat.reply_parts:
            print("streaming", flush=True)
            poll.stop()

    poll = QTimer(window, interval=20, timeout=say_streaming)  # the window's: gone with it
    poll.start()
    hook = Hook(window)  # a child of the window: lives as long as it
    window.worker.engine_event.connect(hook.on_event)


def _already_running(folder: Path, lock: FolderLock, paths: list[str]) -> int:
    """A second start: the running window comes to the front (with our files), or we say that
    Ebb is running with this folder. Never a second writer."""
    from app import single_instance

    if single_instance.send_to_running(folder, paths):
        print(f"ebb: Ebb is already running with the data folder {folder}: its window was "
              f"brought to the front{' with your files' if paths else ''}.", flush=True)
        return 0
    pid = lock.holder_pid()
    text = (f"Ebb is already running with the data folder {folder}"
            f"{f' (process {pid})' if pid else ''}, and it did not answer. Close it (or wait for "
            "it to finish closing) and start Ebb again.")
    print(f"ebb: {text}", file=sys.stderr, flush=True)
    if os.environ.get("QT_QPA_PLATFORM") != "offscreen":
        from PySide6.QtWidgets import QMessageBox

        QMessageBox.warning(None, "Ebb is already running", text)
    return 1


def open_paths(window: MainWindow, paths: list[str]) -> None:
    """Files handed over by a later start (`ebb FILE...`): to the front, then a model or
    projector is opened and pictures wait in the composer, as at a start."""
    window.showNormal()
    window.raise_()
    window.activateWindow()
    if not paths:
        return
    args = parse_args(["--", *paths])
    for image in args.images:
        window.composer.attach(image)
    if args.model:
        window.models.load(args.model, args.mmproj or "")
    elif args.mmproj:  # with the model that is loaded (not one that failed to load)
        window.models.open_projector(args.mmproj)


def close_on_sigterm(app: QApplication, window: MainWindow) -> Any:
    """SIGTERM (logout, shutdown, `kill`) and SIGHUP (the terminal that started it was closed)
    close the window as its close button does: the reply
    so far is saved, the engine stops, the exit code is 0. Python runs signal handlers only
    between bytecodes, so the signal also writes to a socket whose notifier wakes Qt's loop."""
    import socket

    from PySide6.QtCore import QSocketNotifier, QTimer

    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno())
    notifier = QSocketNotifier(reader.fileno(), QSocketNotifier.Type.Read, app)

    def drain() -> None:
        try:
            reader.recv(256)
        except OSError:
            pass

    notifier.activated.connect(drain)

    def on_term(signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        print(f"ebb: asked to stop ({name}): saving and closing", file=sys.stderr, flush=True)
        QTimer.singleShot(0, window.close)

    signal.signal(signal.SIGTERM, on_term)
    if hasattr(signal, "SIGHUP"):  # the terminal that started Ebb was closed: the same
        signal.signal(signal.SIGHUP, on_term)
    return (notifier, reader, writer)  # kept alive by the caller


def open_window(store: Store, cfg: SessionConfig, rpc: list[str]) -> MainWindow:
    """The window, loading `cfg` unless the last start died in llama.cpp's native code: then it
    says so and offers safe mode instead (app/safe_mode.py)."""
    from app import safe_mode
    from app.mainwindow.window import MainWindow
    from engine import crashlog
    from engine.llama import native

    died = crashlog.unreported()  # before this process's own file is made
    crashlog.enable("window")  # a fatal signal is written down for the next start
    crash = native.last_crash()
    if store.settings.get(safe_mode.SAFE_MODE_SETTING):
        native.set_safe_mode(True)
    window = MainWindow(store, None if crash else cfg, rpc)
    if crash is not None:
        print(f"ebb: {crash.describe()}", file=sys.stderr, flush=True)
        window.notices.add_banner(safe_mode.crash_banner(crash, store, lambda: window.models.start_load(cfg, rpc)))
    elif native.safe_mode():
        window.notices.add_banner(safe_mode.safe_mode_banner(store))
    for report in died:  # the first decode's crash is the banner's: the rest say so here
        kept = crashlog.mark_reported(report)
        if crash is None or report.pid != crash.pid:
            window.notices.error(stopped_words(report, kept))
    return window


def stopped_words(report: crashlog.Report, kept: Path) -> str:
    """"Ebb stopped unexpectedly …": what died, when, its first lines, where the report is."""
    import time as clock

    what = "Ebb" if report.role == "window" else f"Ebb's {report.role} process"
    when = clock.strftime("%Y-%m-%d %H:%M", clock.localtime(report.when))
    return (f"{what} stopped unexpectedly ({when}): {report.summary()}\nThe whole report is in "
            f"{kept}. Your conversations are kept (a reply that was being written, as far as it got).")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from PySide6.QtCore import QTimer
    from PySide6.QtGui import QIcon
    from PySide6.QtWidgets import QApplication

    from app.core.resources import resource_path
    from app.core.settings import DEMO, session_config
    from app.core.store import Store
    from engine import testhooks
    from engine.models.default import DEFAULT_NAME
    from engine.paths import data_dir

    app = QApplication(sys.argv[:1])
    app.setApplicationName("Ebb")
    app.setStyle("Fusion")  # follows the system's light or dark scheme
    app.setWindowIcon(QIcon(str(resource_path("ebb.svg"))))
    # Python's cyclic collector runs in whichever thread allocates when its threshold is met:
    # on the engine's thread it could free a closed dialog's widgets off the GUI thread (Qt
    # deadlocks or crashes). pyqtgraph's GarbageCollector turns automatic collection off and
    # collects on a GUI-thread timer instead.
    from pyqtgraph.util.garbage_collector import GarbageCollector

    gc_on_gui_thread = GarbageCollector(interval=1.0)  # noqa: F841 - alive as long as the app
    from app import single_instance

    lock = single_instance.FolderLock(data_dir())
    if not lock.acquire():  # one writer per data folder: the running window takes our files
        return _already_running(data_dir(), lock, args.paths)
    store = Store(data_dir())
    model = args.model or store.settings.get("model") or DEFAULT_NAME
    if args.mmproj is not None:
        mmproj = args.mmproj
    elif args.model is None and store.settings.get("model"):
        mmproj = store.settings.get("mmproj", "")
    else:
        mmproj = DEMO if model == DEFAULT_NAME else ""
    gone = ""  # the last used model was deleted or moved: the default opens, and says why
    if args.model is None and model != DEFAULT_NAME and not Path(model).is_file():
        gone = (f"The last model, {Path(model).name}, is gone (deleted or moved from "
                f"{Path(model).parent}): Ebb opened the small default model instead. "
                "File → Open model… chooses another.")
        model, mmproj = DEFAULT_NAME, DEMO
    cfg, rpc = session_config(store, model, mmproj, args.ctx, args.threads, args.rpc)
    window = open_window(store, cfg, rpc)
    term = close_on_sigterm(app, window)  # noqa: F841 - alive as long as the loop
    single_instance.listen(data_dir(), window, lambda paths: open_paths(window, paths))
    window.show()
    from engine.llama import fatal

    fatal.install(relaunch)
    if os.environ.get("EBB_NOTICE"):
        window.notices.say(os.environ["EBB_NOTICE"])
    if gone:
        window.notices.say(gone)
    for image in args.images:  # a picture opened with Ebb waits in the composer
        window.composer.attach(image)
    _test_hooks(window, app, noticed=bool(gone))
    if testhooks.value(testhooks.QUIT_WHEN_SHOWN) == "1":  # for the start-up time test

        def shown() -> None:  # runs once the event loop has mapped and painted the window
            print(f"shown {time.monotonic() - STARTED:.3f} {window.isVisible()}", flush=True)
            app.quit()

        QTimer.singleShot(0, shown)
    code = app.exec()
    if window.isVisible():
        window.close()  # stops the engine thread even when the loop ended some other way
    store.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
