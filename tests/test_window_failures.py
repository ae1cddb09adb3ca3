"""The window's failure surface (#26): every error readable in the window itself and until
closed, one writer per data folder, bad settings, a pair of files that do not belong together,
and SIGTERM. The real window, the real engine, the real store.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from app.core.settings import Settings
from app.core.store import Store
from tests.helpers import N_THREADS, fresh_store, open_window, wait_for, wait_for_line


def test_a_damaged_model_is_said_above_the_chat_and_stays_until_closed(qtbot, tmp_path, model_path):
    half = tmp_path / "half-of-a-model.gguf"
    half.write_bytes(model_path.read_bytes()[: model_path.stat().st_size // 2])
    store = fresh_store(tmp_path)
    w = open_window(qtbot, store, str(half), max_tokens=8, wait="settled")
    assert not w.chat.loaded and not w.send_button.isEnabled()
    assert w.notices.area.isVisible(), "the error must be visible in the window"
    text = w.notices.area.text()
    assert "Could not load half-of-a-model.gguf" in text and "truncated" in text, text
    # the model's line leaves the status line's messages room (it used to fill the bar)
    assert w.model_label.width() <= w.width() // 2 + 1
    w.statusBar().showMessage("a transient message")
    assert w.statusBar().currentMessage() == "a transient message"
    assert store.settings.get("model") is None  # a model that never loaded is not remembered
    notice = w.notices.area.notices()[0]
    assert notice.kind == "error"
    notice.close_button.click()
    assert not w.notices.area.isVisible() and w.notices.area.text() == ""
    w.close()
    store.close()


def test_a_mismatched_projector_says_why_and_the_previous_model_comes_back(
        qtbot, tmp_path, model_path):
    from engine.synth.projector_gen import write_projector

    wrong = write_projector(tmp_path / "mmproj-for-a-wider-model.gguf", 896, size="tiny", seed=3)
    store = fresh_store(tmp_path)
    w = open_window(qtbot, store, max_tokens=8, wait="settled")
    assert w.chat.loaded and store.settings.get("model") == "default"
    label = w.model_label.text()
    w.notices.last_error = ""
    w.models.load(str(model_path), str(wrong))
    wait_for(lambda: bool(w.notices.last_error))
    wait_for(lambda: w.chat.loaded)
    assert "with mmproj-for-a-wider-model.gguf:" in w.notices.area.text()
    assert "again" in w.notices.area.text()  # ... and the previous model is loaded again
    assert w.model_label.text() == label and w.send_button.isEnabled()
    assert store.settings.get("mmproj") == "" and store.settings.get("model") == "default"
    w.composer.edit.setPlainText("Hi")
    w.sending.send()
    wait_for(lambda: not w.chat.busy)
    assert store.messages(w.conv_id)[-1].role == "assistant"
    w.close()
    store.close()


def test_bad_settings_fall_back_with_one_notice_each(qtbot, tmp_path):
    store = fresh_store(tmp_path)
    bad = {"ctx": "lots", "threads": "abc", "vram_budget": "-5GiB", "image_cache": "-1",
           "vision": "turbo", "overflow": "explode", "rpc": "notalist"}
    for k, v in bad.items():
        store.settings.set(k, v)
    w = open_window(qtbot, store, max_tokens=8, wait="settled")
    assert w.chat.loaded, w.notices.last_error
    text = w.notices.area.text()
    for key, value in bad.items():
        assert f"The setting {key} = {value!r} is not valid" in text, key
    assert len(w.notices.area.notices()) == 1  # one notice, a line each
    w.close()
    store.close()


def test_the_model_dialog_reads_files_on_a_pause_and_never_raises(qtbot, tmp_path, model_path):
    from app.dialogs.open_model import ModelPicker

    dlg = ModelPicker(Settings(ctx=1024))
    qtbot.addWidget(dlg)
    for ch in str(model_path):
        dlg.model_path.setText(dlg.model_path.text() + ch)  # typing: nothing read yet
    assert dlg.estimate.text() == "" and dlg._pause.isActive()
    qtbot.waitUntil(lambda: dlg.estimate.text() != "", timeout=10_000)
    assert "layers" in dlg.estimate.text()
    dlg.projector.setEditText(str(tmp_path))  # a folder where a projector should be
    qtbot.waitUntil(lambda: "cannot" in dlg.estimate.text(), timeout=10_000)


def _window_process(data: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    full = dict(os.environ, QT_QPA_PLATFORM="offscreen", EBB_DATA_DIR=str(data), **env)
    return subprocess.Popen([sys.executable, "-m", "app", "--threads", str(N_THREADS), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full)


def test_one_window_per_data_folder_and_sigterm_saves_and_exits_0(tmp_path, pictures):

    data = tmp_path / "data"
    s = Store(data)
    s.settings.set("ctx", 1024)
    s.settings.set("max_tokens", 0)
    s.close()
    first = _window_process(data, EBB_TEST_SEND="Write a long story about a lighthouse keeper.")
    try:
        wait_for_line(first.stdout, "streaming")
        second = subprocess.run([sys.executable, "-m", "app", str(pictures["a.png"])],
                                capture_output=True, text=True, timeout=120,
                                env=dict(os.environ, QT_QPA_PLATFORM="offscreen", EBB_DATA_DIR=str(data)))
        assert second.returncode == 0, second.stderr
        assert "already running" in second.stdout and "brought to the front" in second.stdout
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 0
    finally:
        if first.poll() is None:
            first.kill()
    store = Store(data)
    (conv,) = store.conversations()
    msgs = store.messages(conv.id)
    assert [m.role for m in msgs] == ["user", "assistant"]
    reply = msgs[-1]
    assert reply.text.strip() and reply.stats.stop_reason == "cancelled", reply.stats
    assert reply.stats.n_gen_tokens > 0 and reply.stats.gen_tokens_per_s > 0  # #43
    assert not store.recovered  # it was saved as stopped, not found "streaming" later
    store.close()
    # and with the first window gone, the folder is free again: a start opens it
    again = _window_process(data, EBB_QUIT_WHEN_SHOWN="1")
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0 and "shown" in out, err


def test_sighup_saves_and_closes_as_sigterm_does(tmp_path):
    """#51: the terminal that started Ebb closed (SIGHUP) ended the window with nothing saved
    or logged; now it is a close like SIGTERM's: the reply so far is saved, exit code 0."""
    data = tmp_path / "data"
    s = Store(data)
    s.settings.set("ctx", 1024)
    s.close()
    proc = _window_process(data, EBB_TEST_SEND="Write a long story about a lighthouse keeper.")
    try:
        wait_for_line(proc.stdout, "streaming")
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "asked to stop (SIGHUP)" in (proc.stderr.read() if proc.stderr else "")
    store = Store(data)
    (conv,) = store.conversations()
    reply = store.messages(conv.id)[-1]
    assert reply.role == "assistant" and reply.text.strip()
    assert reply.stats.stop_reason == "cancelled" and not store.recovered
    store.close()


