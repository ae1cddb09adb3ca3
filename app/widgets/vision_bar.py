"""The row above the chat: the Vision switch, where the projector is, and the demo projector's
warning. It follows the engine's events (a load, vision on/off, the projector moving) and
asks for vision on or off with `requested`. GUI thread only.
"""
from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QCheckBox, QHBoxLayout, QLabel, QSizePolicy, QWidget

from app.core.settings import DEMO_LABEL, DEMO_AUDIO_LABEL
from engine import events

# where the projector is, as the row says it (Residency.projector_device → text)
WHERE = {"RAM": "projector in RAM", "loading": "projector loading…", "": ""}


class VisionBar(QWidget):
    requested = Signal(bool)  # the user turned vision on (True) or off

    def __init__(self) -> None:
        super().__init__()
        self.switch = QCheckBox("Vision", toolTip="Turn vision on and off without reloading the model")
        self.switch.toggled.connect(self._on_toggled)
        self.switch.setEnabled(False)
        self.label = QLabel("")
        # wraps rather than widening the chat area (it pushed the memory panel off the screen)
        self.demo = QLabel("", wordWrap=True)
        self.demo.setStyleSheet("color: #b26a00;")
        self.demo.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        self.demo.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.switch)
        row.addWidget(self.label)
        row.addWidget(self.demo, 1)

    @property
    def on(self) -> bool:
        return bool(self.switch.isChecked())

    def _on_toggled(self, on: bool) -> None:
        self.label.setText("switching…")
        self.requested.emit(on)

    def _show(self, on: bool) -> None:
        """The switch as the engine says, without asking the engine again."""
        self.switch.blockSignals(True)
        self.switch.setChecked(on)
        self.switch.blockSignals(False)

    def model_loaded(self, d: events.LoadDetails) -> None:
        has_proj = bool(d.projector)
        self._show(d.vision)
        self.switch.setEnabled(has_proj)
        # the switch is named for what the projector takes: pictures, sound, or both
        name = {(True, False): "Vision", (False, True): "Hearing",
                (True, True): "Vision and hearing"}.get((d.projector_sees, d.projector_hears), "Vision")
        self.switch.setText(name)
        self.switch.setToolTip(f"Turn {name.lower()} on and off without reloading the model")
        self.label.setText("projector in RAM" if has_proj else "no projector loaded")
        self.demo.setText("" if not d.projector_synthetic
                          else DEMO_AUDIO_LABEL if not d.projector_sees else DEMO_LABEL)

    def vision_changed(self, ev: events.VisionChanged) -> None:
        self._show(ev.enabled)
        self.label.setText("projector in RAM" if ev.enabled else f"{self.switch.text().lower()} off")

    def residency(self, ev: events.Residency) -> None:
        if self.on:
            self.label.setText(WHERE.get(ev.projector_device, f"projector on {ev.projector_device}"))
