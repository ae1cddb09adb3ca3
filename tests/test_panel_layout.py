"""The memory panel's layout holds (#27): hovering a step with a long description shows it in
a tooltip and a line cut to the panel's width; neither the panel nor the chat changes width."""
from __future__ import annotations

import time

from PySide6.QtCore import QPointF

from app.core.reply_stats import ReplyStats
from app.core.store import Store
from engine import events
from tests.helpers import open_window


def _layout_pass() -> None:
    """Carry out the layout requests posted so far (an event, not a wait)."""
    from PySide6.QtCore import QCoreApplication, QEvent

    QCoreApplication.sendPostedEvents(None, QEvent.Type.LayoutRequest)
    QCoreApplication.processEvents()


def test_hovering_a_long_span_changes_no_width(qtbot, tmp_path):
    store = Store(tmp_path / "data")
    store.settings.set("ctx", 1024)
    w = open_window(qtbot, store, max_tokens=8, wait="settled")
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
    _layout_pass()  # what the label asks for would show now
    assert long_detail.strip()[:40] in w.panel.span_info.full_text()
    assert w.panel.span_info.toolTip() == w.panel.span_info.full_text()
    assert w.panel.span_info.shown().endswith("…")  # cut to fit
    assert w.centralWidget().width() == chat_width and w.panel.width() == panel_width
    w.close()
    store.close()


def test_sending_shows_the_new_message_and_reply_even_when_scrolled_up(qtbot, tmp_path):
    from tests.helpers import wait_for

    store = Store(tmp_path / "data")
    store.settings.set("ctx", 1024)
    cid = store.create_conversation("A long chat")
    for i in range(30):
        store.add_message(cid, "user", f"Question {i}: " + "words " * 40)
        store.add_message(cid, "assistant", f"Answer {i}: " + "more words " * 40,
                          stats=ReplyStats(stop_reason="stop", n_gen_tokens=40))
    w = open_window(qtbot, store, max_tokens=8, wait="settled")
    w.resize(1024, 700)
    bar = w.transcript.verticalScrollBar()
    wait_for(lambda: bar.maximum() > 0)
    bar.setValue(0)  # the user scrolled up to read
    w.composer.edit.setPlainText("And one more question?")
    w.sending.send()
    wait_for(lambda: not w.chat.busy)
    wait_for(lambda: bar.value() == bar.maximum())
    w.close()
    store.close()


def test_the_chat_keeps_its_width_and_the_layout_is_remembered(qtbot, tmp_path):
    from app.mainwindow.window import CHAT_MIN_WIDTH, MainWindow
    from tests.helpers import track_window

    store = Store(tmp_path / "data")
    w = MainWindow(store, None, [])
    track_window(w)
    qtbot.addWidget(w)
    w.show()
    w.resize(1024, 700)
    w.panel.set_device_names({"RPC0": "stand-in RPC0 " + "with a very long name " * 8})
    w.panel._on_tick()
    _layout_pass()
    chat = w.split.widget(1)
    assert chat.width() >= CHAT_MIN_WIDTH and w.width() <= 1024
    w.split.setSizes([260, chat.width() - 60])
    w.resize(760, 560)  # within the offscreen screen (800x600): restoring clamps to it
    sizes, size = w.split.sizes(), w.size()
    w.close()
    again = MainWindow(store, None, [])
    track_window(again)
    qtbot.addWidget(again)
    again.show()
    assert again.size() == size and again.split.sizes() == sizes
    again.close()
    store.close()


