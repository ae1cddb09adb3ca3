"""Open model: the models found on this machine, the projectors that belong with one, and
what it would take here. GUI thread; file inspection reads headers only."""
from __future__ import annotations

import re
from pathlib import Path

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import (
    QWidget,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QVBoxLayout,
)

from app.core.settings import DEMO, Settings
from app.widgets.start_folder import start_folder
from engine.config import flash_choice
from engine.errors import EbbError
from engine.models.local import find_models, model_bytes, model_folders, projectors_beside
from engine.units import fmt_bytes


def model_label(model: Path) -> str:
    """How the picker lists a model: its name, size and quantisation (from the file's name and
    size: no header is read, the list stays instant), the folder it is in, and [text only] when
    no projector is beside it."""
    from app.core.settings import readable_model_name

    m = re.search(r"[.\-_]((?:I?Q\d[\w]*|F16|F32|BF16|MXFP4\w*))\.gguf$", model.name, flags=re.I)
    try:
        size = fmt_bytes(model_bytes(model))  # a split model's parts together
    except OSError:
        size = "?"
    bits = [readable_model_name(str(model)), size] + ([m.group(1).upper()] if m else [])
    label = f"{' · '.join(bits)}   ({model.parent})"
    return label if projectors_beside(model) else f"{label}   [text only]"


def projector_offer(model: Path) -> tuple[list[str], str]:
    """The projectors beside `model` that belong with it (family and width, from the headers),
    best first, and a line on the family and on those left out and why."""
    from engine.gguf.info import projector_choices

    try:
        choices = projector_choices(model, projectors_beside(model))
    except EbbError as exc:
        return [], f"cannot read the model: {exc}"
    from engine.hub.fetch import paired_projector

    paired = paired_projector(model)  # downloaded with it (Get models): first when it fits
    choices = sorted(choices, key=lambda c: Path(c.path) != paired)
    fit = [c for c in choices if c.problem is None]
    notes = []
    if fit:
        senses = {(True, False): "Vision", (False, True): "Hearing",
                  (True, True): "Vision and hearing"}.get((fit[0].sees, fit[0].hears), "Vision")
        notes.append(f"{senses}: {fit[0].family} projector.")
    elif not choices:
        notes.append("Text only: no projector beside this model.")
    notes += [f"Not offered: {c.path.name} ({c.problem})." for c in choices if c.problem]
    return [str(c.path) for c in fit], " ".join(notes)


def estimate(model: Path, mmproj: str, settings: Settings) -> str:
    """What the choice needs on each device, from the files' headers and the planner."""
    from engine.gguf.info import inspect_files
    from engine.placement.plan import placement_for, projector_need_bytes

    try:
        ins = inspect_files(model, Path(mmproj) if mmproj and mmproj not in (DEMO, "none") else None)
    except EbbError as exc:
        return f"cannot use this file: {exc}"
    except OSError as exc:  # a folder, a file that cannot be read: said, never raised
        return f"cannot read {exc.filename or 'this file'}: {exc.strerror or exc}"
    m = ins.model
    ctx = m.fit_context(settings.ctx)
    full = placement_for(m, "accelerator", m.n_layers + 1, ctx, 512, flash_choice(settings.flash_attn) is not False)
    text = (f"{m.architecture}, {m.n_layers} layers. All on the accelerator: "
            f"{fmt_bytes(full.accel_total_bytes)} (weights {fmt_bytes(full.accel_bytes['weights'])}, "
            f"KV cache {fmt_bytes(full.accel_bytes['kv'])} at {ctx} tokens, compute "
            f"{fmt_bytes(full.accel_bytes['compute'])}); in RAM only: {fmt_bytes(m.tensor_bytes)}.")
    if ins.projector is not None:
        text += (f" Projector ({ins.projector.family}): {fmt_bytes(ins.projector.weight_bytes)} in RAM, borrows "
                 f"about {fmt_bytes(projector_need_bytes(ins.projector, True))} per image (from "
                 "its header; mtmd's own figure once loaded, or ebb-engine inspect).")
    elif mmproj == DEMO:
        text += " Demo projector: random weights — it exercises the memory pipeline; it does not see."
    return text


