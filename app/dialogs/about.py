"""Help → About: versions (Ebb, llama.cpp build and backends, Qt, Python), the paths in use, and
"Copy diagnostics" for a bug report (those, the devices the last load saw, the last error)."""
from __future__ import annotations

import importlib.metadata
import platform
import sys
from typing import Sequence

from PySide6 import __version__ as pyside_version
from PySide6.QtCore import Qt, qVersion
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QDialog, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from engine.events import DeviceInfo, LoadDetails


def ebb_version() -> str:
    try:
        return importlib.metadata.version("ebb-chat")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def about_facts(store_path: str) -> list[tuple[str, str]]:
    """(label, value) rows: versions and paths. No device is asked anything."""
    from engine.llama.about import runtime_info
    from engine.paths import cache_dir, data_dir, models_dir

    rt = runtime_info()
    return [("Ebb", ebb_version()),
            ("llama.cpp", f"llama-cpp-python {rt['llama_cpp_python']}; backends "
                          f"{', '.join(rt['backends'])}"),
            ("CPU backend", rt["cpu_backend"]),
            ("CPU features", rt["system_info"]),
            ("Installed as", "desktop bundle" if getattr(sys, "frozen", False) else sys.prefix),
            ("Qt", f"{qVersion()} (PySide6 {pyside_version})"),
            ("Python", f"{platform.python_version()} ({sys.executable})"),
            ("System", platform.platform()),
            ("Conversations", store_path),
            ("Data folder", str(data_dir())),
            ("Models and cache", f"{models_dir()} (cache {cache_dir()})")]


def diagnostics_text(facts: list[tuple[str, str]], devices: Sequence[DeviceInfo],
                     loaded: LoadDetails | None, last_error: str) -> str:
    lines = ["Ebb diagnostics"] + [f"{k}: {v}" for k, v in facts]
    lines.append("Devices at the last load:" if devices else "Devices: no model loaded yet")
    for d in devices:
        mem = (f"{(d.free_bytes or 0) / 2**20:.0f} MiB free of {d.total_bytes / 2**20:.0f} MiB"
               if d.total_bytes else "memory n/a")
        lines.append(f"  {d.name} ({d.kind}{', remote' if d.remote else ''}): {d.description}, {mem}")
    if loaded is not None:
        lines.append(f"Placement: {loaded.n_layers_on_accel} layers on "
                     f"{loaded.accelerator or 'no accelerator'}, {loaded.mover} "
                     f"mover; {loaded.placement_reason}")
    lines.append(f"Last error: {last_error or 'none'}")
    return "\n".join(lines)


class AboutDialog(QDialog):
    def __init__(self, facts: list[tuple[str, str]], diagnostics: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("About Ebb")
        self.diagnostics = diagnostics
        rows = "".join(f"<tr><td style='padding-right:12px'><b>{k}</b></td><td>{v}</td></tr>"
                       for k, v in facts)
        text = QLabel("<p><b>Ebb</b>: private, local, multimodal chat. The vision projector "
                      "lives in RAM and borrows the accelerator per image.</p>"
                      f"<table>{rows}</table>", wordWrap=True)
        text.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.copy_button = QPushButton("Copy diagnostics", clicked=self.copy)
        self.copied = QLabel("")
        close = QPushButton("Close", clicked=self.accept)
        buttons = QHBoxLayout()
        buttons.addWidget(self.copied, 1)
        buttons.addWidget(self.copy_button)
        buttons.addWidget(close)
        lay = QVBoxLayout(self)
        lay.addWidget(text)
        lay.addLayout(buttons)
        self.resize(720, 360)

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.diagnostics)
        self.copied.setText("Copied: paste it into a bug report.")