def test_the_panel_follows_the_latest_request_in_steps_with_named_cells(qtbot, tmp_path):
    """#27: memory as steps; the plots show the latest request unless "Whole session"; wheel
    zoom is time only; every residency cell has a tooltip and cells keep their places."""

    store = Store(tmp_path / "data")
    store.settings.set("ctx", 1024)
    w = open_window(qtbot, store, max_tokens=8, wait="settled")
    w.panel.show()
    w.composer.edit.setPlainText("Hi")
    w.sending.send()
    from tests.helpers import wait_for

    wait_for(lambda: not w.chat.busy)
    w.panel._on_tick()
    curve = next(iter(w.panel._curves.values()))
    assert curve.opts["stepMode"] == "left"
    rid, start, end = w.panel.latest_request_range()
    (x0, x1), _ = w.panel.memory_plot.getPlotItem().vb.viewRange()
    assert x0 <= start and end <= x1 and (x1 - x0) < (end - start) * 1.5 + 0.2  # the request fills it
    assert w.panel.timeline.getPlotItem().vb.state["mouseEnabled"] == [True, False]
    w.panel.whole.setChecked(True)
    w.panel._on_tick()
    cells = w.telemetry.cells()
    keys = [c.key for c in cells]
    assert keys[0] == "embd" and keys[1] == "layer 0" and "out" in keys and "proj" in keys
    assert len(set(c.label for c in cells if not c.label.isdigit())) == len([c for c in cells if not c.label.isdigit()])
    rects = w.panel.residency._rects()
    r, cell = rects[1]
    tip = w.panel.residency.tooltip_for(w.panel.residency.cell_at(r.center()))
    assert tip.startswith("layer 0: RAM") and "MiB" in tip
    w.close()
    store.close()


def test_tune_says_its_progress_and_its_marks_do_not_overlap(qtbot):
    from app.dialogs.tune import TuneDialog
    from engine.measure.autotune import planned_runs
    from engine.tune_result import TuneResult

    dlg = TuneDialog()
    qtbot.addWidget(dlg)
    dlg.add_point(0, 120.0, 30.0, {1: 120.0}, {1: 30.0}, max_layers=30)
    assert f"Run 1 of about {planned_runs(30)}" in dlg.status.text() and "s left" in dlg.status.text()
    assert planned_runs(30) < 31 and planned_runs(2) == 3
    result = {"points": [{"layers": 0, "prompt_tps": 120.0, "gen_tps": 30.0},
                         {"layers": 30, "prompt_tps": 300.0, "gen_tps": 45.0}],
              "best_gen_layers": 30, "best_prompt_layers": 30, "cliff_gen_layers": None,
              "cliff_prompt_layers": None, "max_layers": 30, "n_runs": 2, "best_gen_tps": 45.0,
              "best_prompt_tps": 300.0, "best_gen_threads": 1, "best_prompt_threads": 1,
              "threads_searched": [1],
              "flash_attn": {"on": False, "layers": 30, "fill": 2048, "turn_s_on": 1.9,
                             "turn_s_off": 1.2, "reason": "off is 1.58x faster"}}
    dlg.note("Choosing flash attention: 4 more runs")
    assert dlg.status.text().startswith("Choosing flash attention")
    dlg.finish(TuneResult.from_dict(result))
    assert "flash attention off (a turn with 2048 tokens of history: on 1.90 s / off 1.20 s" \
        in dlg.summary.text()
    heights = {m.label.orthoPos for m in dlg._marks if m.value() == 30}
    assert len(heights) == 2  # best and budget at layer 30: labels at two heights
    assert not dlg.gen_plot.getAxis("left").autoSIPrefix


def test_the_model_line_says_where_the_layers_are():
    """#28: the status label's wording is a pure formatter (app/core/status.py)."""
    from app.core.status import loaded_message, model_line
    from engine.events import LoadDetails

    on_accel = LoadDetails(accelerator="RPC0", mover="live", n_layers_on_accel=12,
                           rpc_bytes_sent=3 * 2**20)
    assert model_line("SmolLM2", 30, 4096, on_accel, "RPC0, the stand-in") == (
        "SmolLM2 · 12/30 layers on RPC0, the stand-in · live mover · ctx 4096 · sent 3.0 MiB to "
        "remote devices while loading")
    spread = LoadDetails(accelerator="RPC0", mover="reload", layers_by_device={"RPC0": 10, "RPC1": 20})
    assert "10 on RPC0 + 20 on RPC1 of 30 layers · reload mover" in model_line("m", 30, 512, spread, "x")
    assert model_line("m", 30, 512, LoadDetails(safe_mode=True), "") == (
        "m · all 30 layers in RAM (no accelerator) · ctx 512 · safe mode")
    assert loaded_message(1.234, "", 3.21) == "Model loaded in 1.23s (ready 3.2s after Ebb started)"
    assert loaded_message(0.5, "RAM is short") == "Model loaded in 0.50s — RAM is short"


