"""Files into the message being written: dropped anywhere on the window, or chosen with
Attach…; they go to the composer, which reads and checks them (app/widgets/composer.py)."""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QObject, Slot
from PySide6.QtGui import QDragEnterEvent, QDropEvent
from PySide6.QtWidgets import QFileDialog, QWidget

from app.widgets.composer import Composer


class Attaching(QObject):
    """Takes what is dragged onto the window (it accepts drops wherever the cursor is over it;
    a child that does not take a drop passes it up: MainWindow's dragEnterEvent and dropEvent
    hand them here) and runs Attach…'s file dialog. An event filter on the window would do the
    same, at the price of a call into Python for every event the window gets (#54)."""

    def __init__(self, window: QWidget, composer: Composer) -> None:
        super().__init__(window)
        self.window = window
        self.composer = composer
        window.setAcceptDrops(True)

    def drag_enter(self, event: QDragEnterEvent) -> None:
        if event.mimeData().hasUrls() or event.mimeData().hasImage():
            event.acceptProposedAction()

    def drop(self, event: QDropEvent) -> None:
        self.composer.edit.insertFromMimeData(event.mimeData())
        event.acceptProposedAction()

    @Slot()
    def choose(self) -> None:
        """Attach…: pictures, clips, videos, PDFs or text files, from the Pictures folder first."""
        from app.widgets.start_folder import Location, start_folder
        from engine.media.kinds import attach_filter

        start = str(start_folder(Location.PicturesLocation))
        paths, _ = QFileDialog.getOpenFileNames(
            self.window, "Attach pictures, clips, videos, PDFs or text files", start, attach_filter())
        self.composer.attach_all([Path(p) for p in paths])
