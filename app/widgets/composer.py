"""The composer: text, attached pictures as thumbnails and sound clips as chips (name,
length, play), each with a remove button; paste and drop.

Enter sends, Shift+Enter is a new line. A file that is not a usable picture or clip is named
and explained inline and never attached. GUI thread only.
"""
from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

from PySide6.QtCore import QMimeData, QSize, Qt, QTimer, Signal
from PySide6.QtGui import QImage, QKeyEvent, QPixmap, QTextOption
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.sound.clips import ClipPlayer, describe
from app.sound.recorder import Recorder, RecordError
from app.core.store import Message
from app.core.media_words import (TEXT_BYTES_PER_TOKEN, Look, choose_frames, choose_pages,
                                   is_document_like, look, preview)
from engine.errors import EbbError
from engine.media.kinds import PDF, VIDEO, is_clip, kind_of
from engine.media import attachments
from engine.media.audio import MAX_CLIP_SECONDS, fmt_seconds
from engine.media.documents import MAX_PAGES
from engine.media.images import MAX_IMAGE_PIXELS

THUMB = 64


def check_image(path: Path) -> str | None:
    """A quick look (header only, no full decode): None when it can be attached, else why not."""
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        return "file not found"
    if path.stat().st_size == 0:
        return "the file is empty"
    try:
        with Image.open(path) as im:
            if im.width * im.height > MAX_IMAGE_PIXELS:
                return (f"{im.width}x{im.height} is {im.width * im.height / 1e6:.0f} megapixels; "
                        f"the limit is {MAX_IMAGE_PIXELS // 1_000_000}")
    except UnidentifiedImageError:
        return "not an image Ebb can read (PNG, JPEG, WebP, GIF, BMP)"
    except (OSError, ValueError) as exc:
        return f"damaged ({exc})"
    return None


class MessageEdit(QPlainTextEdit):
    send_requested = Signal()
    escape_pressed = Signal()
    image_pasted = Signal(object)  # Path
    files_dropped = Signal(object)  # list[Path]: several at once, each one's problem said
    paste_refused = Signal(str)  # why
    # the most text a paste may bring (bytes): the window sets it from the model's context
    # (a message past it could not be sent anyway; laying out 5 MB froze the window seconds)
    max_paste_bytes = 8 << 20

    def keyPressEvent(self, e: QKeyEvent) -> None:
        if e.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
                e.modifiers() & Qt.KeyboardModifier.ShiftModifier):
            self.send_requested.emit()
            return
        if e.key() == Qt.Key.Key_Escape:
            self.escape_pressed.emit()
            return
        super().keyPressEvent(e)

    def canInsertFromMimeData(self, source: QMimeData) -> bool:
        return source.hasImage() or source.hasUrls() or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source: QMimeData) -> None:
        if source.hasImage():
            image = QImage(source.imageData())
            if not image.isNull():
                self.image_pasted.emit(save_pasted(image))
                return
        if source.hasUrls() and all(u.isLocalFile() for u in source.urls()):
            self.files_dropped.emit([Path(u.toLocalFile()) for u in source.urls()])
            return
        if source.hasText():
            if _has_long_run(source.text()):  # Qt lays a huge word out in seconds unless it
                self.setWordWrapMode(QTextOption.WrapMode.WrapAnywhere)  # may break anywhere
            n_bytes = len(source.text().encode("utf-8", errors="replace"))
            if n_bytes + len(self.toPlainText().encode("utf-8", errors="replace")) > self.max_paste_bytes:
                self.paste_refused.emit(
                    f"Not pasted: {n_bytes / 2**20:.1f} MiB of text is more than this model's "
                    f"context can hold (about {self.max_paste_bytes / 2**20:.1f} MiB at the most). "
                    "Paste a part of it, or raise the context in Settings.")
                return
        super().insertFromMimeData(source)


def _has_long_run(text: str) -> bool:
    """A run of over 2,000 characters with no space (a pasted blob, one huge word)."""
    import re

    return re.search(r"\S{2001,}", text) is not None


def save_pasted(image: QImage) -> Path:
    """A pasted image as a PNG file (named by content) so it can be stored and sent."""
    folder = Path(tempfile.gettempdir()) / "ebb-pasted"
    folder.mkdir(exist_ok=True)
    tmp = folder / "pasting.png"
    image.save(str(tmp), "PNG")
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()[:16]
    final = folder / f"pasted-{digest}.png"
    tmp.replace(final)
    return final


