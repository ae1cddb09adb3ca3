"""The window over the real engine (offscreen): loads, answers, stops, closes cleanly."""
from __future__ import annotations

import pytest

pytest.importorskip("PySide6")

from app.window import MainWindow  # noqa: E402
from engine.runtime import GenParams, LoadParams  # noqa: E402


@pytest.fixture
def window(qtbot, model_path):
    w = MainWindow(LoadParams(model_path, n_ctx=1024, n_threads=2))
    qtbot.addWidget(w)
    w.show()
    return w


def test_window_loads_model_and_streams_a_reply(qtbot, window):
    assert window.windowTitle().startswith("Ebb")
    qtbot.waitUntil(window.send_button.isEnabled, timeout=60_000)
    assert "layers" in window.model_label.text()
    window.gen_params = GenParams(temperature=0, max_tokens=32)
    window.composer.setPlainText("What is the capital of France? Answer in one word.")
    window.send_button.click()
    assert window.stop_button.isEnabled()
    qtbot.waitUntil(window.send_button.isEnabled, timeout=60_000)
    text = window.transcript.toPlainText()
    assert "What is the capital of France" in text
    assert "Paris" in text
    assert "tok/s" in text


def test_stop_ends_a_long_reply(qtbot, window):
    qtbot.waitUntil(window.send_button.isEnabled, timeout=60_000)
    window.composer.setPlainText("Count from 1 to 1000, one number per line.")
    window.send_button.click()
    qtbot.waitUntil(lambda: len(window._reply_parts) > 3, timeout=30_000)
    window.stop_button.click()
    qtbot.waitUntil(window.send_button.isEnabled, timeout=30_000)
    assert "cancelled" in window.transcript.toPlainText()


def test_close_during_reply_shuts_down_cleanly(qtbot, window):
    qtbot.waitUntil(window.send_button.isEnabled, timeout=60_000)
    window.composer.setPlainText("Write a very long essay about rivers.")
    window.send_button.click()
    qtbot.waitUntil(lambda: len(window._reply_parts) > 2, timeout=30_000)
    window.close()
    assert window._thread.isFinished()
    assert window._worker._runtime is None
