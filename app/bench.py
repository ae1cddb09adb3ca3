"""Benchmarks of the chat view (print figures and ratios; nothing is asserted).

  python -m app.bench stream [--runs 4] [--max-tokens 600]
      The same greedy prompt streamed in the real window and by `ebb-engine chat --json`,
      alternating, each in a fresh process: tokens/s of both, window ÷ headless, and the
      GUI thread's CPU, from Send to the saved reply and while the tokens streamed.
  python -m app.bench stream-ab [--runs 4] [--max-tokens 600]
      In one window process, the same reply regenerated with the window drawing it and with
      the window drawing nothing, alternating: the window's cost without the drift between
      processes.
  python -m app.bench open [--messages 500] [--images 50]
      A generated conversation of that size, opened in the window: the time to show it (the
      store's read, the newest messages laid out and painted), the time until every older
      message is in, and the longest the event loop was held meanwhile.

Runs on the offscreen platform unless a display is set (DISPLAY, e.g. under Xvfb).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    from app.core.store import Store
    from app.mainwindow.window import MainWindow

PROMPT = "Write a long story about a lighthouse keeper and a storm."


@contextlib.contextmanager
def _bench_window(args: argparse.Namespace) -> Iterator[tuple[MainWindow, Store, Callable[[Callable[[], bool]], None]]]:
    """The real window on a fresh data folder, the Memory panel open (redrawn as the reply
    streams, #54), greedy replies of `--max-tokens`, the model loaded: (window, store, spin)."""
    from PySide6.QtCore import QEventLoop
    from PySide6.QtWidgets import QApplication

    from app.core.settings import session_config
    from app.core.store import Store
    from app.mainwindow.window import MainWindow
    from engine.llama.sampling import GenParams

    app = QApplication(sys.argv[:1])
    app.setStyle("Fusion")
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp))
        store.settings.set("ctx", args.ctx)
        store.settings.set("threads", args.threads)
        cfg, rpc = session_config(store, "default", "")
        w = MainWindow(store, cfg, rpc)
        w.resize(1200, 800)
        w.show()
        w.panel_dock.show()
        w.gen_params = GenParams(temperature=0, max_tokens=args.max_tokens)

        def spin(cond: Callable[[], bool]) -> None:
            """Wait in the event loop, woken only by the chat's own changes (a polling loop
            here would take the GIL from the engine thread and slow what is measured)."""
            loop = QEventLoop()

            def wake() -> None:
                if cond():
                    loop.quit()

            w.chat.observe(wake)
            if not cond():
                loop.exec()

        spin(lambda: w.chat.loaded)
        try:
            yield w, store, spin
        finally:
            w.close()
            store.close()


def _window_run(args: argparse.Namespace) -> int:
    """One reply in the real window (a fresh data folder); prints its stats as JSON."""
    from PySide6.QtCore import QTimer

    from engine import events

    with _bench_window(args) as (w, store, spin):
        # the GUI thread's CPU clock, read on the engine thread as the first piece streams: the
        # GUI's share while the tokens stream, apart from the send and the prompt
        gui_clock = time.pthread_getcpuclockid(threading.get_ident())
        at_first: list[float] = []
        put = w.worker.stream.put

        def put_first(request_id: int, text: str) -> None:
            if not at_first:
                at_first.append(time.clock_gettime(gui_clock))
            put(request_id, text)

        setattr(w.worker.stream, "put", put_first)
        # and when the turn's end reaches the window, before the saved reply is drawn: the
        # stream's share apart from what the window does once the reply is done
        at_end: list[float] = []

        def timed(finished: Callable[[events.TurnFinished], None]) -> Callable[[events.TurnFinished], None]:
            def on_finished(ev: events.TurnFinished) -> None:
                at_end.append(time.thread_time())
                finished(ev)
            return on_finished

        w.wrap_handler(events.TurnFinished, timed)
        w.composer.edit.setPlainText(args.prompt)
        QTimer.singleShot(0, w.sending.send)
        gui0 = time.thread_time()
        spin(lambda: w.chat.loaded and not w.chat.busy and bool(w.chat.request_id))
        gui1 = time.thread_time()
        last = store.messages(w.conv_id)[-1]
        print(json.dumps({**last.stats.to_json(), "gui_cpu_s": round(gui1 - gui0, 3),
                          "gui_stream_cpu_s": round(at_end[0] - at_first[0], 3)
                          if at_first and at_end else None}),
              flush=True)
    return 0