def test_a_huge_paste_is_refused_from_its_size_and_kept_in_the_composer(qtbot, tmp_path):
    store = fresh_store(tmp_path)
    w = open_window(qtbot, store, max_tokens=8, wait="settled")
    huge = "All work and no play makes Jack a dull boy. " * 120_000  # 5.3 MB
    w.composer.edit.setPlainText(huge)
    w.sending.send()
    assert not w.chat.busy  # nothing went to the engine
    assert w.composer.error.isVisible() and "MiB" in w.composer.error.text()
    assert "context (1024 tokens)" in w.composer.error.text()
    assert w.composer.text() == huge.strip() or w.composer.edit.toPlainText() == huge
    assert store.n_messages(w.conv_id) == 0 and store.title(w.conv_id) == "New chat"
    # pasted, it is refused at once too (laying 5 MB out froze the window for seconds)
    from PySide6.QtCore import QMimeData

    w.composer.edit.clear()
    w.composer.error.hide()
    mime = QMimeData()
    mime.setText(huge)
    w.composer.edit.insertFromMimeData(mime)
    assert w.composer.edit.toPlainText() == ""
    assert w.composer.error.isVisible() and "Not pasted" in w.composer.error.text()
    mime.setText("a paste that fits")
    w.composer.edit.insertFromMimeData(mime)
    assert w.composer.edit.toPlainText() == "a paste that fits"
    # a later message that is sent clears the stale error
    w.composer.edit.setPlainText("Hi")
    w.sending.send()
    assert not w.composer.error.isVisible()
    wait_for(lambda: not w.chat.busy)
    w.close()
    store.close()


