"""The memory panel's layout holds (#27): hovering a step with a long description shows it in
a tooltip and a line cut to the panel's width; neither the panel nor the chat changes width."""
from __future__ import annotations

import time

from PySide6.QtCore import QPointF

from app.store import Store
from engine import events
from tests.test_window_failures import _open


def test_hovering_a_long_span_changes_no_width(qtbot, tmp_path):
    store = Store(tmp_path / "data")
    store.set_setting("ctx", 1024)
    w = _open(qtbot, store)
    w.resize(1024, 700)
    qtbot.waitExposed(w)
    now = time.monotonic()
    long_detail = "image " + "3c5bf03e" * 40 + ".png, " + "a very long description " * 10
    w.telemetry.on_event(events.Span(7, name="encode", start_s=now, end_s=now + 0.9,
                                     device="RPC0", bytes=12 * 2**20, predicted_s=0.8,
                                     detail=long_detail))
    w.panel.show()
    w.panel._on_tick()
    chat_width, panel_width = w.centralWidget().width(), w.panel.width()
    vb = w.panel.timeline.getPlotItem().vb
    span = w.telemetry.spans[-1]
    x = (span.start_s + span.end_s) / 2 - w.panel.t0
    from engine.trace import ROWS

    vb.setXRange(x - 1, x + 1, padding=0)
    scene = vb.mapViewToScene(QPointF(x, ROWS.get("encode", 3)))
    w.panel._on_mouse_moved(scene)
    qtbot.wait(50)  # one layout pass: what the label asks for would show now
    assert long_detail.strip()[:40] in w.panel.span_info.full_text()
    assert w.panel.span_info.toolTip() == w.panel.span_info.full_text()
    assert w.panel.span_info.text().endswith("…")  # cut to fit
    assert w.centralWidget().width() == chat_width and w.panel.width() == panel_width
    w.close()
    store.close()


def test_sending_shows_the_new_message_and_reply_even_when_scrolled_up(qtbot, tmp_path):
    from tests.test_app import wait_for

    store = Store(tmp_path / "data")
    store.set_setting("ctx", 1024)
    cid = store.create_conversation("A long chat")
    for i in range(30):
        store.add_message(cid, "user", f"Question {i}: " + "words " * 40)
        store.add_message(cid, "assistant", f"Answer {i}: " + "more words " * 40,
                          stats={"stop_reason": "stop", "n_gen_tokens": 40})
    w = _open(qtbot, store)
    w.resize(1024, 700)
    bar = w.transcript.verticalScrollBar()
    wait_for(lambda: bar.maximum() > 0)
    bar.setValue(0)  # the user scrolled up to read
    w.composer.edit.setPlainText("And one more question?")
    w.send_message()
    wait_for(lambda: not w.chat.busy)
    wait_for(lambda: bar.value() == bar.maximum())
    w.close()
    store.close()


def test_the_chat_keeps_its_width_and_the_layout_is_remembered(qtbot, tmp_path):
    from app.window import CHAT_MIN_WIDTH, MainWindow
    from tests.test_app import _open_windows

    store = Store(tmp_path / "data")
    w = MainWindow(store, None, [])
    _open_windows.append(w)
    qtbot.addWidget(w)
    w.show()
    w.resize(1024, 700)
    w.panel.set_device_names({"RPC0": "stand-in RPC0 " + "with a very long name " * 8})
    w.panel._on_tick()
    qtbot.wait(50)
    chat = w.split.widget(1)
    assert chat.width() >= CHAT_MIN_WIDTH and w.width() <= 1024
    w.split.setSizes([260, chat.width() - 60])
    w.resize(760, 560)  # within the offscreen screen (800x600): restoring clamps to it
    sizes, size = w.split.sizes(), w.size()
    w.close()
    again = MainWindow(store, None, [])
    _open_windows.append(again)
    qtbot.addWidget(again)
    again.show()
    assert again.size() == size and again.split.sizes() == sizes
    again.close()
    store.close()
