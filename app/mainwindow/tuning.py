"""Model → Tune layers…: the dialog, the runs on the engine worker, and "Use these"."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from app.dialogs.tune import TuneDialog
from engine import events
from engine.tune_result import TuneResult
from app.mainwindow.parts import WindowParts


NO_ACCELERATOR = ("Tune measures tokens/s against how many layers sit on an accelerator, and this "
                  "model runs on the CPU alone: there is no GPU here and no RPC server in Settings. "
                  "Start a stand-in accelerator (the button here, or Model → Start a stand-in "
                  "accelerator…), add an RPC server in Settings, or use a machine with a GPU, then "
                  "Tune again. Nothing was changed.")


class TuneController:
    """Model → Tune layers… for the main window: opens the dialog, asks the worker to tune the
    loaded model, feeds the dialog its runs, and "Use these" into Settings (then a reload)."""

    def __init__(self, window: WindowParts) -> None:
        self.w = window
        self.dialog: TuneDialog | None = None

    def handlers(self) -> dict[type, Callable[[Any], None]]:
        return {events.TunePoint: self.on_point, events.TuneNote: self.on_note,
                events.TuneFinished: self.on_finished}

    def start(self) -> None:
        from app.core.settings import session_config

        w = self.w
        last = w.chat.last_cfg
        if w.chat.busy or last is None:
            w.statusBar().showMessage("Tuning needs a loaded model and no reply running", 8000)
            return
        if w.models.has_accel is False:  # said at once, not after a dialog that promised minutes
            w.notices.say(NO_ACCELERATOR, action=("Start a stand-in…", lambda: w.standin.start()))
            return
        cfg, rpc = session_config(w.store, str(last.model_path), str(last.mmproj_path or ""),
                                  rpc=w.rpc_servers)
        # measure every layer count the budget allows, at every thread count of the grid
        cfg = replace(cfg, gpu_layers=None, n_threads=None, n_threads_batch=None, phases=None)
        self.dialog = TuneDialog(w.window())
        self.dialog.stop.connect(w.worker.cancel)
        self.dialog.apply_result.connect(self.apply)
        dialog = self.dialog

        def begin() -> None:
            w.chat.set_loading()
            w.worker.arm_tune()
            w.request_tune.emit(cfg, rpc)

        def closed() -> None:  # closing it stops the runs (the model then loads again)
            if dialog.running:
                w.worker.cancel()
        self.dialog.start.connect(begin)
        self.dialog.finished.connect(closed)
        self.dialog.show()

    def apply(self, result: TuneResult) -> None:
        """Tune's "Use these": each phase's layers and threads, the measured prompt speeds that
        price a move, and flash attention, into Settings; the model loads again with them."""
        from app.core.settings import phase_settings

        w = self.w
        chosen = phase_settings(result)
        for key, value in chosen.items():
            w.store.settings.set(key, value)
        cfg = w.chat.last_cfg
        if cfg is not None:
            w.models.load(str(cfg.model_path), str(cfg.mmproj_path or ""))
        w.statusBar().showMessage(
            f"Generation: {chosen['gpu_layers']} layers, {chosen['threads'] or 'auto'} threads · "
            f"prompt: {chosen['prompt_layers']} layers, {chosen['threads_batch'] or 'auto'} "
            f"threads" + (f" · flash attention {'on' if chosen['flash_attn'] else 'off'}"
                          if "flash_attn" in chosen else "") + " (Settings to change)", 15000)

    def on_point(self, ev: events.TunePoint) -> None:
        if self.dialog is not None:
            self.dialog.add_point(ev.layers, ev.prompt_tps, ev.gen_tps, ev.prompt_tps_by_threads,
                                  ev.gen_tps_by_threads, ev.max_layers)

    def on_note(self, ev: events.TuneNote) -> None:
        if self.dialog is not None:
            self.dialog.note(ev.text)

    def on_finished(self, ev: events.TuneFinished) -> None:
        if self.dialog is not None:
            self.dialog.finish(ev.result)

    def failed(self, message: str) -> None:
        """The engine failed: a run in progress says so in the dialog."""
        if self.dialog is not None and self.dialog.running:
            self.dialog.fail(message)