def _headless_run(args: argparse.Namespace) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "chat", "--prompt", args.prompt, "--temp", "0",
         "--max-tokens", str(args.max_tokens), "--ctx", str(args.ctx), "--threads",
         str(args.threads), "--json"], capture_output=True, text=True, check=True)
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def _window_subprocess(args: argparse.Namespace) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "app.bench", "window-run", "--prompt", args.prompt,
         "--max-tokens", str(args.max_tokens), "--ctx", str(args.ctx), "--threads",
         str(args.threads)], capture_output=True, text=True, check=True)
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def cmd_stream(args: argparse.Namespace) -> int:
    win: list[float] = []
    head: list[float] = []
    gui: list[float] = []
    gui_streaming: list[float] = []
    for i in range(args.runs):
        for which in (("window", "headless") if i % 2 == 0 else ("headless", "window")):
            r = _window_subprocess(args) if which == "window" else _headless_run(args)
            tps = float(r["gen_tokens_per_s"])
            (win if which == "window" else head).append(tps)
            extra = ""
            if which == "window":
                gen_s = r["n_gen_tokens"] / tps
                share = r["gui_cpu_s"] / (gen_s + r["prompt_s"])
                gui.append(share)
                streaming = r["gui_stream_cpu_s"] / gen_s if r.get("gui_stream_cpu_s") else 0.0
                gui_streaming.append(streaming)
                extra = (f" (GUI thread: {r['gui_cpu_s']:.2f} s CPU, {share:.1%} of the reply's "
                         f"time with the saved reply drawn, {streaming:.1%} while the tokens "
                         "streamed)")
            print(f"run {i + 1} {which:8s} {r['n_gen_tokens']:5d} tokens {tps:7.1f} tok/s "
                  f"stop={r['stop_reason']}{extra}", flush=True)
    w, h = statistics.median(win), statistics.median(head)
    # each run against the headless one beside it (the machine's speed drifts between runs:
    # 82 to 87 tok/s headless here, which the medians alone leave in)
    paired = sorted(a / b for a, b in zip(win, head))
    print(f"median window {w:.1f} tok/s, headless {h:.1f} tok/s: window / headless = {w / h:.3f}; "
          f"the GUI thread used {statistics.median(gui):.1%} of one core from Send to the saved "
          f"reply drawn, {statistics.median(gui_streaming):.1%} from the first token to the "
          f"reply's end (medians; "
          f"{args.runs} runs each, alternating); run by run: median "
          f"{statistics.median(paired):.3f}, from {paired[0]:.3f} to {paired[-1]:.3f}")
    return 0


def cmd_stream_ab(args: argparse.Namespace) -> int:
    """In one window process: the same greedy reply regenerated with the window drawing it
    (transcript, panel, status line, as a user sees it) and with the window drawing nothing
    (the updates stopped, the panel hidden), alternating. Both runs share the process, its
    model and its memory: the machine's drift between processes (±3 % here) is left out."""
    from PySide6.QtCore import QTimer

    from app.mainwindow.sending import REDRAW_MS

    with _bench_window(args) as (w, store, spin):
        def reply(start: Callable[[], None]) -> float:
            QTimer.singleShot(0, start)
            spin(lambda: w.chat.busy)
            spin(lambda: not w.chat.busy)
            return float(store.messages(w.conv_id)[-1].stats.gen_tokens_per_s)

        w.composer.edit.setPlainText(args.prompt)
        reply(w.sending.send)  # the first: the prompt read, the panel's curves made
        shown: list[float] = []
        dark: list[float] = []
        for i in range(args.runs):
            for drawn in ((True, False) if i % 2 == 0 else (False, True)):
                w.panel_dock.setVisible(drawn)
                w.sending.redraw.setInterval(REDRAW_MS if drawn else 24 * 3600 * 1000)
                tps = reply(w.sending.regenerate)
                (shown if drawn else dark).append(tps)
                print(f"run {i + 1} {'drawn' if drawn else 'not drawn':9s} {tps:7.1f} tok/s", flush=True)
        paired = sorted(a / b for a, b in zip(shown, dark))
        print(f"median drawn {statistics.median(shown):.1f} tok/s, not drawn "
              f"{statistics.median(dark):.1f} tok/s: drawn / not drawn = "
              f"{statistics.median(shown) / statistics.median(dark):.3f}; run by run: median "
              f"{statistics.median(paired):.3f}, from {paired[0]:.3f} to {paired[-1]:.3f} "
              f"({args.runs} runs each, alternating, in one process)")
    return 0