def test_settings_reload_the_model_only_when_a_setting_needs_it(qtbot, tmp_path):
    from app.core.settings import reload_changes

    store = fresh_store(tmp_path)
    w = open_window(qtbot, store, max_tokens=8, wait="settled")
    before = w.settings()
    assert reload_changes(before, replace(before, max_tokens=64, server_port=9000)) == ""
    assert reload_changes(before, replace(before, ctx=2048)) == "ctx 1024 → 2048"
    loads = []
    w.request_load.connect(lambda cfg, rpc: loads.append(cfg))
    from app.dialogs.settings import SettingsDialog

    SettingsDialog.exec = lambda self: (self.max_tokens.setValue(64), 1)[1]  # only the reply cap
    try:
        w.models.edit_settings()
    finally:
        del SettingsDialog.exec
    assert loads == [] and w.gen_params.max_tokens == 64
    assert "no reload needed" in w.statusBar().currentMessage()
    w.close()
    store.close()


def test_open_model_lists_ebbs_own_cache(qtbot, model_path):
    from app.dialogs.open_model import ModelPicker

    dlg = ModelPicker(Settings(ctx=1024))
    qtbot.addWidget(dlg)
    listed = [dlg.list.item(i).data(0x0100) for i in range(dlg.list.count())]
    assert any(str(p).endswith(model_path.name) for p in listed), listed


def test_search_shows_the_matching_line_delete_undoes_and_export_writes(qtbot, tmp_path):
    store = fresh_store(tmp_path)
    cid = store.create_conversation("Trip")
    store.add_message(cid, "user", "Which trail has the lighthouse?")
    w = open_window(qtbot, store, max_tokens=8, wait="settled")
    w.chats.search.setText("lighthouse")
    item = w.chats.list.item(0)
    assert w.chats.list.count() == 1 and "Which trail has the lighthouse?" in item.text()
    w.chats.search.setText("")
    assert w.chats.delete_chat(cid) and store.conversations() != [] and cid not in [
        c.id for c in store.conversations()]
    undo = [n for n in w.notices.area.notices() if "Deleted “Trip”" in n.text()]
    assert undo and undo[0].action_button is not None
    undo[0].action_button.click()  # Undo: the chat is back, and open
    assert cid in [c.id for c in store.conversations()] and w.conv_id == cid
    assert "lighthouse" in w.transcript.toPlainText()
    out = w.chats.export_chat(cid, str(tmp_path / "trip.md"))
    assert out is not None and "lighthouse" in out.read_text()
    w.close()
    store.close()


