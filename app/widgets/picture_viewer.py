"""A picture of the chat at full size (a thumbnail's click): as large as the screen allows,
scrolled when larger; Esc or Close leaves. GUI thread only."""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication, QPixmap
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QScrollArea, QVBoxLayout, QWidget


class PictureViewer(QDialog):
    def __init__(self, path: Path, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle(Path(path).name)
        pix = QPixmap(str(path))
        self.label = QLabel(alignment=Qt.AlignmentFlag.AlignCenter)
        if pix.isNull():  # gone or damaged since it was sent: said, not an empty window
            self.label.setText(f"{Path(path).name} cannot be shown: the file is gone or damaged")
        else:
            self.label.setPixmap(pix)
        scroll = QScrollArea(widgetResizable=True)
        scroll.setWidget(self.label)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        lay = QVBoxLayout(self)
        lay.addWidget(scroll, 1)
        lay.addWidget(buttons)
        screen = QGuiApplication.primaryScreen()
        avail = screen.availableGeometry() if screen is not None else None
        w, h = (pix.width() + 40, pix.height() + 80) if not pix.isNull() else (420, 160)
        if avail is not None:
            w, h = min(w, int(avail.width() * 0.9)), min(h, int(avail.height() * 0.9))
        self.resize(max(w, 240), max(h, 160))
