"""Model → Get models…: search the Hugging Face Hub (or a mirror) for GGUF models, see each
quantisation judged for this machine from its remote header before downloading, and download
a model with its projector, resumable, then open the pair.

The network work runs on short-lived Python threads (never the GUI thread, never the engine's
worker, which owns llama.cpp: the machine comes from the loaded session's devices); results come
back to the GUI thread through `_Jobs`' queued signals. Downloads belong to the window
(app/mainwindow/downloads.py): closing the dialog leaves them running, and the dialog's
Downloads list shows every one of them when it opens again.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QProgressBar,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.core.settings import Settings
from app.widgets.downloads import CANCELLED, DONE, FAILED, PAUSED, RUNNING, Download, Downloads
from engine.errors import EbbError
from engine.hub.catalog import HubFile, Quant, RepoFiles, RepoHit
from engine.hub.fetch import Fetched
from engine.hub.verdict import Machine, Verdict
from engine.units import fmt_bytes


class _Jobs(QObject):
    """Signals from the worker threads (Qt queues them to the GUI thread)."""
    found = Signal(object)  # list[RepoHit]
    listed = Signal(object)  # RepoFiles
    judged = Signal(int, object)  # row, Verdict or an error's text
    failed = Signal(str)  # one line for the user


def _run(target: Callable[[], None]) -> threading.Thread:
    t = threading.Thread(target=target, name="ebb-hub", daemon=True)
    t.start()
    return t


class HubDialog(QDialog):
    open_pair = Signal(str, str)  # model, projector ("" for none)

    def __init__(self, settings: Settings, machine: Machine,
                 save_setting: Callable[[str, object], None], downloads: Downloads,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Get models")
        self.resize(980, 600)
        self.machine, self._save = machine, save_setting
        self.jobs = _Jobs(self)
        self.files: RepoFiles | None = None  # the chosen repo's
        self.repo = ""
        self.downloads = downloads
        self.current: int | None = None  # the download the bar and the buttons follow
        self.fetched: Fetched | None = None
        self._generation = 0  # a newer listing makes an older one's verdicts stale
        self._searches = 0  # a newer search makes an older one's results stale
        self.verdicts: dict[int, Verdict] = {}  # row -> its verdict, as they come (the recommendation)
        self.refused: dict[int, str] = {}  # row -> why it cannot be loaded (never downloaded)
        self._build(settings)
        self.jobs.found.connect(self._on_found)
        self.jobs.listed.connect(self._on_listed)
        self.jobs.judged.connect(self._on_judged)
        self.jobs.failed.connect(self._on_failed)
        downloads.changed.connect(self._on_download_news)
        downloads.ended.connect(self._on_download_ended)
        for d in downloads.all:  # what is under way, or was, since the window opened
            self._show_in_list(d.number)
        if downloads.all:
            self._follow((downloads.running() or downloads.all)[-1].number)
        # it opens on something: the most downloaded GGUF models (that see images, if ticked)
        self.search()

    # ---------------------------------------------------------------- layout

    def _build(self, settings: Settings) -> None:
        self.query = QLineEdit(placeholderText="search GGUF models, e.g. qwen2.5-vl, gemma-3, smolvlm")
        self.query.returnPressed.connect(self.search)
        self.images = QCheckBox("Can see images", checked=settings.hub_images)
        self.images.toggled.connect(lambda on: self._save("hub_images", bool(on)))
        self.sort = QComboBox()
        self.sort.addItem("Most downloaded", "downloads")
        self.sort.addItem("Recently updated", "updated")
        go = QPushButton("Search", clicked=self.search)
        top = QHBoxLayout()
        for w in (self.query, self.images, self.sort, go):
            top.addWidget(w, 1 if w is self.query else 0)
        self.mirror = QLineEdit(settings.hub_endpoint,
                                placeholderText="mirror URL (default: HF_ENDPOINT, else huggingface.co)")
        self.token = QLineEdit(settings.hub_token, placeholderText="token for gated models "
                               "(default: HF_TOKEN)", echoMode=QLineEdit.EchoMode.Password)
        hub_row = QHBoxLayout()
        hub_row.addWidget(QLabel("Mirror"))
        hub_row.addWidget(self.mirror, 2)
        hub_row.addWidget(QLabel("Token"))
        hub_row.addWidget(self.token, 1)
        self.error = QLabel("", wordWrap=True, visible=False,
                            styleSheet="QLabel { color: white; background: #b3261e; padding: 6px; }")
        self.results = QListWidget()
        self.results.currentItemChanged.connect(self._on_repo)
        self.table = QTableWidget(0, 3)
        self.table.setHorizontalHeaderLabels(["Quantisation", "Size", "On this machine"])
        self.table.horizontalHeader().setSectionResizeMode(2, QHeaderView.ResizeMode.Stretch)
        self.table.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QTableWidget.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.projector = QComboBox()
        right = QWidget()
        rl = QVBoxLayout(right)
        rl.setContentsMargins(0, 0, 0, 0)
        self.repo_label = QLabel("Pick a model on the left.", wordWrap=True)
        rl.addWidget(self.repo_label)
        rl.addWidget(self.table, 1)
        row = QHBoxLayout()
        row.addWidget(QLabel("Projector"))
        row.addWidget(self.projector, 1)
        rl.addLayout(row)
        split = QSplitter()
        split.addWidget(self.results)
        split.addWidget(right)
        split.setSizes([330, 650])
        self.bar = QProgressBar(visible=False)
        self.status = QLabel("", wordWrap=True)
        # every download since the window opened; the bar and the buttons follow the one picked
        self.list = QListWidget(visible=False, maximumHeight=96)
        self.list.currentRowChanged.connect(self._on_list_row)
        self.download = QPushButton("Download", clicked=self.start_download, enabled=False)
        self.pause = QPushButton("Pause", enabled=False, clicked=self.pause_download)
        # Cancel: the download stops and its parts go (Pause keeps them)
        self.stop = QPushButton("Cancel download", enabled=False, clicked=self.cancel_download)
        self.open_now = QPushButton("Open now", clicked=self._on_open, enabled=False)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        for b in (self.download, self.pause, self.stop, self.open_now,
                  QPushButton("Close", clicked=self.close)):
            buttons.addWidget(b)
        lay = QVBoxLayout(self)
        lay.addLayout(top)
        lay.addLayout(hub_row)
        lay.addWidget(self.error)
        lay.addWidget(split, 1)
        self.list_label = QLabel("Downloads (they go on when this dialog is closed)", visible=False)
        lay.addWidget(self.list_label)
        lay.addWidget(self.list)
        lay.addWidget(self.bar)
        # the words on a line of their own, as tall as they wrap to (beside the buttons, a
        # retry's long line grew over the Downloads heading)
        lay.addWidget(self.status)
        lay.addLayout(buttons)
        self.table.itemSelectionChanged.connect(self._update_buttons)

    def _hub(self) -> tuple[str | None, str | None]:
        endpoint, token = self.mirror.text().strip() or None, self.token.text().strip() or None
        self._save("hub_endpoint", endpoint or "")
        self._save("hub_token", token or "")
        return endpoint, token

    def _say(self, text: str) -> None:
        self.error.setText(text)
        self.error.setVisible(bool(text))

    # ---------------------------------------------------------------- search and listing

    def search(self) -> None:
        from engine.hub.catalog import search

        endpoint, token = self._hub()
        query, images, sort = self.query.text().strip(), self.images.isChecked(), self.sort.currentData()
        self._say("")
        self.status.setText("Searching…" if query else "Finding the most downloaded models…")
        self._forget_repo("")  # the last repo's files, verdicts and Download go with its results
        self._searches += 1
        n = self._searches
        self._try(lambda: self.jobs.found.emit((n, search(query, images, sort, 40, endpoint, token))))

    def _try(self, work: Callable[[], None]) -> None:
        def run() -> None:
            try:
                work()
            except EbbError as exc:
                self.jobs.failed.emit(str(exc))
            except Exception as exc:  # noqa: BLE001 - nothing escapes a worker thread unsaid
                self.jobs.failed.emit(f"{type(exc).__name__}: {exc}")
        _run(run)

    def _on_found(self, found: tuple[int, list[RepoHit]]) -> None:
        n, hits = found
        if n != self._searches:
            return  # a newer search is under way: its results count
        self.results.clear()
        for h in hits:
            item = QListWidgetItem(f"{h.repo}\n    {h.downloads:,} downloads · {h.last_modified[:10]}"
                                   + (" · sees images" if h.sees_images else ""), self.results)
            item.setData(Qt.ItemDataRole.UserRole, h.repo)
        self.status.setText(f"{len(hits)} found" if hits else "Nothing found: try other words"
                            + (", or untick Can see images" if self.images.isChecked() else ""))

    def _on_repo(self, item: QListWidgetItem | None, _previous: QListWidgetItem | None = None) -> None:
        from engine.hub.catalog import repo_files

        if item is None:
            return
        self._forget_repo(str(item.data(Qt.ItemDataRole.UserRole)))
        self.repo_label.setText(f"{self.repo}: reading its files…")
        self._say("")
        endpoint, token = self._hub()
        repo = self.repo
        self._try(lambda: self.jobs.listed.emit(repo_files(repo, endpoint, token)))

    def _forget_repo(self, repo: str) -> None:
        """Another repo (or none, "", for a new search): nothing of the last one stays."""
        self.repo = repo
        self.files = None
        self._generation += 1  # its verdicts still on their way are dropped
        self.verdicts, self.refused = {}, {}
        self.table.setRowCount(0)
        self.projector.clear()
        self.repo_label.setText("")
        self._update_buttons()

    def _on_listed(self, files: RepoFiles) -> None:
        if files.repo != self.repo:
            return  # the user picked another repo meanwhile
        self.files = files
        self._generation += 1
        self.verdicts, self.refused = {}, {}
        self.repo_label.setText(f"{files.repo}: judged for this machine "
                                f"({self.machine.accel or 'CPU only'}) from each file's header")
        self.table.setRowCount(len(files.quants))
        for row, q in enumerate(files.quants):
            parts = f" ({len(q.parts)} parts)" if len(q.parts) > 1 else ""
            for col, text in enumerate((q.label, fmt_bytes(q.size_bytes) + parts, "reading the header…")):
                self.table.setItem(row, col, QTableWidgetItem(text))
        for p in files.projectors:
            self.projector.addItem(f"{p.name} ({fmt_bytes(p.size_bytes)})", p.name)
        self.projector.addItem("none: text only", "")
        self._judge_all(files, self._generation)
        self._update_buttons()

    def _judge_all(self, files: RepoFiles, generation: int) -> None:
        from engine.hub.verdict import judge_remote, remote_projector

        endpoint, token = self._hub()

        def work() -> None:
            projector = None
            if files.projectors:  # read once, beside every quantisation
                try:
                    projector = remote_projector(files.repo, files.projectors[0], endpoint, token)
                except EbbError as exc:
                    self.jobs.failed.emit(f"the projector cannot be read ({exc}): the verdicts "
                                          "are for text only")
            for row, q in enumerate(files.quants):
                if generation != self._generation:
                    return
                try:
                    v: Verdict | str = judge_remote(files.repo, q, projector, self.machine, endpoint, token)
                except EbbError as exc:
                    v = f"cannot judge: {exc}"
                self.jobs.judged.emit(row, (generation, v))
        _run(work)

    def _on_judged(self, row: int, payload: tuple[int, Verdict | str]) -> None:
        generation, v = payload
        if generation != self._generation or row >= self.table.rowCount():
            return
        text = v if isinstance(v, str) else v.text
        if isinstance(v, str):
            self.refused[row] = text
        else:
            self.verdicts[row] = v
        self._update_buttons()
        item = QTableWidgetItem(text)
        item.setToolTip(text)
        if isinstance(v, str) or not v.fits:
            item.setForeground(Qt.GlobalColor.darkRed)
        self.table.setItem(row, 2, item)

    # ---------------------------------------------------------------- download

    def recommended_row(self) -> int | None:
        """The row engine.hub.verdict.recommend picks from the verdicts so far (None: none)."""
        from engine.hub.verdict import recommend

        if not self.files:
            return None
        rows = sorted(self.verdicts)
        pick = recommend([(self.files.quants[r].label, self.verdicts[r]) for r in rows])
        return next((r for r in rows if self.files.quants[r].label == pick[0]), None) if pick else None

    def _update_buttons(self) -> None:
        busy = self._following(RUNNING)
        rows = {i.row() for i in self.table.selectedItems()}
        picked = bool(rows)
        files = self.files
        rec = None if picked or not files else self.recommended_row()
        broken = [self.refused[r] for r in sorted(rows) if r in self.refused]
        self.download.setText("Download" if picked or rec is None or files is None else
                              f"Download {files.quants[rec].label} (suits this machine)")
        # a set that cannot be loaded (a part missing, not a GGUF) is never downloaded
        self.download.setEnabled(bool(self.files) and (picked or rec is not None) and not busy
                                 and not broken)
        self.download.setToolTip(broken[0] if broken else "")
        self.pause.setEnabled(busy)
        self.stop.setEnabled(busy or self._following(PAUSED))

    def _following(self, state: str) -> bool:
        return self.current is not None and self.downloads.get(self.current).state == state

    def chosen(self) -> tuple[Quant | None, HubFile | None]:
        """The quantisation clicked, else the one recommended for this machine, and the projector."""
        rows = {i.row() for i in self.table.selectedItems()}
        row = min(rows) if rows else self.recommended_row()
        quant = self.files.quants[row] if self.files and row is not None else None
        name = self.projector.currentData()
        proj = next((p for p in self.files.projectors if p.name == name), None) if self.files else None
        return quant, proj

    def start_download(self) -> None:
        quant, proj = self.chosen()
        if quant is None or self.files is None:
            return
        endpoint, token = self._hub()
        self._say("")
        self.fetched = None
        self.open_now.setEnabled(False)
        d = self.downloads.start(self.files.repo, quant, proj, endpoint, token)
        self._follow(d.number)

    def pause_download(self) -> None:
        """Stop, keeping what was written: Download again goes on from there."""
        if self.current is not None:
            self.downloads.pause(self.current)

    def cancel_download(self) -> None:
        """Stop the download and delete what it had written (Pause keeps it)."""
        if self.current is not None:
            self.downloads.cancel(self.current)

    def _show_in_list(self, number: int) -> None:
        d = self.downloads.get(number)
        while self.list.count() <= number:
            self.list.addItem("")
        self.list.item(number).setText(d.line())
        self.list.setVisible(True)
        self.list_label.setVisible(True)

    def _on_list_row(self, row: int) -> None:
        if row >= 0:
            self._follow(row)

    def _follow(self, number: int) -> None:
        """The bar, the words and the buttons now speak of download `number`."""
        self.current = number
        if self.list.currentRow() != number:
            self.list.setCurrentRow(number)
        d = self.downloads.get(number)
        self.fetched = d.fetched
        self.open_now.setEnabled(d.state == DONE)
        self.bar.setVisible(d.state in (RUNNING, PAUSED, DONE))
        self.bar.setRange(0, 1000)
        self.bar.setValue(int(1000 * d.fraction))
        self.status.setText(self._words(d))
        self._update_buttons()

    @staticmethod
    def _words(d: Download) -> str:
        if d.state == RUNNING:
            return d.words or f"Downloading {d.quant.label}…"
        if d.state == DONE and d.fetched is not None:
            got = d.fetched
            return (f"Downloaded {got.model.name}" + (f" with {got.projector.name}" if got.projector else "")
                    + f" to {got.model.parent}. Open it now, or later from File → Open model.")
        if d.state == PAUSED:
            return "Paused: Download goes on from where it stopped (also after a restart)."
        if d.state == CANCELLED:
            return "Cancelled: nothing of it is kept."
        return ""

    def _on_download_news(self, number: int) -> None:
        self._show_in_list(number)
        if number == self.current:
            self._follow(number)

    def _on_download_ended(self, number: int) -> None:
        d = self.downloads.get(number)
        if number == self.current:
            if d.state == CANCELLED:
                self.bar.setVisible(False)
            if d.state == FAILED:
                self._say(d.words)

    def _on_failed(self, text: str) -> None:
        self._update_buttons()
        self.status.setText("")
        self._say(text)

    def _on_open(self) -> None:
        if self.fetched is not None:
            self.open_pair.emit(str(self.fetched.model),
                                str(self.fetched.projector) if self.fetched.projector else "")
            self.accept()