PLAY_POLL_MS = 200  # how often a playing clip is asked whether it ended


class Composer(QWidget):
    send_requested = Signal()
    fits_changed = Signal()  # the message's estimate went over the context's room, or back

    def __init__(self) -> None:
        super().__init__()
        self.attachments: list[Path] = []  # in the order attached (a PDF's: "#pages=3-5")
        self.over_budget = False  # the estimate is more than the context has free: Send is off
        self._drafts: dict[int, tuple[str, list[Path]]] = {}  # chat -> its unsent text and files
        self._draft_for: int | None = None  # the chat the composer's text belongs to
        self._looks: dict[str, Look] = {}  # a video's, PDF's or text file's words and cost
        # what a frame or a page takes with the loaded projector, and the context's free room:
        # the window sets them (a video's frames are chosen to fit; the budget line says)
        self.picture_tokens = 0
        self.clip_chunk_tokens = 0  # tokens a 30-second piece of sound takes (0: none hears)
        self.room_tokens = 0
        self.player = ClipPlayer(self.show_error)
        self._play_buttons: dict[Path, QToolButton] = {}  # each clip chip's ▶ (■ while it plays)
        # while a clip plays: its end turns ■ back into ▶ (the player hears it from the stream)
        self._play_timer = QTimer(self, interval=PLAY_POLL_MS, timeout=self._on_play_tick)
        self.edit = MessageEdit(placeholderText="Message Ebb — Enter sends, Shift+Enter new line, "
                                                "Ctrl+V pastes an image; drop pictures, clips, "
                                                "videos, PDFs or text files")
        self.edit.setMaximumHeight(96)
        self.edit.send_requested.connect(self.send_requested)
        self.edit.escape_pressed.connect(self.cancel_edit)
        self.edit.image_pasted.connect(self.attach)
        self.edit.files_dropped.connect(self.attach_all)
        self.edit.paste_refused.connect(self.show_error)
        # the attachments side by side, each chip at a width its words read at; more than the
        # composer is wide scroll sideways (four or five squeezed chips overlapped their ✕)
        self.strip_box = QWidget()
        self.strip = QHBoxLayout(self.strip_box)
        self.strip.setContentsMargins(0, 0, 0, 0)
        self.strip.addStretch(1)
        self.strip_area = QScrollArea(widgetResizable=True, frameShape=QFrame.Shape.NoFrame)
        self.strip_area.setWidget(self.strip_box)
        self.strip_area.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self.strip_area.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.strip_area.hide()
        self.error = QLabel("")
        self.error.setStyleSheet("color: #c62828;")
        self.error.setWordWrap(True)
        self.error.hide()
        # editing a sent message: Send makes a new version of it (the old one stays)
        self.editing: Message | None = None
        self.edit_bar = QWidget()
        bar = QHBoxLayout(self.edit_bar)
        bar.setContentsMargins(0, 0, 0, 0)
        self.edit_label = QLabel("", wordWrap=True)
        self.edit_label.setStyleSheet("color: #1d4f7a;")
        bar.addWidget(self.edit_label, 1)
        bar.addWidget(QPushButton("Cancel edit", clicked=self.cancel_edit))
        self.edit_bar.hide()
        # recording from the microphone: the time so far against the limit, a level meter
        self.recorder: Recorder | None = None
        self.record_backend = ""  # "" the system's; tests: "null" (miniaudio's silent device)
        # where recordings are written: the window sets the data folder's (app/sound/recorder.py)
        self.recordings_dir = Path.home() / ".cache" / "ebb" / "recordings"
        self.record_limit_s = float(MAX_CLIP_SECONDS)  # the window sets it from the context left
        self.record_bar = QWidget()
        rb = QHBoxLayout(self.record_bar)
        rb.setContentsMargins(0, 0, 0, 0)
        self.record_label = QLabel("")
        self.record_label.setStyleSheet("color: #c62828;")
        self.meter = QProgressBar(maximum=100, textVisible=False, maximumHeight=10,
                                  maximumWidth=80, toolTip="The microphone's level")
        self.record_label.setMinimumWidth(
            self.record_label.fontMetrics().horizontalAdvance("● 00:00 / 00:00") + 12)
        rb.addWidget(self.record_label, 1)
        rb.addWidget(self.meter)
        rb.addWidget(QPushButton("Stop", clicked=self.stop_recording,
                                 toolTip="End the recording: it is attached, to play before sending"))
        rb.addWidget(QPushButton("Cancel", clicked=self.cancel_recording))
        self.record_bar.hide()
        self._record_timer = QTimer(self, interval=100, timeout=self._record_tick)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.edit_bar)
        lay.addWidget(self.record_bar)
        lay.addWidget(self.strip_area)
        self.budget = QLabel("", wordWrap=True)
        self.budget.hide()
        self.edit.textChanged.connect(self._update_budget)
        self.edit.textChanged.connect(self._hide_error_when_empty)
        lay.addWidget(self.budget)
        lay.addWidget(self.error)
        lay.addWidget(self.edit)

    def text(self) -> str:
        return self.edit.toPlainText().strip()

    def look(self, ref: Path) -> Look:
        """A video's, a PDF's or a text file's words and cost (kept until it is taken off)."""
        key = str(ref)
        if key not in self._looks:
            self._looks[key] = look(ref, picture_tokens=self.picture_tokens, room_tokens=self.room_tokens)
        return self._looks[key]

    def recount(self) -> None:
        """The model or the room changed: each attachment's words and cost again. One that this
        model cannot take (a scanned PDF, to a model that does not see, attached while it
        loaded) is taken off, and said."""
        self._looks.clear()
        refused = []
        for path in [p for p in self.attachments if is_document_like(p)]:
            problem = self.look(path).problem
            if problem:
                self.attachments.remove(path)
                refused.append(f"{attachments.split(path)[0].name}: {problem} — taken off")
        self._rebuild_strip()
        if refused:
            self.show_error("\n".join(refused))

    def problem(self, path: Path) -> str | None:
        """Why `path` cannot be attached (a quick look at its header), or None."""
        if is_document_like(path):
            return self.look(path).problem
        return describe(path)[1] if is_clip(path) else check_image(path)

    def ask_text(self, title: str, label: str, default: str = "", secret: bool = False) -> str | None:
        """A line from the user (a page range, a password; "" when left empty); None when
        cancelled."""
        mode = QLineEdit.EchoMode.Password if secret else QLineEdit.EchoMode.Normal
        text, ok = QInputDialog.getText(self, title, label, mode, default)
        return text.strip() if ok else None

    def _settle(self, path: Path) -> Path | None:
        """A PDF that needs a word from the user first: its password (an unlocked copy, in the
        data folder, is attached), its page range (a long one). Others as they are; None when
        the user cancelled."""
        if not is_document_like(path):
            return path
        seen = self.look(path)
        if seen.locked:
            from engine.media.documents import PasswordNeeded, unlocked_copy

            asking = f"{path.name} is locked. Its password:"
            while True:
                word = self.ask_text("Password", asking, secret=True)
                if word is None:
                    return None
                try:
                    path = unlocked_copy(path, word, self.recordings_dir.parent / "unlocked")
                    break
                except PasswordNeeded:  # not right: asked again, saying so (Cancel ends it)
                    asking = (f"Wrong password: {path.name} did not open with it.\n"
                              f"{path.name} is locked. Its password:")
            seen = self.look(path)
        if seen.pages > MAX_PAGES and not attachments.parse(path).pages:
            pages = self.ask_text("Pages", f"{path.name} has {seen.pages:,} pages; Ebb takes up to "
                                  f"{MAX_PAGES} at a time. Which pages?", f"1-{MAX_PAGES}")
            if pages is None:
                return None
            path = Path(f"{path}#pages={pages}")
        return path

    def attach(self, path: Path) -> bool:
        return not self.attach_all([Path(path)])

    def attach_all(self, paths: list[Path]) -> list[str]:
        """Attach those that can be; the others are named with their reasons, one line each
        (several bad files dropped at once said only the last). Returns those lines."""
        refused = []
        for given in map(Path, paths):
            settled = self._settle(given)
            if settled is None:
                continue  # the user cancelled the question: nothing attached, nothing to say
            path = settled
            problem = self.problem(path)
            if problem:
                refused.append(f"{path.name}: {problem} — not attached")
            elif path not in self.attachments:
                self.attachments.append(path)
        self._rebuild_strip()
        if refused:
            self.show_error("\n".join(refused))
        else:
            self.error.hide()
        return refused

    def start_recording(self) -> bool:
        """Record from the microphone until Stop, Cancel or the limit. False (and a message
        here) when there is no microphone or no room for a clip."""
        if self.recorder is not None:
            return True
        if self.record_limit_s < 1:
            self.show_error("No room left in this model's context for a recording: start a new "
                            "chat, or raise the context in Settings")
            return False
        rec = Recorder(self.record_backend)
        try:
            rec.start()
        except RecordError as exc:
            self.show_error(str(exc))
            return False
        self.recorder = rec
        self.error.hide()
        self.record_bar.show()
        self._record_tick()
        self._record_timer.start()
        return True

    def _record_tick(self) -> None:
        rec = self.recorder
        if rec is None:
            return
        done = rec.seconds()
        self.record_label.setText(f"● {fmt_seconds(done)} / {fmt_seconds(self.record_limit_s)}")
        self.record_label.setToolTip(f"Recording: {fmt_seconds(done)} so far; it stops itself at "
                                     f"{fmt_seconds(self.record_limit_s)}, what the context has room for")
        self.meter.setValue(int(rec.level() * 100))
        if done >= self.record_limit_s:
            self.stop_recording()

    def stop_recording(self) -> Path | None:
        """End the recording and attach it (its chip plays it before sending)."""
        rec, self.recorder = self.recorder, None
        self._record_timer.stop()
        self.record_bar.hide()
        if rec is None:
            return None
        try:
            path = rec.stop(self.recordings_dir)
        except RecordError as exc:
            self.show_error(str(exc))
            return None
        attached = self.attach(path)
        short = rec.shortfall(rec.ran_s)
        if short:  # attached all the same: what came is the user's to send or not
            self.show_error(short)
        return path if attached else None

    def cancel_recording(self) -> None:
        rec, self.recorder = self.recorder, None
        self._record_timer.stop()
        self.record_bar.hide()
        if rec is not None:
            rec.cancel()

    def show_error(self, text: str) -> None:
        self.error.setText(text)
        self.error.show()

    def _hide_error_when_empty(self) -> None:
        """A refusal is about what the composer holds: emptied, there is nothing to refuse."""
        if not self.edit.toPlainText().strip() and not self.attachments:
            self.error.hide()

    def adopt_chat(self, conv_id: int) -> None:
        """The chat being written in got its id (a new chat is made at its first message)."""
        self._draft_for = conv_id

    def switch_draft(self, conv_id: int) -> None:
        """Another chat is open: what was being written stays with the chat it was written in
        (back there, it is back here), and this chat's own draft, if any, comes back."""
        if self._draft_for is not None and (self.edit.toPlainText() or self.attachments):
            self._drafts[self._draft_for] = (self.edit.toPlainText(), list(self.attachments))
        elif self._draft_for is not None:
            self._drafts.pop(self._draft_for, None)
        self._draft_for = conv_id
        text, images = self._drafts.pop(conv_id, ("", []))
        self.edit.setPlainText(text)
        self.attachments = list(images)
        self._rebuild_strip()
        self.error.hide()

    def detach(self, path: Path) -> None:
        if self.player.playing == path:
            self.player.stop()
        self.attachments = [p for p in self.attachments if p != path]
        self._rebuild_strip()
        self._hide_error_when_empty()

    def clear(self) -> None:
        """After a send: empty, and no earlier error left standing."""
        self.edit.clear()
        self.edit.setWordWrapMode(QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere)
        self.attachments = []
        self._rebuild_strip()
        self.error.hide()
        self._set_editing(None)

    def start_edit(self, m: Message, text: str | None = None, images: list[Path] | None = None) -> None:
        """Edit a sent message here (its text and pictures, or `text`/`images` when given back
        after a failure): Send makes a new version of it."""
        self.restore(m.text if text is None else text, list(m.images if images is None else images))
        self._set_editing(m)
        self.edit.setFocus()

    def cancel_edit(self) -> None:
        self.clear()

    def _set_editing(self, m: Message | None) -> None:
        self.editing = m
        if m is None:
            self.edit_bar.hide()
            return
        self.edit_label.setText(
            "Editing your message: Send makes a new version of it and answers that; the old "
            "one stays (‹ › above it goes back)." if m.role == "user" else
            "Editing Ebb's reply: Send keeps your text as a new version of it (nothing is "
            "generated); the old one stays.")
        self.edit_bar.show()

    def restore(self, text: str, images: list[Path]) -> None:
        """Put a message back (when sending it failed): nothing the user wrote is lost."""
        if _has_long_run(text):
            self.edit.setWordWrapMode(QTextOption.WrapMode.WrapAnywhere)
        self.edit.setPlainText(text)
        self.attachments = list(images)
        self._rebuild_strip()

    def toggle_play(self, path: Path) -> None:
        """A clip chip's ▶: play it (■ while it plays), or stop it."""
        self.player.toggle(path)
        self._show_playing()
        if self.player.playing is not None:
            self._play_timer.start()

    def _on_play_tick(self) -> None:
        if self.player.poll() or self.player.playing is None:
            self._play_timer.stop()
            self._show_playing()

    def _show_playing(self) -> None:
        for path, button in self._play_buttons.items():
            playing = self.player.playing == path
            button.setText("■" if playing else "▶")
            button.setToolTip(f"{'Stop' if playing else 'Play'} {path.name}")

    def _rebuild_strip(self) -> None:
        self._play_buttons = {}
        while self.strip.count() > 1:
            item = self.strip.takeAt(0)
            widget = item.widget() if item is not None else None
            if widget is not None:
                widget.hide()  # at once: deleteLater waits for the event loop
                widget.deleteLater()
        for i, path in enumerate(self.attachments):
            chip = self._thumb(path)
            self.strip.insertWidget(i, chip)
            chip.show()  # now: a layout shows a child it gets later only on the next event pass
        self._fit_strip()
        self._looks = {k: v for k, v in self._looks.items() if Path(k) in self.attachments}
        self._update_budget()

    def _clip_chip(self, path: Path) -> QWidget:
        """A clip: its name, length and format, a play button and a remove button."""
        box = QWidget()
        lay = QHBoxLayout(box)
        lay.setContentsMargins(4, 2, 4, 2)
        box.setStyleSheet("QWidget { background: #eef3f8; border-radius: 4px; }")
        play = QToolButton(text="▶", toolTip=f"Play {path.name} (again: stop)")
        play.clicked.connect(lambda: self.toggle_play(path))
        self._play_buttons[path] = play
        remove = QToolButton(text="✕", toolTip=f"Remove {path.name}")
        remove.clicked.connect(lambda: self.detach(path))
        lay.addWidget(play)
        lay.addWidget(QLabel(describe(path)[0]))
        lay.addWidget(remove)
        return box

    def _doc_chip(self, path: Path) -> QWidget:
        """A video, a PDF or a text file: what it is and what it costs, and a remove button."""
        box = QWidget()
        lay = QHBoxLayout(box)
        lay.setContentsMargins(4, 2, 4, 2)
        box.setStyleSheet("QWidget { background: #eef3f8; border-radius: 4px; }")
        picture = preview(path)
        if picture is not None:  # a video's first frames, a PDF's first page
            shown = QLabel()
            data = picture.tobytes()
            shown.setPixmap(QPixmap.fromImage(QImage(data, picture.width, picture.height, 3 * picture.width,
                                                     QImage.Format.Format_RGB888).copy()))
            shown.setFixedSize(picture.width, picture.height)  # the words wrap, the strip stays whole
            shown.setToolTip("its first frames" if kind_of(attachments.split(path)[0]) == VIDEO
                             else "its first page chosen")
            lay.addWidget(shown)
        words = QLabel(self.look(path).words, wordWrap=True, minimumWidth=150, maximumWidth=240)
        words.setToolTip(str(attachments.split(path)[0]))
        name = attachments.split(path)[0].name
        remove = QToolButton(text="✕", toolTip=f"Remove {name}")
        remove.clicked.connect(lambda: self.detach(path))
        lay.addWidget(words)
        kind = kind_of(attachments.split(path)[0])
        if kind in (VIDEO, PDF):
            choose = QToolButton(text="⋯", toolTip=f"Choose the {'frames' if kind == VIDEO else 'pages'} "
                                                   f"of {name} to send")
            choose.clicked.connect(lambda: self.choose(path))
            lay.addWidget(choose)
        lay.addWidget(remove)
        return box

    def choose(self, path: Path) -> None:
        """The user picks what to take: a video's spacing and part, a PDF's pages."""
        base = attachments.split(path)[0]
        if kind_of(base) == VIDEO:
            answer = self.ask_text("Frames", f"Frames of {base.name}: a spacing in seconds and/or a "
                                   "part, e.g. 4, 0:10-1:10 (empty: Ebb chooses to fit)", "")
            make = choose_frames
        else:
            answer = self.ask_text("Pages", f"Pages of {base.name}, e.g. 3-5 (add 'text' for its "
                                   "text layer; empty: all)", attachments.parse(path).pages)
            make = choose_pages
        if answer is None:
            return
        try:
            new = make(path, answer or "")
        except EbbError as exc:
            self.show_error(str(exc))
            return
        problem = self.problem(new)
        if problem:  # that choice cannot be sent: the one before stays
            self.show_error(f"{base.name}: {problem} — kept as it was")
            return
        self.attachments = [new if p == path else p for p in self.attachments]
        self.error.hide()
        self._rebuild_strip()

    def _update_budget(self) -> None:
        """Before Send: what the message will take of the context, about, against its room.
        Over it, Send is off (`over_budget`) until something is removed."""
        was = self.over_budget
        self.over_budget = False
        self._set_budget()
        if self.over_budget != was:
            self.fits_changed.emit()

    def _set_budget(self) -> None:
        if not self.attachments or not self.room_tokens:
            self.budget.hide()
            return
        text = len(self.text().encode()) // TEXT_BYTES_PER_TOKEN
        total = text + sum(self._tokens_of(p) for p in self.attachments)
        over = self.over_budget = total > self.room_tokens
        self.budget.setText(f"This message: ≈{total:,} tokens of the {self.room_tokens:,} the "
                            "context has free" + (" — too many: remove something, or start a new "
                                                  "chat" if over else ""))
        self.budget.setStyleSheet("color: #c62828;" if over else "color: #555555;")
        self.budget.show()

    def _fit_strip(self) -> None:
        """The strip as tall as its tallest chip (and its scroll bar when it scrolls)."""
        self.strip_area.setVisible(bool(self.attachments))
        if not self.attachments:
            return
        self.strip_box.adjustSize()
        bar = self.strip_area.horizontalScrollBar().sizeHint().height()
        self.strip_area.setFixedHeight(self.strip_box.sizeHint().height() + bar + 2)

    def _tokens_of(self, path: Path) -> int:
        """What one attachment takes of the context, about: a clip its 30-second chunks (a
        Qwen2-Audio clip is 750 tokens, not a picture's count), a document its look's."""
        if is_document_like(path):
            return self.look(path).tokens
        if is_clip(path):
            from engine.media.audio import clip_info
            from engine.media.projector import CLIP_SECONDS

            try:
                seconds = clip_info(path).seconds
            except EbbError:
                return 0
            # mtmd's chunks: k x 30 s of sound makes k + 1 (it pads, and keeps each whole one)
            return (int(seconds // CLIP_SECONDS) + 1) * self.clip_chunk_tokens
        return self.picture_tokens

    def _thumb(self, path: Path) -> QWidget:
        if is_document_like(path):
            return self._doc_chip(path)
        if is_clip(path):
            return self._clip_chip(path)
        box = QWidget()
        lay = QVBoxLayout(box)
        lay.setContentsMargins(0, 0, 0, 0)
        pic = QLabel()
        pix = QPixmap(str(path))
        if not pix.isNull():
            pic.setPixmap(pix.scaled(QSize(THUMB, THUMB), Qt.AspectRatioMode.KeepAspectRatio,
                                     Qt.TransformationMode.SmoothTransformation))
        pic.setToolTip(path.name)
        remove = QToolButton(text="✕", toolTip=f"Remove {path.name}")
        remove.clicked.connect(lambda: self.detach(path))
        lay.addWidget(pic)
        lay.addWidget(remove, 0, Qt.AlignmentFlag.AlignHCenter)
        return box
