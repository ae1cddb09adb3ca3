"""A chat's own system prompt and sampling (Model → Chat settings…), with Settings' values as
the default for new chats. GUI thread only."""
from __future__ import annotations

from typing import Any

from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QPlainTextEdit,
    QSpinBox,
)


class ChatSettingsDialog(QDialog):
    def __init__(self, title: str, values: dict[str, Any], parent: Any = None) -> None:
        super().__init__(parent)
        self.setWindowTitle(f"Chat settings — {title}")
        self.system = QPlainTextEdit(str(values.get("system_prompt") or ""))
        self.system.setPlaceholderText("e.g. You are a concise assistant. (empty: none)")
        self.system.setMinimumHeight(90)
        self.temperature = QDoubleSpinBox(minimum=0.0, maximum=2.0, singleStep=0.1, decimals=2,
                                          value=float(values["temperature"]),
                                          specialValueText="0 (greedy)")
        self.top_p = QDoubleSpinBox(minimum=0.0, maximum=1.0, singleStep=0.05, decimals=2,
                                    value=float(values["top_p"]))
        self.top_k = QSpinBox(minimum=0, maximum=1000, value=int(values.get("top_k", 40)),
                              specialValueText="0 (off)",
                              toolTip="Sample among this many most likely tokens")
        self.min_p = QDoubleSpinBox(minimum=0.0, maximum=1.0, singleStep=0.01, decimals=2,
                                    value=float(values.get("min_p", 0.05)),
                                    toolTip="Leave out tokens less likely than this share of "
                                            "the most likely one")
        self.repeat = QDoubleSpinBox(minimum=0.5, maximum=2.0, singleStep=0.05, decimals=2,
                                     value=float(values["repeat_penalty"]),
                                     toolTip="1.00: none; above 1 discourages repeating the "
                                             "last 64 tokens")
        self.seed = QSpinBox(minimum=0, maximum=2**31 - 1, value=int(values["seed"]))
        self.json = QCheckBox("Replies are JSON (llama.cpp's grammar allows nothing else)",
                              checked=bool(values.get("json_replies")))
        self.as_default = QCheckBox("Use these for new chats too")
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok
                                   | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form = QFormLayout(self)
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

    def values(self) -> dict[str, Any]:
        return {"system_prompt": self.system.toPlainText().strip(),
                "temperature": round(self.temperature.value(), 2),
                "top_p": round(self.top_p.value(), 2), "top_k": self.top_k.value(),
                "min_p": round(self.min_p.value(), 2),
                "repeat_penalty": round(self.repeat.value(), 2), "seed": self.seed.value(),
                "json_replies": self.json.isChecked()}
