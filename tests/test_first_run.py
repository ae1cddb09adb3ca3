"""The first start (#16): a welcome in the chat area, a stand-in accelerator for a machine
without one (a real child `rpc-serve --device-memory`, stopped with the window), and Help →
About with its diagnostics. The real window, the real engine."""
from __future__ import annotations

from PySide6.QtGui import QGuiApplication

from app.core.settings import session_config
from app.core.store import Store
from app.mainwindow.window import MainWindow
from engine.llama.sampling import GenParams
from tests.helpers import track_window, wait_for


def _fresh_window(qtbot, tmp_path):
    store = Store(tmp_path / "data")
    store.settings.set("ctx", 1024)
    store.settings.set("threads", 2)
    cfg, rpc = session_config(store, "default", "")
    w = MainWindow(store, cfg, rpc)
    track_window(w)
    qtbot.addWidget(w)
    w.panel_dock.show()  # as on a wide screen (the offscreen one is 800 px: a first start folds it)
    w.show()
    w.gen_params = GenParams(temperature=0, max_tokens=16)
    wait_for(lambda: w.chat.loaded)
    return w, store


def test_the_first_start_welcomes_and_the_stand_in_shows_the_swap(qtbot, tmp_path, pictures):
    w, store = _fresh_window(qtbot, tmp_path)
    text = w.welcome.text()
    assert w.welcome.isVisible() and "Welcome to Ebb" in text
    assert "synthetic" in text and "Open model" in text and "looked in" in text
    assert "No accelerator here" in text and "standin:start" in text
    w.standin.start("300MiB")
    standin = w.standin.standin
    assert standin is not None, w.statusBar().currentMessage()
    assert standin.endpoint.startswith("127.0.0.1:")
    wait_for(lambda: "stand-in accelerator" in w.model_label.text() and w.chat.loaded,
             timeout=180_000)
    assert "300.00 MiB" in w.model_label.text()
    assert "is running" in w.welcome.text()  # the welcome says so, with its name
    assert w.chat.last_cfg.mmproj_path is not None  # the demo projector, to show the swap
    assert w.composer.attach(pictures["a.png"])
    w.composer.edit.setPlainText("What colour is this picture?")
    w.sending.send()
    assert not w.welcome.isVisible()
    wait_for(lambda: not w.chat.busy, timeout=180_000)
    msgs = store.messages(w.conv_id)
    assert msgs, (w.statusBar().currentMessage(), w.notices.last_error, w.conv_id)
    reply = msgs[-1]
    assert reply.role == "assistant" and reply.stats.strategy == "swap", reply.stats
    assert reply.stats.swap_s > 0
    # the picture's thumbnail opens it full size (#43)
    from PySide6.QtCore import QUrl

    sent_picture = msgs[0].images[0]
    w.transcript._on_anchor(QUrl("view:" + str(sent_picture)))
    viewer = w.picture_viewer
    assert viewer.isVisible() and viewer.label.pixmap().width() == 300  # a.png: 300x200, whole
    viewer.close()
    # the memory panel names the stand-in as one: its plot, its legend and its steps
    (dev, name), = w.panel.device_names.items()
    assert dev.startswith("RPC") and name == f"stand-in {dev}"
    w.panel.show()
    w.panel._on_tick()
    assert f"Memory on stand-in {dev}" in w.panel.memory_plot.plotItem.titleLabel.text
    w.close()
    assert standin.proc.poll() is not None  # the stand-in ended with the window
    assert w.standin.standin is None


def test_about_shows_versions_and_paths_and_copies_diagnostics(qtbot, tmp_path):
    import llama_cpp

    w, store = _fresh_window(qtbot, tmp_path)
    w.notices.last_error = "an example error"
    w.about_action.trigger()
    dlg = w.about_dialog
    shown = dict(dlg_facts for dlg_facts in _facts(dlg))
    assert llama_cpp.__version__ in shown["llama.cpp"] and "CPU" in shown["llama.cpp"]
    assert "Qt" in shown and "Python" in shown
    assert str(tmp_path / "data") in shown["Conversations"]
    dlg.copy_button.click()
    copied = QGuiApplication.clipboard().text()
    assert copied.startswith("Ebb diagnostics") and "Devices at the last load:" in copied
    assert "  CPU (cpu)" in copied and "Last error: an example error" in copied


def _facts(dlg):
    """(label, value) rows as the dialog shows them."""
    import re

    from PySide6.QtWidgets import QLabel

    html = next(lab.text() for lab in dlg.findChildren(QLabel) if "<table>" in lab.text())
    return re.findall(r"<tr><td[^>]*><b>(.*?)</b></td><td>(.*?)</td></tr>", html)


def test_the_menu_and_the_welcome_link_ask_for_the_size_and_cancel_starts_nothing(
        qtbot, tmp_path, monkeypatch):
    from PySide6.QtWidgets import QInputDialog

    from app.core.welcome import STANDIN_LINK

    asked = []
    monkeypatch.setattr(QInputDialog, "getText",
                        staticmethod(lambda *a, **k: (asked.append(k["text"]), ("", False))[1]))
    store = Store(tmp_path / "data")
    w = MainWindow(store, None, [])
    track_window(w)
    qtbot.addWidget(w)
    w.standin.action.trigger()
    w.welcome.linkActivated.emit(STANDIN_LINK)
    assert asked == ["300.00MiB", "300.00MiB"] and w.standin.standin is None


def test_files_opened_with_ebb_are_told_apart(model_path, tiny_projector, pictures, tmp_path):
    """What the desktop entry's `%F` passes: a model, a projector (told apart by what the file
    holds, not its name) and pictures, which wait in the composer."""
    from app.main import parse_args

    renamed = tmp_path / "model-looking-name.gguf"
    renamed.write_bytes(tiny_projector.read_bytes())
    args = parse_args([str(pictures["a.png"]), str(renamed), str(model_path)])
    assert args.model == str(model_path) and args.mmproj == str(renamed)
    assert args.images == [pictures["a.png"]]
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf")
    args = parse_args([str(broken)])  # opened as the model: its load then says what is wrong
    assert args.model == str(broken) and args.mmproj is None
    assert parse_args([]).images == [] and parse_args([]).model is None
