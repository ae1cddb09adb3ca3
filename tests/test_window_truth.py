"""What the window shows is what happened, and nothing a user did is hidden or lost (#51): every
refusal leaves the chat as it was (and the next chat takes none of its messages), each version
of a reply draws its own seed and says so, file dialogs start where the user's files are, and
Tune says at once when there is nothing to tune. The real window over the real engine."""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QUrl

from engine.synth.sounds import write_tone
from tests.helpers import open_window, send, shown_text, wait_for


def _click(w, kind: str, message_id: int) -> None:
    """A message's link in the transcript, as a click sends it."""
    w.transcript.anchorClicked.emit(QUrl(f"msg:{kind}/{message_id}"))


def _looks(w, store, cid: int) -> tuple:
    """A chat as the user sees it and as the store keeps it."""
    return (shown_text(w.transcript), [(m.id, m.role, m.text) for m in store.messages(cid)],
            store.leaf(cid))


def _open_chat(w, cid: int) -> None:
    lst = w.chats.list
    item = next(lst.item(i) for i in range(lst.count()) if lst.item(i).data(256) == cid)
    w.chats.open_item(item)


def test_every_refusal_leaves_the_chat_as_it_was_and_the_next_chat_takes_nothing(
        qtbot, store, tmp_path, base_projector, pictures):
    """The issue's reproduction (a clip sent to a projector that does not hear, then a new chat)
    and the window's other refusal paths: an edit and a regeneration the engine refuses."""
    w = open_window(qtbot, store, mmproj=str(base_projector), vision="cpu")
    first = w.conv_id
    send(qtbot, w, "Say yes.")
    before = _looks(w, store, first)
    clip = write_tone(tmp_path / "voice.wav", 440, 1.0)

    # a new message refused: back in the composer, the chat as it was
    assert w.composer.attach(clip)
    send(qtbot, w, "What is this sound?")
    assert w.composer.error.isVisible() and "What is this sound?" in w.composer.text()
    assert _looks(w, store, first) == before
    w.composer.clear()

    # an edit refused: the old version stays open
    question = store.messages(first)[0]
    _click(w, "edit", question.id)
    assert w.composer.editing is not None
    assert w.composer.attach(clip)
    w.composer.edit.setPlainText("Say it again, and what is this sound?")
    w.sending.send()
    wait_for(lambda: not w.chat.busy)
    assert w.composer.error.isVisible()
    assert _looks(w, store, first) == before
    w.composer.cancel_edit()

    # a regeneration refused (the stored copy of its picture went bad): the reply it had stays
    assert w.composer.attach(pictures["a.png"])
    send(qtbot, w, "What is in this picture?")
    asked = store.messages(first)[-2]
    asked.images[0].write_bytes(b"not a picture any more")
    w.show_conversation()  # the transcript says the picture is missing now
    with_picture = _looks(w, store, first)
    _click(w, "regen", store.messages(first)[-1].id)
    wait_for(lambda: not w.chat.busy)
    assert "Could not regenerate" in w.notices.area.text()
    assert _looks(w, store, first) == with_picture

    # the next chat takes none of the first chat's messages, and the first shows as it was
    w.chats.new_chat()
    send(qtbot, w, "Say no.")
    second = w.conv_id
    assert [m.text for m in store.messages(second)][0] == "Say no."
    _open_chat(w, first)
    assert w.conv_id == first and _looks(w, store, first) == with_picture


