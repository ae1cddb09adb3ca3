"""What is loaded and loading it again: File → Open model, Get models (the Hub), What if,
Settings (a change that needs it loads the model again), and the engine's ModelLoading and
ModelLoaded events (the model line, the record limit, notices)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from app.core.chat_state import MAX_BYTES_PER_TOKEN
from app.core.settings import readable_model_name, reload_changes, remember_model, session_config, states_dir
from app.dialogs.open_model import ModelPicker
from app.dialogs.settings import SettingsDialog
from app.core.status import loaded_message, model_line
from engine import events
from engine.config import SessionConfig
from engine.errors import EbbError
from engine.units import parse_size
from app.mainwindow.parts import WindowParts


class Models:
    def __init__(self, window: WindowParts) -> None:
        self.w = window
        self.loaded: events.LoadDetails | None = None  # the last load's (About's diagnostics)
        self.loaded_model = ""  # the model that loaded last (not one that failed after it)
        self.has_accel: bool | None = None  # known once a model has loaded
        self.n_ctx = 0  # the loaded model's context (0: none loaded yet)
        self.load_reason = ""  # why the next load happens, for the status line
        self.said_start = False  # the start's time goes to the status line once
        self.hub_dialog: Any = None
        self.whatif_dialog: Any = None

    def handlers(self) -> dict[type, Callable[[Any], None]]:
        return {events.ModelLoading: self.on_loading, events.ModelLoaded: self.on_loaded}

    def load(self, model: str, mmproj: str) -> None:
        try:
            # servers given on the command line stay (Settings' list is added to them)
            cfg, rpc = session_config(self.w.store, model, mmproj, rpc=self.w.rpc)
        except EbbError as exc:  # a bad setting (a budget that is not a size): keep what is loaded
            self.w.notices.error(str(exc))
            return
        self.start_load(cfg, rpc)

    def start_load(self, cfg: SessionConfig, rpc: list[str]) -> None:
        """Ask the engine to load `cfg` (File → Open model, a restart, safe mode's banner)."""
        cfg = self.w.standin.adjust(cfg)
        self.w.chat.set_loading(cfg)
        self.w.request_load.emit(cfg, rpc)
        self.w.sending.send_history()

    def on_loading(self, ev: events.ModelLoading) -> None:
        self.w.progress.show()
        self.w.chat.set_loading()
        reason, self.load_reason = self.load_reason, ""
        self.w.statusBar().showMessage(f"Loading {Path(ev.model_path).name}…"
                                       + (f" ({reason})" if reason else ""))

    def on_loaded(self, ev: events.ModelLoaded) -> None:
        d0 = ev.details
        self.w.local_server.backend.set_model(ev.model_path, vision=bool(d0.projector) and d0.projector_sees,
                                              hearing=bool(d0.projector) and d0.projector_hears)
        d = ev.details
        self.loaded = d
        self.loaded_model = str(ev.model_path)
        self.w.progress.hide()
        self.w.chat.set_loaded()
        name = readable_model_name(ev.model_path, ev.model_name)
        self.w.setWindowTitle(f"Ebb — {name}")
        self.n_ctx = ev.n_ctx
        self.w.composer.edit.max_paste_bytes = ev.n_ctx * MAX_BYTES_PER_TOKEN
        self.w.set_model_line(model_line(name, ev.n_layers, ev.n_ctx, d, self.w.standin.accel_name(d)),
                              d.placement_reason)
        if d.requested:
            remember_model(self.w.store, *d.requested)
        self.has_accel = bool(d.accelerator)
        self.w.record_button.setVisible(bool(d.projector) and d.projector_hears)
        self.w.sending.set_record_limit(0)
        self.w.panel.set_device_names({str(d.accelerator): f"stand-in {d.accelerator}"}
                                      if self.w.standin.is_standin(d) else {})
        self.w.update_welcome()
        if d.memory_note:
            self.w.notices.say(d.memory_note + ".")
        if d.projector_refused:  # the model answers text; why sound is off, and what to do
            self.w.notices.say(f"{d.projector_refused[0].upper()}{d.projector_refused[1:]}.")
        if d.draft_refused:  # replies come without its guesses
            self.w.notices.say(f"{d.draft_refused[0].upper()}{d.draft_refused[1:]}.")
        for note in d.backend_notes:
            if not d.safe_mode and note not in self.w.notices.area.text():  # safe mode: its banner
                self.w.notices.say(note[0].upper() + note[1:] + ".")
        if not self.w.chat.busy:
            started = None
            if not self.said_start:  # the first load: the whole start, once
                from engine.hw import process_age_s

                self.said_start = True
                started = process_age_s()
            self.w.statusBar().showMessage(
                loaded_message(ev.load_s, d.mover_note, started), 15000)
        self.w.transcript.setPlaceholderText("Say something. Drop or paste images to ask about them.")
        self.w.vision.model_loaded(d)
        self.w.sending.send_history()
        self.w.update_actions()
        self.w.panel.draw_now()  # before a message can be sent: not in its reply's first tokens

    def open_model(self) -> None:
        dlg = ModelPicker(self.w.settings(), self.w.window())
        if dlg.exec() and not self.w.chat.busy:
            self.w.store.settings.set("model_folders", dlg.folders)
            model, mmproj = dlg.choice()
            if model:
                self.load(model, mmproj)

    def get_models(self) -> None:
        from app.dialogs.hub import HubDialog
        from engine.hub.verdict import machine_from_devices

        settings = self.w.settings()
        from engine.config import default_threads

        threads = default_threads(settings.threads or None)
        devices = list(self.loaded.devices) if self.loaded else []
        machine = machine_from_devices(devices, threads)
        if self.hub_dialog is None:  # one dialog: closed and opened again, it is as it was
            self.hub_dialog = HubDialog(settings, machine, self.w.store.settings.set,
                                        self.w.downloads, self.w.window())
            self.hub_dialog.open_pair.connect(self.open_pair)
        self.hub_dialog.machine = machine  # the devices of the model loaded now
        self.hub_dialog.show()
        self.hub_dialog.raise_()
        self.hub_dialog.activateWindow()

    def open_pair(self, model: str, mmproj: str) -> None:
        if self.w.chat.busy:
            self.w.notices.error("A reply is under way: open the downloaded model from File → Open "
                              "model once it has finished")
            return
        self.load(model, mmproj)

    def open_projector(self, mmproj: str) -> None:
        """A projector handed over (a later start's file, a drop): paired with the model that is
        loaded, never with one that failed to load since; with none loaded, the default."""
        self.load(self.loaded_model or "default", mmproj)

    def what_if(self) -> None:
        from app.dialogs.whatif import WhatIfDialog

        cfg = self.w.chat.last_cfg
        self.whatif_dialog = WhatIfDialog(str(cfg.model_path) if cfg else "default",
                                          str(cfg.mmproj_path or "") if cfg else "",
                                          self.w.settings().ctx, self.w.window())
        self.whatif_dialog.show()

    def edit_settings(self) -> None:
        from engine.llama.state_files import folder_usage

        before = self.w.settings()
        dlg = SettingsDialog(before, self.w.window(), folder_usage(states_dir(self.w.store)),
                             open_tools=self.w.open_tools)
        if dlg.exec():
            try:
                for k, v in dlg.values().items():
                    self.w.store.settings.set(k, v)
            except EbbError as exc:
                self.w.notices.error(str(exc))
                return
            after = self.w.settings()
            self.w.gen_params = replace(self.w.gen_params, max_tokens=after.max_tokens)
            if after.memory_disk != before.memory_disk:
                self.w.request_state_budget.emit(parse_size(after.memory_disk))
            self.w.local_server.apply(self.w.settings())
            changed = reload_changes(before, after)
            cfg = self.w.chat.last_cfg
            if not changed:  # the reply cap, the local server: nothing to load again
                self.w.statusBar().showMessage("Settings saved: no reload needed", 8000)
            elif cfg is not None and not self.w.chat.busy:
                self.load_reason = f"settings changed: {changed}"
                self.load(str(cfg.model_path), str(cfg.mmproj_path or ""))
            elif cfg is not None:
                self.w.statusBar().showMessage(f"Saved; the model reloads with the next model you "
                                               f"open ({changed})", 15000)