class ModelPicker(QDialog):
    def __init__(self, settings: Settings, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Choose a model")
        self.resize(760, 460)
        self.settings = settings
        self.folders = list(settings.model_folders)  # with those added here (saved on Load)
        self.list = QListWidget()
        for p in find_models(model_folders(list(settings.model_folders))):
            self._add_model(p)
        self.list.currentItemChanged.connect(self._on_model)
        self.model_path = QLineEdit(placeholderText="path to a .gguf language model, or 'default'")
        # typing a path reads files: only once the typing pauses (each key read them, 1.5-2 s)
        self._pause = QTimer(self, singleShot=True, interval=350)
        self._pause.timeout.connect(self._update_estimate)
        self._model_changed = False
        self.model_path.textChanged.connect(self._on_model_text)
        browse = QPushButton("Browse…", clicked=self._on_browse)
        add_folder = QPushButton("Add folder…", clicked=self._on_add_folder)
        self.projector = QComboBox(editable=True)
        self.projector.currentTextChanged.connect(lambda _t: self._pause.start())
        self.estimate = QLabel("")
        self.estimate.setWordWrap(True)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        self.load_button = buttons.button(QDialogButtonBox.StandardButton.Ok)
        self.load_button.setText("Load")
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        row = QHBoxLayout()
        row.addWidget(self.model_path, 1)
        row.addWidget(browse)
        row.addWidget(add_folder)
        lay = QVBoxLayout(self)
        folders = model_folders(list(settings.model_folders))
        found = self.list.count()
        lay.addWidget(QLabel("Models found in Ebb's, LM Studio's and Hugging Face's caches and your "
                             "folders:" if found else
                             "No model found. Ebb looked in " + ", ".join(str(f) for f in folders)
                             + ". Add a folder that holds .gguf files (Add folder…), or Browse… "
                             "for one file.", wordWrap=True))
        lay.addWidget(self.list, 1)
        lay.addLayout(row)
        lay.addWidget(QLabel("Projector, for pictures or sound (those beside the model that belong with it):"))
        lay.addWidget(self.projector)
        self.offer = QLabel("")
        self.offer.setWordWrap(True)
        lay.addWidget(self.offer)
        lay.addWidget(self.estimate)
        lay.addWidget(buttons)

    def choice(self) -> tuple[str, str]:
        proj = self.projector.currentText().strip()
        return self.model_path.text().strip(), "" if proj == "none" else proj

    def _add_model(self, path: Path) -> None:
        item = QListWidgetItem(model_label(path), self.list)
        item.setData(Qt.ItemDataRole.UserRole, str(path))
        item.setToolTip(str(path))

    def _on_model(self, item: QListWidgetItem | None, _previous: QListWidgetItem | None = None) -> None:
        if item is not None:
            self.model_path.setText(str(item.data(Qt.ItemDataRole.UserRole)))

    def _on_browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a GGUF model", str(start_folder()),
                                              "GGUF (*.gguf)")
        if path:
            self.model_path.setText(path)

    def _on_add_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Add a model folder", str(start_folder()))
        if folder:
            self.folders.append(folder)
            for p in find_models([Path(folder)]):
                self._add_model(p)

    def _on_model_text(self, _text: str) -> None:
        self._model_changed = True
        self._pause.start()

    def _update_estimate(self) -> None:
        from engine.models.default import DEFAULT_NAME, default_model_path

        text = self.model_path.text().strip()
        path = default_model_path() if text == DEFAULT_NAME else Path(text)
        if self._model_changed:
            self._model_changed = False
            offered, note = projector_offer(path) if path.is_file() else ([], "")
            self.offer.setText(note)
            self.projector.blockSignals(True)
            self.projector.clear()
            self.projector.addItems(offered + ["none", DEMO])
            self.projector.blockSignals(False)
        if path.is_file():
            said = estimate(path, self.projector.currentText(), self.settings)
            self.estimate.setText(said)
            # a pair (or a file) it cannot use is not offered to Load: it says why above
            self.load_button.setEnabled(not said.startswith("cannot"))
        else:
            self.estimate.setText("")
            self.load_button.setEnabled(bool(text))
