"""The conversation store (SQLite, WAL) and the model picker's file helpers."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from PIL import Image

from app.core.reply_stats import ReplyStats
from app.dialogs.open_model import estimate
from engine.models.local import find_models, projectors_beside
from app.core.export import export_chat, render
from app.core.settings import Settings
from app.core.store import Store


def test_conversations_messages_images_and_settings(tmp_path):
    s = Store(tmp_path)
    assert s.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    a = s.create_conversation("Rivers")
    b = s.create_conversation("Mountains")
    img = tmp_path / "pic.png"
    Image.new("RGB", (8, 8), (1, 2, 3)).save(img)
    copy = tmp_path / "same.png"
    copy.write_bytes(img.read_bytes())
    s.add_message(a, "user", "look", [img])
    s.add_message(b, "user", "and this", [copy])
    s.add_message(a, "assistant", "a picture", stats=ReplyStats(gen_tokens_per_s=12.5))
    assert len(list(s.images_dir.iterdir())) == 1  # stored once, by content hash
    msgs = s.messages(a)
    assert [m.role for m in msgs] == ["user", "assistant"]
    assert msgs[0].images[0].read_bytes() == img.read_bytes() and msgs[1].stats.gen_tokens_per_s == 12.5
    assert [c.title for c in s.conversations("moun")] == ["Mountains"]
    s.rename(b, "Hills")
    assert s.title(b) == "Hills"
    s.delete(a)
    s.purge_trash(days=0)
    assert len(list(s.images_dir.iterdir())) == 1  # still used by b
    s.delete(b)  # in the trash: out of the list, its picture kept, and it can come back
    assert s.conversations() == [] and len(list(s.images_dir.iterdir())) == 1
    s.restore(b)
    assert [c.id for c in s.conversations()] == [b]
    s.delete(b)
    s.purge_trash(days=0)  # the trash is emptied: its pictures go too, and nothing comes back
    s.restore(b)
    assert list(s.images_dir.iterdir()) == [] and s.conversations() == []
    s.settings.set("rpc", ["127.0.0.1:50052"])
    s.close()
    again = Store(tmp_path)
    assert again.settings.get("rpc") == ["127.0.0.1:50052"] and again.settings.get("missing", 3) == 3
    again.close()


def test_committed_messages_survive_a_crash(tmp_path):
    s = Store(tmp_path)
    cid = s.create_conversation()
    s.add_message(cid, "user", "saved before the reply started")
    # A crash: the process dies without closing; another connection sees the committed rows.
    other = sqlite3.connect(tmp_path / "ebb.sqlite3")
    rows = other.execute("SELECT role, text FROM messages").fetchall()
    assert rows == [("user", "saved before the reply started")]


def test_model_picker_finds_models_and_projectors(tmp_path, model_path, tiny_projector):
    folder = tmp_path / "lmstudio" / "org" / "model"
    folder.mkdir(parents=True)
    (folder / "model-Q4.gguf").symlink_to(model_path)
    (folder / "mmproj-model-f16.gguf").symlink_to(tiny_projector)
    found = find_models([tmp_path / "lmstudio", tmp_path / "nowhere"])
    assert found == [folder / "model-Q4.gguf"]  # projectors are not offered as models
    assert projectors_beside(found[0]) == [folder / "mmproj-model-f16.gguf"]
    text = estimate(found[0], str(folder / "mmproj-model-f16.gguf"), Settings(ctx=2048))
    assert "30 layers" in text and "KV cache" in text and "Projector" in text
    assert "demo projector" in estimate(found[0], "demo", Settings()).lower()


def test_settings_dialog_values_persist_into_the_session_config(qtbot, tmp_path):
    from app.dialogs.settings import SettingsDialog
    from app.core.settings import Settings, session_config

    s = Store(tmp_path)
    dlg = SettingsDialog(Settings(), None)
    qtbot.addWidget(dlg)
    dlg.budget.setText("6GiB")
    dlg.threads.setValue(2)
    dlg.ctx.setValue(2048)
    dlg.flash.setCurrentIndex(dlg.flash.findData(False))
    dlg.vision.setCurrentText("swap")
    dlg.rpc.setText("127.0.0.1:50052")
    for k, v in dlg.values().items():
        s.settings.set(k, v)
    cfg, rpc = session_config(s, "default", "")
    assert (cfg.vram_budget_bytes, cfg.n_threads, cfg.n_ctx) == (6 * 2**30, 2, 2048)
    assert cfg.flash_attn is False and cfg.vision == "swap" and rpc == ["127.0.0.1:50052"]
    dlg.rpc.setText("nonsense")
    dlg._on_ok()
    assert "not an RPC server address" in dlg.error.text() and dlg.result() == 0
    s.close()


def test_app_icon_and_desktop_file_exist():
    from PySide6.QtGui import QIcon

    from app.core.resources import resource_path

    assert not QIcon(str(resource_path("ebb.svg"))).isNull()
    desktop = resource_path("ebb.desktop").read_text()
    assert "Exec=ebb" in desktop and "Name=Ebb" in desktop


def test_model_picker_pairs_by_family_and_marks_text_only(qtbot, tmp_path, model_path):
    """The picker offers the projector beside a model that belongs with it (family and width),
    says why it leaves out the others (another family, an audio projector), and marks a model
    with no projector as text only."""
    import gguf
    import numpy as np

    from app.dialogs.open_model import model_label, projector_offer
    from engine.synth.model_gen import ModelShape, write_model
    from engine.synth.projector_gen import write_projector

    folder = tmp_path / "Qwen2.5-VL"
    folder.mkdir()
    lm = write_model(folder / "Qwen2.5-VL-tiny.gguf", ModelShape(2, 64, 128, 2, 1), model_path,
                     family="qwen2.5vl")
    write_projector(folder / "mmproj-qwen.gguf", 64, family="qwen2.5vl")
    write_projector(folder / "mmproj-gemma.gguf", 64, family="gemma3")
    write_projector(folder / "mmproj-wide.gguf", 128, family="qwen2.5vl")
    w = gguf.GGUFWriter(str(folder / "mmproj-audio.gguf"), arch="clip")  # an audio encoder
    w.add_bool("clip.has_audio_encoder", True)
    w.add_bool("clip.has_vision_encoder", False)
    w.add_string("clip.projector_type", "qwen2a")
    w.add_tensor("a.conv1d.0.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    offered, note = projector_offer(lm)
    assert offered == [str(folder / "mmproj-qwen.gguf")]
    assert "Vision: qwen2.5-vl projector" in note
    assert "mmproj-gemma.gguf (projector mmproj-gemma.gguf (gemma3) and model" in note
    assert "mmproj-wide.gguf (projector mmproj-wide.gguf outputs width 128" in note
    assert "mmproj-audio.gguf (projector mmproj-audio.gguf (qwen2-audio) and model" in note
    text_only = tmp_path / "plain"
    text_only.mkdir()
    (text_only / "SmolLM2.gguf").symlink_to(model_path)
    assert model_label(text_only / "SmolLM2.gguf").endswith("[text only]")
    # name · size · quantisation, then the folder (#43: it was a bare path)
    label = model_label(lm)
    assert label.startswith("Qwen2.5-VL-tiny · 7.83 MiB") and str(folder) in label
    assert "[text only]" not in label
    q = text_only / "SmolLM2-135M-Instruct.Q4_1.gguf"
    q.symlink_to(model_path)
    assert model_label(q).startswith("SmolLM2-135M-Instruct · ") and " · Q4_1   (" in model_label(q)
    # Load is off for a pair the picker refuses, and says why; on for one that belongs
    from app.dialogs.open_model import ModelPicker

    dlg = ModelPicker(Settings())
    qtbot.addWidget(dlg)
    dlg.model_path.setText(str(lm))
    dlg._update_estimate()
    assert dlg.load_button.isEnabled()
    dlg.projector.setEditText(str(folder / "mmproj-gemma.gguf"))
    dlg._update_estimate()
    assert not dlg.load_button.isEnabled() and dlg.estimate.text().startswith("cannot use")
    assert projector_offer(text_only / "SmolLM2.gguf") == ([], "Text only: no projector beside this model.")


def test_a_truncated_database_gives_back_what_sqlite_dump_can_read(tmp_path):
    """#26: a database cut in half (a crash while copying, a full disk) is read the way
    sqlite3's .dump reads it, not given up on its schema."""
    import shutil
    import subprocess

    data = tmp_path / "data"
    s = Store(data)
    for c in range(30):
        cid = s.create_conversation(f"chat {c}")
        for m in range(20):
            s.add_message(cid, "user" if m % 2 == 0 else "assistant", f"message {m} of chat {c} " + "x" * 300)
    s.close()
    db = data / "ebb.sqlite3"
    with open(db, "r+b") as f:
        f.truncate(db.stat().st_size // 2)
    dumped = None
    if shutil.which("sqlite3"):
        out = subprocess.run(["sqlite3", str(db), ".dump"], capture_output=True, text=True).stdout
        dumped = (out.count("INSERT INTO conversations VALUES"), out.count("INSERT INTO messages VALUES"))
    s = Store(data)
    try:
        assert "moved aside" in (s.problem or "")
        n_conv = len(s.conversations())
        n_msg = sum(s.n_messages(c.id) for c in s.conversations())
        assert n_conv > 0 and n_msg > 0, s.problem
        assert f"{n_conv} conversations with {n_msg} messages could be read" in s.problem
        if dumped is not None:  # at least what .dump gives back
            assert n_conv >= dumped[0] and n_msg >= dumped[1], (n_conv, n_msg, dumped)
            print(f"\nfrom a database cut in half: {n_conv} chats, {n_msg} messages; "
                  f"sqlite3 .dump: {dumped[0]}, {dumped[1]}")
    finally:
        s.close()


def test_a_model_is_named_as_people_know_it():
    from app.core.settings import readable_model_name as name

    assert name("/m/SmolLM2-135M-Instruct.Q4_1.gguf", "Smollm2 135M 8k Lc100K Mix1 Ep2") == "SmolLM2-135M-Instruct"
    assert name("Qwen2.5-VL-7B-Instruct-Q4_K_M.gguf") == "Qwen2.5-VL-7B-Instruct"
    assert name("gemma-3-4b-it-IQ4_XS.gguf") == "gemma-3-4b-it"
    assert name("model-F16.gguf") == "model"


def test_search_finds_message_text_with_the_matching_line_and_export(tmp_path):
    """#27: search looks in the messages too (FTS5, kept by triggers through edits and
    deletes) and says which line matched; a chat exports as Markdown and JSON."""
    import json

    s = Store(tmp_path / "data")
    a = s.create_conversation("Weekend plans")
    s.add_message(a, "user", "Where should we go hiking?")
    reply = s.add_message(a, "assistant", "Try the lighthouse trail.\nIt has a view of the bay.")
    b = s.create_conversation("Cooking")
    s.add_message(b, "user", "A recipe for lentil soup, please.")
    found = s.conversations("lighthouse")
    assert [c.id for c in found] == [a] and "lighthouse trail" in found[0].match
    assert [c.id for c in s.conversations("lent")] == [b]  # a word's beginning
    assert [c.id for c in s.conversations("cooking")] == [b]  # titles too
    assert {c.id for c in s.conversations("")} == {a, b}
    s.update_message(reply, "Try the forest path instead.")
    assert s.conversations("lighthouse") == [] and [c.id for c in s.conversations("forest")] == [a]
    s.delete(a)
    assert s.conversations("forest") == []
    md = render(s, b, "md")
    assert md.startswith("# Cooking") and "## You" in md and "lentil soup" in md
    assert json.loads(render(s, b, "json"))["messages"][0]["text"] == "A recipe for lentil soup, please."
    s.close()
    # an older database (no index yet) is indexed when opened
    import sqlite3

    db = sqlite3.connect(tmp_path / "data" / "ebb.sqlite3")
    db.executescript("DROP TRIGGER messages_fts_ai; DROP TRIGGER messages_fts_ad; "
                     "DROP TRIGGER messages_fts_au; DROP TABLE messages_fts; PRAGMA user_version=2;")
    db.close()
    s = Store(tmp_path / "data")
    assert [c.id for c in s.conversations("lentil")] == [b]
    s.close()


def test_a_chat_is_a_tree_migrated_from_lines_searched_trashed_and_exported(tmp_path):
    """#40: a database from before branches opens as lines; versions are siblings; the open
    branch follows the version chosen (to the end last seen below it); search finds an old
    branch's words and names the message; a deleted branch or chat comes back; an export
    carries every branch on request and the pictures beside it."""
    import json

    folder = tmp_path / "data"
    folder.mkdir()
    old = sqlite3.connect(folder / "ebb.sqlite3")  # schema 2, as Ebb wrote it before search
    old.executescript("""
        CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT NOT NULL, created REAL NOT NULL,
            updated REAL NOT NULL);
        CREATE TABLE messages (id INTEGER PRIMARY KEY, conversation_id INTEGER NOT NULL, role TEXT NOT NULL,
            text TEXT NOT NULL, created REAL NOT NULL, stats TEXT, state TEXT NOT NULL DEFAULT 'complete');
        CREATE TABLE attachments (message_id INTEGER NOT NULL, position INTEGER NOT NULL,
            sha256 TEXT NOT NULL, filename TEXT NOT NULL);
        CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO conversations VALUES (1, 'Old', 1, 1), (2, 'Other', 1, 1);
        INSERT INTO messages VALUES (1, 1, 'user', 'u1', 1, '{}', 'complete'),
            (2, 2, 'user', 'elsewhere', 1, '{}', 'complete'),
            (3, 1, 'assistant', 'r1', 1, '{}', 'complete'), (4, 1, 'user', 'u2 zebra', 1, '{}', 'complete'),
            (5, 1, 'assistant', 'r2', 1, '{}', 'interrupted');
        PRAGMA user_version=2;""")
    old.commit()
    old.close()
    s = Store(folder)
    assert [m.text for m in s.messages(1)] == ["u1", "r1", "u2 zebra", "r2"]
    assert [m.parent_id for m in s.messages(1)] == [None, 1, 3, 4] and s.leaf(1) == 5
    assert s.messages(1)[-1].state == "interrupted" and [m.text for m in s.messages(2)] == ["elsewhere"]
    # edit u2: a sibling of it, and the open branch is the new one
    s.end_branch_at(3, 1)
    u2b = s.add_message(1, "user", "u2 giraffe")
    r2b = s.add_message(1, "assistant", "r2b")
    assert [m.text for m in s.messages(1)] == ["u1", "r1", "u2 giraffe", "r2b"]
    assert s.messages(1)[2].siblings == (4, u2b)
    # regenerate r2b twice: three versions, the newest open
    s.end_branch_at(u2b, 1)
    r2c = s.add_message(1, "assistant", "r2c")
    assert s.messages(1)[-1].siblings == (r2b, r2c)
    s.open_branch(4)  # back to the first version of u2: its reply comes with it
    assert [m.text for m in s.messages(1)] == ["u1", "r1", "u2 zebra", "r2"]
    s.open_branch(u2b)  # and forward: to the reply last open there
    assert s.messages(1)[-1].id == r2c
    s.open_branch(r2b)
    s.open_branch(4)
    s.open_branch(u2b)
    assert s.messages(1)[-1].id == r2b
    hit = s.conversations("zebra")  # a word only on a branch that is not open
    assert [c.id for c in hit] == [1] and hit[0].match_id == 4
    # delete a branch: the open one moves to its sibling; undo brings it back
    gone = s.trash_branch(u2b)
    assert sorted(gone) == sorted([u2b, r2b, r2c]) and s.messages(1)[-1].id == 5
    assert s.messages(1)[2].siblings == (4,) and s.conversations("giraffe") == []
    s.restore_branch(gone)
    assert s.messages(1)[2].siblings == (4, u2b) and s.messages(1)[2].id == u2b
    # a deleted chat is gone from the list and search, and comes back
    s.delete(1)
    assert [c.id for c in s.conversations()] == [2] and s.conversations("zebra") == []
    s.restore(1)
    assert {c.id for c in s.conversations()} == {1, 2}
    # the export: the open branch, or all of them, with the model and sampling and pictures
    img = tmp_path / "pic.png"
    Image.new("RGB", (8, 8), (9, 9, 9)).save(img)
    s.add_message(1, "user", "and a picture", [img])
    s.add_message(1, "assistant", "grey", stats=ReplyStats(model="tiny.gguf"))
    (tmp_path / "out").mkdir()
    out = export_chat(s, 1, tmp_path / "out" / "chat.json", every_branch=True,
                      meta={"system_prompt": "Be brief.", "sampling": {"temperature": 0.2}})
    doc = json.loads(out.read_text())
    assert doc["model"] == "tiny.gguf" and doc["sampling"] == {"temperature": 0.2}
    assert [m["text"] for m in doc["messages"]][-2:] == ["and a picture", "grey"]
    assert {m["text"] for b in doc["other_branches"] for m in b} >= {"u2 zebra", "r2", "r2c"}
    pic = doc["messages"][-2]["images"][0]
    assert pic.startswith("chat_files/") and (out.parent / pic).read_bytes() == img.read_bytes()
    md = export_chat(s, 1, tmp_path / "out" / "chat.md").read_text()
    assert "u2 zebra" not in md and "![" in md and "chat_files/" in md and "model: tiny.gguf" in md
    # a video: copied beside, linked (not shown as a picture), with the frames it gave (#53)
    from tests.media_files import write_video

    clip = write_video(tmp_path / "walk.mp4", [((9, 9, 9), 1.0)])
    s.add_message(1, "user", "and a video", [Path(f"{clip}#frames=0,0.5")])
    doc = json.loads(export_chat(s, 1, tmp_path / "out" / "chat.json").read_text())
    [linked] = doc["messages"][-1]["images"]
    assert doc["messages"][-1]["taken"] == {linked: "frames=0,0.5"}
    assert (out.parent / linked).read_bytes() == clip.read_bytes()
    md = export_chat(s, 1, tmp_path / "out" / "chat.md").read_text()
    assert f"[walk.mp4]({linked}) (frames=0,0.5)" in md
    s.close()


def _refused_send(s: Store, cid: int, text: str) -> None:
    """What the window does for a send the engine refuses: the user's message and the reply's
    streaming row are saved, then taken back (`ChatState._take_back`)."""
    user = s.add_message(cid, "user", text)
    reply = s.add_message(cid, "assistant", "", state="streaming")
    s.delete_message(reply)
    s.delete_message(user)


def test_a_refused_send_leaves_the_chat_as_it_was_and_the_next_chat_takes_nothing(tmp_path):
    """The leaf of a chat names only its own messages: a refused send (ids 3 and 4 taken back)
    left chat 1's leaf on id 3, which SQLite gave to chat 2's next message; chat 1 showed
    empty. Now the deleted message takes the leaf with it and chat 1 ends where it did."""
    s = Store(tmp_path)
    first = s.create_conversation()
    s.add_message(first, "user", "Say yes.")
    s.add_message(first, "assistant", "Yes.")
    before = [(m.role, m.text) for m in s.messages(first)]
    _refused_send(s, first, "What is in this clip?")
    assert [(m.role, m.text) for m in s.messages(first)] == before
    second = s.create_conversation()
    s.add_message(second, "user", "Say no.")
    s.add_message(second, "assistant", "No.")
    assert [(m.role, m.text) for m in s.messages(first)] == before
    assert [m.text for m in s.messages(second)] == ["Say no.", "No."]
    # the store itself refuses a leaf from another chat, whoever asks
    import pytest

    from app.core.store import StoreError

    with pytest.raises(StoreError):
        s.end_branch_at(s.leaf(second), first)
    assert [(m.role, m.text) for m in s.messages(first)] == before


def test_a_store_holding_a_foreign_leaf_is_repaired_on_open(tmp_path):
    """A database an earlier Ebb left with chat 1's leaf on chat 2's message: on open, chat 1
    shows its deepest message's branch again."""
    s = Store(tmp_path)
    first = s.create_conversation()
    q = s.add_message(first, "user", "Say yes.")
    s.add_message(first, "assistant", "Yes.")
    s.end_branch_at(q, first)
    s.add_message(first, "assistant", "Yes!")  # a second version of the reply
    deep = s.add_message(first, "user", "Again.")
    second = s.create_conversation()
    other = s.add_message(second, "user", "Say no.")
    s.db.execute("DROP TRIGGER leaf_in_its_own_chat")  # as an older Ebb's store had it
    s.db.execute("UPDATE conversations SET leaf_id=? WHERE id=?", (other, first))
    s.db.commit()
    s.close()
    again = Store(tmp_path)
    assert again.leaf(first) == deep
    assert [m.text for m in again.messages(first)] == ["Say yes.", "Yes!", "Again."]
    assert [m.text for m in again.messages(second)] == ["Say no."]
    again.close()


def test_deleting_the_last_version_of_a_reply_stays_on_the_version_beside_it(tmp_path):
    s = Store(tmp_path)
    cid = s.create_conversation()
    first_q = s.add_message(cid, "user", "One?")
    s.add_message(cid, "assistant", "One.")
    s.end_branch_at(None, cid)
    q = s.add_message(cid, "user", "Two?")  # a second version of the first message
    v1 = s.add_message(cid, "assistant", "v1")
    for text in ("v2", "v3"):
        s.end_branch_at(q, cid)
        s.add_message(cid, "assistant", text)
    s.open_branch(first_q)  # the other user branch was visited last
    s.open_branch(v1)
    v3 = s.messages(cid)[-1].siblings[-1]
    s.open_branch(v3)
    s.trash_branch(v3)
    shown = s.messages(cid)
    assert [m.text for m in shown] == ["Two?", "v2"] and len(shown[-1].siblings) == 2


def test_a_replys_stats_are_typed_and_read_back_from_rows_of_every_age(tmp_path):
    """#55: Message.stats is a ReplyStats; the store keeps its JSON. A row written by an earlier
    version (null figures, a key since dropped, a mistyped value) reads as defaults there."""
    s = Store(tmp_path / "data")
    cid = s.create_conversation("x")
    full = ReplyStats(n_gen_tokens=7, gen_tokens_per_s=3.5, stop_reason="length", model="m.gguf",
                      flash_attn=False, device_notes=("the projector ran on the CPU",), seed=9,
                      seed_fixed=True, memory_from=3, continued=2)
    mid = s.add_message(cid, "assistant", "a", stats=full)
    assert s.message(mid).stats == full
    old = s.add_message(cid, "assistant", "b")
    with s.db:
        s.db.execute("UPDATE messages SET stats=? WHERE id=?", (json.dumps(
            {"n_gen_tokens": None, "prompt_s": 0.25, "stop_reason": "stop", "n_images_encoded": 1,
             "seed": "seven", "flash_attn": None, "n_images": True}), old))
    got = s.message(old).stats
    assert (got.n_gen_tokens, got.prompt_s, got.stop_reason, got.seed, got.flash_attn, got.n_images) == (
        0, 0.25, "stop", None, None, 0)
    assert ReplyStats().empty and not got.empty
    s.close()