def test_a_chat_has_its_own_system_prompt_and_sampling(qtbot, tmp_path):
    """#27: per chat, with Settings' as the default: the engine gets the chat's system prompt
    and each reply its sampling (greedy here, so the reply is the one greedy gives)."""
    from app.core.settings import ChatParams, chat_params, set_chat_params

    store = fresh_store(tmp_path)
    w = open_window(qtbot, store, max_tokens=8, wait="settled")
    assert chat_params(store, w.conv_id).temperature == 0.7  # Settings' default
    set_chat_params(store, w.conv_id, ChatParams("You are a pirate.", temperature=0.0, top_p=0.9,
                                                 repeat_penalty=1.1, seed=7, top_k=12, min_p=0.2,
                                                 json_replies=True))
    w.sending.send_history()
    w.show_conversation()  # as Chat settings' OK does
    sent = []
    w.request_send.connect(lambda rid, text, images, gp: sent.append(gp))
    w.composer.edit.setPlainText("Who are you?")
    w.sending.send()
    wait_for(lambda: not w.chat.busy)
    (gp,) = sent
    assert (gp.temperature, gp.top_p, gp.repeat_penalty, gp.seed) == (0.0, 0.9, 1.1, 7)
    assert (gp.top_k, gp.min_p) == (12, 0.2)
    assert w.worker._session.cfg.system == "You are a pirate."
    reply = store.messages(w.conv_id)[-1]
    assert reply.role == "assistant" and gp.grammar and reply.text.lstrip().startswith("{")
    # the chat says it has its own system prompt, above its first message (#43)
    assert w.transcript.toPlainText().startswith("System prompt: You are a pirate. · change")
    # another chat has Settings' (no system prompt)
    w.chats.new_chat()
    wait_for(lambda: w.worker._session.cfg.system is None)
    assert w.sending.chat_gen_params() == w.gen_params
    w.close()
    store.close()


def test_a_huge_word_is_laid_out_at_once_and_a_deleted_picture_is_named(qtbot, tmp_path, pictures):
    """#43: a 200,000-character word pasted (small in bytes) no longer freezes the window for
    seconds: the composer breaks it anywhere, the transcript shows a long run cut with what is
    left out; a picture deleted after it was attached is named and taken off, the rest kept."""
    import shutil

    from PySide6.QtCore import QMimeData
    from PySide6.QtGui import QTextOption

    from app.widgets.transcript import LONG_RUN, shorten_long_runs

    store = fresh_store(tmp_path)
    w = open_window(qtbot, store, max_tokens=4, wait="settled", ctx=8192)  # 200 KB may be pasted
    mime = QMimeData()
    mime.setText("x" * 200_000)
    w.composer.edit.insertFromMimeData(mime)
    assert w.composer.edit.wordWrapMode() == QTextOption.WrapMode.WrapAnywhere
    assert len(w.composer.edit.toPlainText()) == 200_000
    shown = shorten_long_runs("see: " + "y" * 5000 + " end")
    assert shown == "see: " + "y" * LONG_RUN + "… [3,000 more characters not shown] end"
    w.composer.clear()
    assert w.composer.edit.wordWrapMode() != QTextOption.WrapMode.WrapAnywhere
    # an attachment deleted before Send
    gone, kept = tmp_path / "gone.png", tmp_path / "kept.png"
    shutil.copy(pictures["a.png"], gone)
    shutil.copy(pictures["a.png"], kept)
    w.composer.edit.setPlainText("What are these?")
    assert w.composer.attach(gone) and w.composer.attach(kept)
    gone.unlink()
    w.sending.send()
    assert not w.chat.busy and store.n_messages(w.conv_id) == 0
    assert w.composer.error.isVisible() and "gone.png is gone" in w.composer.error.text()
    assert w.composer.attachments == [kept] and w.composer.text() == "What are these?"
    # several bad files dropped at once: each one's reason, one line each; the good one attached
    from PySide6.QtCore import QUrl

    empty, text = tmp_path / "empty.png", tmp_path / "notes.png"
    empty.write_bytes(b"")
    text.write_text("not a picture")
    drop = QMimeData()
    drop.setUrls([QUrl.fromLocalFile(str(p)) for p in (empty, text, pictures["b.jpg"])])
    w.composer.edit.insertFromMimeData(drop)
    lines = w.composer.error.text().splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["empty.png", "notes.png"], lines
    assert "empty" in lines[0] and "not an image" in lines[1]
    assert w.composer.attachments == [kept, pictures["b.jpg"]]
    w.close()
    store.close()


