"""A chat's own system prompt and sampling (Model → Chat settings…), with Settings' values as
the default for new chats. GUI thread only."""
from __future__ import annotations

from typing import Any, Callable

from PySide6.QtWidgets import (
    QWidget,
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QInputDialog,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
)

from app.core.settings import BUILT_IN_PRESETS, NEW_SEED_EACH_REPLY, ChatParams

PICK = "Choose a preset…"


class ChatSettingsDialog(QDialog):
    """`presets`: the user's own named settings (Settings' "chat_presets"); `save_presets`
    keeps them when one is saved. The built-in ones (app/core/settings.py) come first."""

    def __init__(self, title: str, values: ChatParams, parent: QWidget | None = None,
                 presets: dict[str, dict[str, Any]] | None = None,
                 save_presets: Callable[[dict[str, dict[str, Any]]], None] | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle(f"Chat settings — {title}")
        self.own_presets = dict(presets or {})
        self.save_presets = save_presets
        self.presets = {**BUILT_IN_PRESETS, **self.own_presets}
        self.preset = QComboBox(toolTip="Sampling settings by name: the built-in ones, and those "
                                        "you saved (a saved one has the system prompt too)")
        self.preset.addItems([PICK, *self.presets])
        self.preset.activated.connect(self._on_preset)
        save = QPushButton("Save as preset…", clicked=self._on_save_preset)
        self.system = QPlainTextEdit(values.system_prompt)
        self.system.setPlaceholderText("e.g. You are a concise assistant. (empty: none)")
        self.system.setMinimumHeight(90)
        self.temperature = QDoubleSpinBox(minimum=0.0, maximum=2.0, singleStep=0.1, decimals=2,
                                          value=values.temperature,
                                          specialValueText="0 (greedy)")
        self.top_p = QDoubleSpinBox(minimum=0.0, maximum=1.0, singleStep=0.05, decimals=2,
                                    value=values.top_p)
        self.top_k = QSpinBox(minimum=0, maximum=1000, value=values.top_k,
                              specialValueText="0 (off)",
                              toolTip="Sample among this many most likely tokens")
        self.min_p = QDoubleSpinBox(minimum=0.0, maximum=1.0, singleStep=0.01, decimals=2,
                                    value=values.min_p,
                                    toolTip="Leave out tokens less likely than this share of "
                                            "the most likely one")
        self.repeat = QDoubleSpinBox(minimum=0.5, maximum=2.0, singleStep=0.05, decimals=2,
                                     value=values.repeat_penalty,
                                     toolTip="1.00: none; above 1 discourages repeating the "
                                             "last 64 tokens")
        # -1 reads "new each reply": Regenerate then gives another version; a number fixes it
        self.seed = QSpinBox(minimum=NEW_SEED_EACH_REPLY, maximum=2**31 - 1, value=values.seed,
                             specialValueText="new each reply",
                             toolTip="A number gives the same reply each time (Regenerate too); "
                                     "\"new each reply\" draws a new seed for every reply")
        self.json = QCheckBox("Replies are JSON (llama.cpp's grammar allows nothing else)",
                              checked=values.json_replies)
        self.as_default = QCheckBox("Use these for new chats too")
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok
                                   | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form = QFormLayout(self)
        row = QHBoxLayout()
        row.addWidget(self.preset, 1)
        row.addWidget(save)
        form.addRow("Preset", row)
        form.addRow("System prompt", self.system)
        form.addRow("Temperature", self.temperature)
        form.addRow("Top-p", self.top_p)
        form.addRow("Top-k", self.top_k)
        form.addRow("Min-p", self.min_p)
        form.addRow("Repeat penalty", self.repeat)
        form.addRow("Seed", self.seed)
        form.addRow(self.json)
        form.addRow(self.as_default)
        form.addRow(buttons)

    def apply(self, values: dict[str, Any]) -> None:
        """Set the fields a preset names (the others stay)."""
        if "system_prompt" in values:
            self.system.setPlainText(str(values["system_prompt"]))
        for key, box in (("temperature", self.temperature), ("top_p", self.top_p),
                         ("min_p", self.min_p), ("repeat_penalty", self.repeat)):
            if key in values:
                box.setValue(float(values[key]))
        for key, spin in (("top_k", self.top_k), ("seed", self.seed)):
            if key in values:
                spin.setValue(int(values[key]))
        if "json_replies" in values:
            self.json.setChecked(bool(values["json_replies"]))

    def _on_preset(self, index: int) -> None:
        name = self.preset.itemText(index)
        if name in self.presets:
            self.apply(self.presets[name])

    def _on_save_preset(self) -> None:
        name, ok = QInputDialog.getText(self, "Save as preset", "Name:")
        self.save_named(name if ok else "")

    def save_named(self, name: str) -> bool:
        """Keep these settings under `name` (a built-in name is not taken over)."""
        name = name.strip()
        if not name or name == PICK or name in BUILT_IN_PRESETS:
            return False
        self.own_presets[name] = self.values().to_dict()
        self.presets[name] = self.own_presets[name]
        if self.preset.findText(name) < 0:
            self.preset.addItem(name)
        self.preset.setCurrentText(name)
        if self.save_presets is not None:
            self.save_presets(dict(self.own_presets))
        return True

    def values(self) -> ChatParams:
        return ChatParams(self.system.toPlainText().strip(), round(self.temperature.value(), 2),
                          round(self.top_p.value(), 2), self.top_k.value(), round(self.min_p.value(), 2),
                          round(self.repeat.value(), 2), self.seed.value(), self.json.isChecked())