def test_every_residency_name_is_readable_at_any_width(qtbot):
    """The named cells (embd, out, proj, KV, comp) show their names whole; layer numbers are in
    the cells or, where two digits do not fit, on a scale below whose labels do not overlap."""
    from app.widgets.panel import ResidencyMap
    from engine.telemetry import Telemetry

    tel = Telemetry()
    for n_layers in (8, 30, 80):
        tel.on_event(events.Residency(0, layer_devices=("RPC0",) * 4 + ("CPU",) * (n_layers - 4),
                                      output_device="CPU", embeddings_device="CPU",
                                      projector_device="CPU",
                                      ledger={"RPC0": {"kv": 2**20, "compute": 2**20},
                                              "CPU": {"kv": 2**20}}))
        rmap = ResidencyMap(tel)
        qtbot.addWidget(rmap)
        for width in (300, 480, 900, 1600):
            rmap.resize(width, rmap.minimumHeight())
            rects = rmap._rects()
            labels = [c.label for _, c in rects]
            assert labels[0] == "embd" and labels.count("KV") == 2, labels
            assert rects[-1][0].right() <= width, (n_layers, width)  # nothing past the edge
            assert all(a.right() < b.left() for (a, _), (b, _) in zip(rects, rects[1:]))
            metrics = rmap.fontMetrics()
            if width >= 480:  # named cells are as wide as their names
                for r, c in rects:
                    if not c.key.startswith("layer "):
                        assert metrics.horizontalAdvance(c.label) <= r.width() - 2, (c.label, width)
            step = rmap.layer_scale_step(rects)
            layer = [r for r, c in rects if c.key.startswith("layer ")]
            widest = metrics.horizontalAdvance(str(n_layers - 1))
            if step == 1:
                assert widest <= layer[0].width() - 2
            else:  # scale labels every `step` layers, each narrower than the gap to the next,
                # and no sparser than needed
                assert widest + 4 <= step * (layer[0].width() + 2)
                smaller = rmap.SCALE_STEPS[rmap.SCALE_STEPS.index(step) - 1]
                assert widest + 4 > smaller * (layer[0].width() + 2)
            rmap.grab()  # paints without error


def test_tunes_stop_button_asks_the_runs_to_stop(qtbot):
    """Stop's click reaches the dialog's stop signal (it once raised a TypeError per click and
    the runs went on)."""
    from app.dialogs.tune import TuneDialog

    dlg = TuneDialog()
    qtbot.addWidget(dlg)
    assert not dlg.stop_button.isEnabled()  # until Start
    with qtbot.waitSignal(dlg.start, timeout=5000):
        dlg.start_button.click()
    with qtbot.waitSignal(dlg.stop, timeout=5000):
        dlg.stop_button.click()