def test_each_version_of_a_reply_draws_its_own_seed_unless_the_chat_fixes_one(qtbot, store):
    """At the window's default sampling (temperature 0.7) a regenerated reply is another draw,
    and its stats line says which seed; a seed fixed in Chat settings is used for every version
    and said so."""
    from dataclasses import replace

    from app.core.settings import ChatParams, default_gen_params, set_chat_params

    w = open_window(qtbot, store)
    w.gen_params = replace(default_gen_params(w.settings()), max_tokens=12)  # as a user has it
    assert w.gen_params.temperature > 0 and w.settings().seed == -1
    send(qtbot, w, "Name a fruit.")
    for _ in range(2):
        w.regen_button.click()
        wait_for(lambda: not w.chat.busy)
    versions = [store.message(i) for i in store.messages(w.conv_id)[-1].siblings]
    seeds = [v.stats.seed for v in versions]
    assert len(versions) == 3 and all(isinstance(s, int) for s in seeds), seeds
    assert len(set(seeds)) == 3 and not any(v.stats.seed_fixed for v in versions)
    assert f"seed {seeds[-1]} (new each reply)" in shown_text(w.transcript)

    set_chat_params(store, w.conv_id, ChatParams(temperature=0.7, seed=1234))
    for _ in range(2):
        w.regen_button.click()
        wait_for(lambda: not w.chat.busy)
    last = store.messages(w.conv_id)[-1]
    fixed = [store.message(i).stats for i in last.siblings[-2:]]
    assert [(s.seed, s.seed_fixed) for s in fixed] == [(1234, True)] * 2
    assert "seed 1234 (fixed in Chat settings)" in shown_text(w.transcript)


def test_file_dialogs_start_in_the_users_folders_not_the_working_folder(qtbot, tmp_path,
                                                                         monkeypatch):
    from app.widgets.start_folder import Location, start_file, start_folder

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_DOCUMENTS_DIR", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.chdir(tmp_path)
    assert start_folder() == home  # no Documents folder: home, not the working folder
    (home / "Documents").mkdir()
    (home / "Pictures").mkdir()
    assert start_folder() == home / "Documents"
    assert start_folder(Location.PicturesLocation) == home / "Pictures"
    assert Path(start_file("chat.md")) == home / "Documents" / "chat.md"


def test_tune_without_an_accelerator_says_why_at_once(qtbot, store):
    from app.mainwindow.tuning import NO_ACCELERATOR

    w = open_window(qtbot, store)
    assert w.models.has_accel is False
    w.tune_action.trigger()
    assert NO_ACCELERATOR in w.notices.area.text() and w.tuning.dialog is None
    assert w.notices.area.isVisible() and w.chat.loaded  # the model stays; nothing ran
    # #67: it pointed to the welcome page, gone after the first message; its own button starts one
    assert "welcome page" not in NO_ACCELERATOR
    [notice] = [n for n in w.notices.area.notices() if NO_ACCELERATOR in n.text()]
    assert notice.action_button is not None and notice.action_button.text() == "Start a stand-in…"