def test_a_full_disk_at_the_first_start_still_takes_the_lock(tmp_path):
    """#43: with no ebb.lock yet on a full disk, writing the holder's pid failed with ENOSPC and
    the start ended in a traceback with no window; the lock holds without it now (the window
    then says the folder cannot be written). A real full filesystem: a 64 KiB tmpfs, filled."""
    from app.single_instance import FolderLock

    full = tmp_path / "full"
    full.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)],
                      capture_output=True).returncode != 0:
        import pytest

        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        (full / "data").mkdir()
        with open(full / "fill", "wb") as f:
            try:
                f.write(b"\0" * 128 * 1024)
            except OSError:
                pass  # full now
        lock = FolderLock(full / "data")
        assert lock.acquire()
        assert not FolderLock(full / "data").acquire()  # held: a second start is turned away
        lock.release()
    finally:
        subprocess.run(["umount", "-l", str(full)], capture_output=True)  # even if a file is open


def test_when_the_last_model_is_gone_the_default_opens_and_says_why(tmp_path):
    """#43: the remembered model was deleted: the window opens the default model (not "no
    model") and says which file is gone and how to choose another."""
    data = tmp_path / "data"
    s = Store(data)
    s.settings.set("ctx", 1024)
    s.settings.set("model", str(tmp_path / "models" / "Gone-7B.Q4_K_M.gguf"))
    s.settings.set("mmproj", "")
    s.close()
    proc = _window_process(data, EBB_TEST_PRINT_NOTICE="1")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "The last model, Gone-7B.Q4_K_M.gguf, is gone" in out and "default model" in out, out


def test_chat_settings_have_named_presets(qtbot):
    """#43: built-in presets set the sampling; one saved by name (with its system prompt)
    comes back in a later dialog; a built-in name is not taken over."""
    from app.dialogs.chat_settings import ChatSettingsDialog
    from app.core.settings import ChatParams

    kept: list[dict] = []
    dlg = ChatSettingsDialog("t", ChatParams(), presets={}, save_presets=kept.append)
    qtbot.addWidget(dlg)
    dlg.preset.setCurrentText("Precise")
    dlg._on_preset(dlg.preset.currentIndex())
    assert dlg.values().temperature == 0.2 and dlg.values().repeat_penalty == 1.05
    dlg.system.setPlainText("You are a pirate.")
    assert dlg.save_named("Pirate") and not dlg.save_named("Balanced")
    assert kept[-1]["Pirate"]["system_prompt"] == "You are a pirate."
    again = ChatSettingsDialog("t", ChatParams(), presets=kept[-1])
    qtbot.addWidget(again)
    again.preset.setCurrentText("Pirate")
    again._on_preset(again.preset.currentIndex())
    assert again.values().system_prompt == "You are a pirate." and again.values().temperature == 0.2


def test_the_safe_mode_banner_sits_under_the_notices_until_a_button_closes_it(qtbot, tmp_path, monkeypatch):
    """app/main.py puts it there after a crash or while safe mode is on (Notices.add_banner)."""
    from app import safe_mode
    from app.mainwindow.window import MainWindow
    from engine.llama import native
    from tests.helpers import track_window

    monkeypatch.setattr(native, "safe_mode_reason", lambda: "set in Settings")
    store = fresh_store(tmp_path)
    w = track_window(MainWindow(store, None, []))
    qtbot.addWidget(w)
    w.show()
    w.notices.say("A note before it.")
    banner = safe_mode.safe_mode_banner(store)
    w.notices.add_banner(banner)
    column = w.notices.area.parentWidget().layout()
    assert column.indexOf(banner) == column.indexOf(w.notices.area) + 1
    qtbot.waitUntil(banner.isVisible)
    assert "Safe mode is on (set in Settings)" in banner.label.text()
    w.grab().save(str(tmp_path / "banner.png"))
    banner.buttons["Leave safe mode at the next start"].click()
    assert store.settings.get(safe_mode.SAFE_MODE_SETTING) is False
    qtbot.waitUntil(lambda: not banner.isVisible())
    w.close()
    store.close()