def make_conversation(store: Store, n_messages: int, n_images: int, folder: Path) -> int:
    """A conversation of `n_messages` (user and Ebb in turn; user messages every so often
    carry one of `n_images` distinct pictures; replies with paragraphs, lists and code)."""
    from PIL import Image

    from app.core.reply_stats import ReplyStats

    cid = int(store.create_conversation("A long conversation"))
    users = n_messages // 2
    every = max(1, users // max(1, n_images))
    made = 0
    reply = ("Here is what I found.\n\n1. The first point, with **bold** text.\n2. A second "
             "point and a [link](https://example.com).\n\n```python\ndef area(r):\n    "
             "return 3.14159 * r * r\n```\n\nThat is all for now; ask again if you want more.")
    for i in range(n_messages):
        if i % 2 == 0:
            images = []
            if (i // 2) % every == 0 and made < n_images:
                p = folder / f"picture-{made}.png"
                Image.new("RGB", (640, 480), ((made * 37) % 256, (made * 91) % 256, 128)).save(p)
                images, made = [p], made + 1
            store.add_message(cid, "user", f"Question {i // 2}: what about this?", images)
        else:
            store.add_message(cid, "assistant", reply,
                              stats=ReplyStats(n_gen_tokens=60, gen_tokens_per_s=100.0,
                                               prompt_s=0.05, stop_reason="stop"))
    return cid


def cmd_open(args: argparse.Namespace) -> int:
    from PySide6.QtCore import QElapsedTimer, QEventLoop, QTimer
    from PySide6.QtWidgets import QApplication

    from app.core.store import Store
    from app.mainwindow.window import MainWindow

    app = QApplication(sys.argv[:1])
    app.setStyle("Fusion")
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "data")
        cid = make_conversation(store, args.messages, args.images, Path(tmp))
        store.create_conversation("empty")  # the window opens this one first (newest)
        w = MainWindow(store, None)  # no model: the view alone
        w.resize(1200, 800)
        w.show()
        app.processEvents()
        timer = QElapsedTimer()
        timer.start()
        w.chat.select(cid)
        w.show_conversation()
        w.transcript.viewport().repaint()  # laid out and painted, thumbnails made
        shown_ms = timer.nsecsElapsed() / 1e6
        first_shown = w.transcript.n_shown()
        # scrolled to the top again and again: the older messages come in batches
        stalls = []
        bar = w.transcript.verticalScrollBar()
        while w.transcript.n_shown() < args.messages:
            bar.setValue(0)
            t = QElapsedTimer()
            t.start()
            loop = QEventLoop()
            QTimer.singleShot(0, loop.quit)
            loop.exec()
            stalls.append(t.nsecsElapsed() / 1e6)
        t = QElapsedTimer()
        t.start()
        for v in range(0, bar.maximum(), max(1, bar.maximum() // 50)):
            bar.setValue(v)
            w.transcript.viewport().repaint()
        scroll_ms = t.nsecsElapsed() / 1e6
        print(f"{args.messages} messages, {args.images} images: shown in {shown_ms:.0f} ms "
              f"({first_shown} newest first); scrolled up to the first message in "
              f"{len(stalls)} loads of older ones, each {min(stalls, default=0):.0f}-"
              f"{max(stalls, default=0):.0f} ms; 50 scroll steps top to bottom "
              f"painted in {scroll_ms:.0f} ms ({scroll_ms / 50:.1f} ms each)")
        w.close()
        store.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    from engine.config import default_threads

    if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    p = argparse.ArgumentParser(prog="python -m app.bench")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("stream", "stream-ab", "window-run"):
        s = sub.add_parser(name)
        s.add_argument("--prompt", default=PROMPT)
        s.add_argument("--max-tokens", type=int, default=600)
        s.add_argument("--ctx", type=int, default=2048)
        s.add_argument("--threads", type=int, default=default_threads(None))
        s.add_argument("--runs", type=int, default=4)
    o = sub.add_parser("open")
    o.add_argument("--messages", type=int, default=500)
    o.add_argument("--images", type=int, default=50)
    args = p.parse_args(argv)
    if args.cmd == "stream":
        return cmd_stream(args)
    if args.cmd == "window-run":
        return _window_run(args)
    if args.cmd == "stream-ab":
        return cmd_stream_ab(args)
    return cmd_open(args)


if __name__ == "__main__":
    sys.exit(main())