def test_a_projector_handed_over_after_a_failed_load_goes_with_the_loaded_model(
        qtbot, store, tmp_path, model_path, tiny_projector):
    """A model that failed to load leaves the one before it loaded: a projector handed over then
    (`ebb mmproj.gguf` from a second start) is paired with that one, not the failed one."""
    from app.main import open_paths

    w = open_window(qtbot, store, max_tokens=8)
    half = tmp_path / "half-of-a-model.gguf"
    half.write_bytes(model_path.read_bytes()[: model_path.stat().st_size // 2])
    w.notices.last_error = ""
    w.models.load(str(half), "")
    wait_for(lambda: bool(w.notices.last_error))
    wait_for(lambda: w.chat.loaded)
    assert "half-of-a-model.gguf" in w.notices.area.text()
    w.notices.last_error = ""
    open_paths(w, [str(tiny_projector)])
    wait_for(lambda: w.chat.loaded and w.models.loaded is not None
             and bool(w.models.loaded.projector))
    assert w.notices.last_error == "" and w.chat.last_cfg is not None
    assert Path(w.chat.last_cfg.model_path) == model_path
    assert Path(w.models.loaded_model) == model_path


def test_notices_are_newest_first_one_per_cause_and_few(qtbot):
    """Three banners left 110 px for the chat: now at most MAX_SHOWN, the newest on top, a
    newer word on the same cause replacing the older, the area capped to a share of the
    window (it scrolls inside)."""
    from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

    from app.widgets.notices import MAX_SHOWN, SHARE_OF_WINDOW, NoticeArea

    top = QWidget()
    area = NoticeArea()
    col = QVBoxLayout(top)
    col.addWidget(area)
    chat = QLabel("the chat")
    col.addWidget(chat, 1)
    top.resize(900, 600)
    qtbot.addWidget(top)
    top.show()
    area.add("Could not load model-a.gguf: it is damaged.", "error")
    area.add("The stand-in accelerator stopped.", "warning")
    area.add("Could not load model-a.gguf: it is damaged.", "error")  # again: one, on top
    assert [n.text() for n in area.notices()] == ["Could not load model-a.gguf: it is damaged.",
                                                  "The stand-in accelerator stopped."]
    area.add("Could not regenerate the reply: the picture is gone.", "error")
    area.add("Could not regenerate the reply: the picture is damaged.", "error")  # same cause
    assert area.notices()[0].text().endswith("damaged.") and len(area.notices()) == 3
    for i in range(5):
        area.add(f"Note {i}: " + "a long line that wraps across the width of the window " * 3)
    assert len(area.notices()) == MAX_SHOWN and area.notices()[0].text().startswith("Note 4")
    wait_for(lambda: area.height() <= 600 * SHARE_OF_WINDOW + 1)
    assert chat.height() >= 600 * (1 - SHARE_OF_WINDOW) - 40
    # one that goes by itself (Undo's) goes, and the others stay
    area.add("Deleted the branch.", "info", ("Undo", lambda: None), timeout_s=0.05)
    assert area.notices()[0].text() == "Deleted the branch."
    wait_for(lambda: "Deleted the branch." not in area.text(), timeout=10_000)
    assert len(area.notices()) == MAX_SHOWN - 1 and area.notices()[0].text().startswith("Note 4")


def test_a_request_waiting_behind_the_windows_reply_counts_it(qtbot, store):
    """The local server's line counts the window's own reply, which goes first: a stream that
    waits behind it reads "1 ahead" (it read "0 ahead")."""
    import http.client
    import json
    import threading

    from engine.llama.sampling import GenParams
    from tests.helpers import free_port

    port = free_port()
    w = open_window(qtbot, store, server=True, server_port=port, server_api_key="k")
    # a reply that outlasts the stream's first keep-alive (1 s) on any CPU: it is stopped
    # below. ("Count from 1 to 300" ends after 121 tokens, under a second on a fast CPU, and
    # the request it kept waiting then never said its place.)
    w.gen_params = GenParams(temperature=0, max_tokens=1500)
    w.composer.edit.setPlainText("List the numbers from 1 to 1000, separated by commas.")
    w.sending.send()
    wait_for(lambda: len(w.chat.reply_parts) > 3, timeout=60_000)
    lines: list[str] = []

    def ask() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Authorization": "Bearer k", "Content-Type": "application/json"})
        r = conn.getresponse()
        try:
            while raw := r.fp.readline():
                line = raw.decode().strip()
                lines.append(line)
                if line.startswith(":"):  # its place in line: enough
                    return
        finally:
            conn.close()

    t = threading.Thread(target=ask)
    t.start()
    wait_for(lambda: not t.is_alive(), timeout=60_000)
    w.stop_button.click()
    wait_for(lambda: not w.chat.busy, timeout=30_000)
    assert next(ln for ln in lines if ln.startswith(":")) == ": waiting in line, 1 ahead", lines


def test_a_continued_reply_closed_mid_stream_keeps_the_whole_replys_counts(qtbot, store):
    """Closing the window (SIGTERM does the same) while a Continue streams: the saved reply's
    stats count the whole reply (the first part's tokens too) and its prompt time. The
    continuation's own share is the window's wait for its first piece when the window ends the
    turn, or the engine's 0 s (a Continue prefills nothing) when the engine's cancelled turn
    reaches the window first: which of the two comes first is the machine's to decide."""
    from engine.llama.sampling import GenParams

    w = open_window(qtbot, store)
    w.gen_params = GenParams(temperature=0, max_tokens=20)
    send(qtbot, w, "Count from 1 to 300, one number per line.")
    first = store.messages(w.conv_id)[-1]
    assert first.stats.n_gen_tokens == 20 and first.stats.prompt_s > 0
    w.gen_params = GenParams(temperature=0, max_tokens=400)
    w.continue_button.click()
    wait_for(lambda: len(w.chat.reply_parts) > 5, timeout=60_000)
    w.close()
    saved = store.messages(w.conv_id)[-1]
    assert saved.id == first.id and saved.stats.stop_reason == "cancelled"
    assert saved.stats.n_gen_tokens > 25, saved.stats  # 20 before, and what came since
    assert saved.stats.prompt_s >= first.stats.prompt_s > 0  # the first part's kept
    assert saved.stats.continued == 1


def test_the_demo_names_the_colour_at_the_windows_default_sampling(qtbot, store, tmp_path):
    """The README's first chat: the demo projector, the window's default sampling (temperature
    0.7, a new seed each reply), a red picture and "What colour is this picture? Answer with one
    word." The chat is given the greedy preset (its own, said in a notice), so the demo names
    the colour every time; a new chat the same."""
    from dataclasses import replace

    from PIL import Image

    from app.core.settings import DEMO_GREEDY_NOTE, chat_params, default_gen_params
    from engine.measure.colour_check import QUESTION

    w = open_window(qtbot, store, mmproj="demo", vision="cpu")
    w.gen_params = replace(default_gen_params(w.settings()), max_tokens=8)
    assert w.gen_params.temperature == 0.7 and w.models.loaded.projector_names_colours
    for colour, rgb in (("red", (220, 20, 30)), ("blue", (20, 30, 220))):
        picture = tmp_path / f"{colour}.png"
        Image.new("RGB", (300, 200), rgb).save(picture)
        w.chats.new_chat()
        assert w.composer.attach(picture)
        send(qtbot, w, QUESTION)
        reply = store.messages(w.conv_id)[-1]
        assert colour in reply.text.lower(), reply.text
        assert chat_params(store, w.conv_id).temperature == 0
        assert DEMO_GREEDY_NOTE in w.notices.area.text()


def test_a_draft_stays_with_its_chat_and_a_refusal_goes_with_what_it_refused(qtbot, store, tmp_path, pictures):
    """#67: a clip refused by the demo projector (it does not hear) leaves the chat's sampling
    as it was (the picture rule is for pictures) and no greedy note; the red line goes once the
    composer is emptied; New chat starts empty and the first chat's draft comes back with it;
    a message over the context's room has Send off, and Enter says why."""
    from app.core.settings import DEMO, DEMO_GREEDY_NOTE

    w = open_window(qtbot, store, mmproj=DEMO, vision="cpu")
    clip = write_tone(tmp_path / "voice.wav", 440, 1.0)
    assert w.composer.attach(clip)
    send(qtbot, w, "What is this sound?")
    first = w.conv_id  # made by the first message
    assert w.composer.error.isVisible()
    assert store.settings.get(f"chat:{first}") is None  # not switched to greedy
    assert DEMO_GREEDY_NOTE not in w.notices.area.text()
    w.composer.detach(clip)
    w.composer.edit.setPlainText("")
    assert not w.composer.error.isVisible()

    w.composer.edit.setPlainText("half a thought")
    assert w.composer.attach(pictures["a.png"])
    w.chats.new_chat()
    assert w.conv_id != first and w.composer.text() == "" and w.composer.attachments == []
    _open_chat(w, first)
    assert w.composer.text() == "half a thought" and w.composer.attachments == [pictures["a.png"]]
    w.composer.clear()

    long = tmp_path / "long.txt"
    long.write_text("word " * 4000)  # ≈5,000 tokens, the context has 1,024
    assert w.composer.attach(long)
    assert w.composer.over_budget and not w.send_button.isEnabled()
    n_before = store.n_messages(first)
    w.composer.edit.setPlainText("Summarise this.")
    w.sending.send()
    assert "too many" in w.composer.error.text() and store.n_messages(first) == n_before
    w.composer.detach(long)
    assert not w.composer.over_budget and w.send_button.isEnabled()