def test_the_panel_follows_the_last_turn_after_a_reload_and_through_a_long_reply(qtbot):
    """#43: a reloaded model counts its requests from 1 again: the view is the last run of
    steps (it showed 0-530 s, the swap a sliver); while a reply runs, the view reaches to now."""
    import time

    from app.widgets.panel import MemoryPanel
    from engine import events
    from engine.telemetry import Telemetry

    tel = Telemetry()
    panel = MemoryPanel(tel)
    qtbot.addWidget(panel)
    panel.show()
    t0 = panel._t0
    for rid, start in ((1, -600.0), (2, -580.0), (1, -100.0)):  # the last: after a reload
        for name, a, b in (("prefill", 0.0, 1.0), ("decode", 1.0, 4.0)):
            tel.on_event(events.Span(rid, name=name, start_s=t0 + start + a, end_s=t0 + start + b,
                                     device="CPU"))
    assert panel.latest_request_range() == (1, -100.0, -96.0)
    panel._on_tick()
    (x0, x1), _ = panel.memory_plot.getPlotItem().vb.viewRange()
    assert -101 < x0 < -100 and -96 < x1 < -95
    # a reply sent now runs on with no new steps yet: the view follows it to now
    panel.set_live(True)
    sent = time.monotonic() - t0

    def view() -> tuple[float, float]:
        return tuple(panel.memory_plot.getPlotItem().vb.viewRange()[0])

    # the panel's live timer moves the view on (every LIVE_REDRAW_S) with nothing new to draw
    qtbot.waitUntil(lambda: view()[1] >= sent + 0.6, timeout=10_000)
    x0, _ = view()
    assert sent - 1 < x0 <= sent  # from when it was sent
    panel.set_live(False)
    # nothing polls (#54): an event is drawn once told (poke), and what came while the panel
    # was hidden once it is shown again
    drawn = panel._drawn_version
    tel.on_event(events.Span(3, name="prefill", start_s=t0 + 1, end_s=t0 + 2, device="CPU"))
    panel.poke()
    qtbot.waitUntil(lambda: panel._drawn_version == tel.version != drawn, timeout=10_000)
    panel.hide()
    tel.on_event(events.Span(4, name="prefill", start_s=t0 + 3, end_s=t0 + 4, device="CPU"))
    with qtbot.waitSignal(panel._timer.timeout, timeout=10_000):  # the tick: hidden, not drawn
        panel.poke()
    assert panel._drawn_version != tel.version
    panel.show()
    qtbot.waitUntil(lambda: panel._drawn_version == tel.version, timeout=10_000)
    assert panel.latest_request_range()[0] == 4


def test_a_first_start_on_a_narrow_screen_folds_the_panel_and_it_scrolls_when_shown(qtbot, tmp_path):
    """#43: at 800x600 the Memory dock was cut on the right (cells, legend, titles): a first
    start on such a screen folds it and says how to show it; shown, it scrolls."""
    from PySide6.QtWidgets import QApplication, QScrollArea

    from app.mainwindow.layout import FOLD_PANEL_BELOW
    from app.mainwindow.window import PANEL_MIN_WIDTH, MainWindow
    from tests.helpers import fresh_store, track_window

    screen = QApplication.primaryScreen()
    assert screen is not None and screen.availableGeometry().width() < FOLD_PANEL_BELOW  # offscreen: 800
    store = fresh_store(tmp_path)
    w = track_window(MainWindow(store, None, []))
    qtbot.addWidget(w)
    w.show()
    assert not w.panel_dock.isVisible()
    assert w.notices.area.isVisible() and "View → Memory" in w.notices.area.text()
    w.panel_dock.show()
    assert "View → Memory" not in w.notices.area.text()  # shown: the notice went
    scroll = w.panel_dock.widget()
    assert isinstance(scroll, QScrollArea) and scroll.widget() is w.panel
    qtbot.waitUntil(lambda: w.panel.isVisible())
    assert w.panel.width() >= PANEL_MIN_WIDTH  # its own width, scrolled rather than squeezed
    w.close()
    store.close()


def test_the_panel_is_drawn_before_a_message_can_follow_the_load(qtbot, tmp_path):
    """#54: the panel drew the loaded model within a tenth of a second of the load; a Send
    made at once (typed while the model loaded) paid that first draw, its curves and legend
    made, in the reply's first tokens. Drawn with the load's own event now: whatever the
    window does next (a Send) finds it done."""
    from PySide6.QtCore import QTimer

    from tests.helpers import wait_for

    store = Store(tmp_path / "data")
    w = open_window(qtbot, store, wait="no")
    drawn: list[list[str]] = []

    def on_change() -> None:
        if w.chat.loaded and not drawn:
            QTimer.singleShot(0, lambda: drawn.append(list(w.panel._curves)))

    w.chat.observe(on_change)
    wait_for(lambda: bool(drawn), timeout=120_000)
    assert "weights" in drawn[0], drawn
    w.close()
    store.close()
