"""A conversation reopens as it was left: the model's memory (KV state) and the encoded pictures
kept on disk, through the real model and projector. Greedy, the reply after a reopen equals the
reply of a session that never left; a damaged or foreign state file is passed over.

How each reply is held against its reference (tests/helpers.py): a restored state is the
never-left session's own cells, and both evaluate the same new tokens (SAME PATH); a reopen on
another device is DECIDED; a state passed over evaluates the history in one batch, as a fresh
session's reference does (the same path, compared DECIDED: see that test)."""
from __future__ import annotations

import pytest

import json
import struct
import sys
import threading
from dataclasses import replace
from pathlib import Path

from engine.config import SessionConfig
from engine.llama.sampling import GenParams
from engine.llama.state_files import MAGIC, SUFFIX, StateFiles, trim_folder
from engine.session import Session
from tests.helpers import N_THREADS, agree_where_decided

GP = GenParams(temperature=0, max_tokens=12)
QUESTIONS = ("Name a fruit.", "Tell me about zebras in three sentences.", "Name a city.")


def _cfg(model_path: Path, states: Path, projector: Path | None = None, **kw) -> SessionConfig:
    return SessionConfig(model_path, projector, n_ctx=1024, n_threads=N_THREADS, accel="CPU",
                         vision="cpu", flash_attn=True, state_dir=states, **kw)


def _chat(s: Session, questions, images=()) -> list[tuple[str, str, list[str]]]:
    """Ask each question (the first with `images`); the history as the window keeps it."""
    hist: list[tuple[str, str, list[str]]] = []
    for i, q in enumerate(questions):
        pics = [str(p) for p in images] if i == 0 else []
        r = s.turn(q, pics, gp=GP)
        hist += [("user", q, pics), ("assistant", r.text, [])]
    return hist


def _open_under(folder: Path) -> list[str]:
    """The files under `folder` this process holds open (Linux; elsewhere none are seen)."""
    import os

    found = []
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(folder)):
            found.append(target)
    return found


@pytest.mark.numerics
def test_a_chat_reopened_after_a_restart_evaluates_only_what_is_new(model_path, tiny_projector,
                                                                    pictures, tmp_path):
    """SAME PATH: the reopened session takes back the never-left session's own cells (the same
    bytes, from disk) and evaluates the same new question after them."""
    states = tmp_path / "states"
    pic = [pictures["a.png"]]
    # two exchanges (one with a picture); the window closes there: the memory of the chat is
    # kept on disk. Had it stayed open, the next question would have been answered so:
    with Session(_cfg(model_path, states, tiny_projector)) as s:
        s.set_history([], tag="7")  # a new chat, as the window opens it
        hist = _chat(s, QUESTIONS[:2], pic)
        assert s.persist()
        s.model.snapshots.disk.flush()
        never = s.turn(QUESTIONS[2], gp=GP)
    assert len(list(states.glob("7-*" + SUFFIX))) == 1
    assert list((states / "pictures").iterdir())  # the picture's embeddings

    # a new process opens the chat and asks the same: restored, the picture not encoded again,
    # the same reply
    with Session(_cfg(model_path, states, tiny_projector)) as s:
        s.set_history(hist, tag="7")
        # taken back as the chat opens, before the question is typed (#54); another chat
        # opened first stops it with the cache as it was; once taken, it is not read again
        stop = threading.Event()
        stop.set()
        assert s.take_up(stop) == 0 and s.model.runtime.slot.n_positions() == 0
        taken = s.take_up()
        assert taken > 0 and s.take_up() == 0 and s.model.runtime.slot.n_positions() == taken
        assert not _open_under(states), "a state taken back holds no file open (it was mapped)"
        again = s.turn(QUESTIONS[2], gp=GP)
        assert again.text == never.text, (again.text, never.text)
        assert again.n_image_chunks_encoded == 0 and s.encoder.disk.n_loaded > 0
        # only what the never-left session evaluated: the new question
        assert again.gen.n_prompt_tokens_restored > 0 and again.gen.restored_ahead
        assert again.gen.n_prompt_tokens_evaluated == never.gen.n_prompt_tokens_evaluated, again.gen
        # deleting the chat deletes its states
        assert s.forget("7") >= 1
    assert not list(states.glob("7-*" + SUFFIX))


@pytest.mark.numerics
def test_restored_after_an_overflow_on_another_device_and_after_a_stop(model_path, tmp_path,
                                                                        shared_rpc_server):
    """The context overflowed and dropped turns before the chat was left; it is taken up with
    its layers on another device (the stand-in accelerator); a first try is stopped while the
    state is read. The reply is the never-left session's where decided (the layers compute on
    another device: DECIDED)."""
    import threading

    states = tmp_path / "states"
    gp = replace(GP, max_tokens=40, top_logprobs=2)
    qs = [f"Tell me a fact about topic number {i}, such as rivers, owls or bread, in detail."
          for i in range(7)]
    cfg = replace(_cfg(model_path, states), n_ctx=384)
    with Session(cfg) as s:
        s.set_history([], tag="5")
        hist: list[tuple[str, str, list[str]]] = []
        dropped = 0
        for q in qs[:6]:
            r = s.turn(q, gp=gp)
            dropped += r.n_turns_dropped
            hist += [("user", q, []), ("assistant", r.text, [])]
        assert dropped > 0  # the oldest turns left the model's memory
        assert s.persist()
        s.model.snapshots.disk.flush()
        never = s.turn(qs[6], gp=gp)
    with Session(replace(cfg, accel=None, rpc=(shared_rpc_server.endpoint,))) as s:
        assert s.model.placement.n_gpu_layers > 0  # on the stand-in now
        s.set_history(hist, tag="5")
        stop = threading.Event()
        stop.set()  # Stop, as the state is about to be read
        assert s.turn(qs[6], gp=gp, cancel=stop).gen.stop_reason == "cancelled"
        s.set_history(hist, tag="5")
        again = s.turn(qs[6], gp=gp)
        assert again.gen.logprobs and never.gen.logprobs
        agree_where_decided(again.gen.logprobs, never.gen.logprobs)
        assert again.gen.n_prompt_tokens_evaluated == never.gen.n_prompt_tokens_evaluated
        assert again.gen.n_prompt_tokens_restored > 0


@pytest.mark.numerics
def test_a_damaged_or_foreign_state_is_passed_over(model_path, tmp_path):
    """DECIDED: the reference is a fresh session with no states that evaluates the same
    history in one batch, as a session that passes a bad state over does (the session that
    generated the history went token by token: another path, #51). The paths should agree to
    the bit, but CI once saw the flipped byte's reply part from the reference at a close step
    (3 threads on 2 cores, stop 74; not seen here in 16 runs under load), so the replies are
    compared where decided: what this test proves is that a bad state is passed over (nothing
    restored, every prompt token evaluated, a damaged file removed)."""
    gp = replace(GP, top_logprobs=2)
    states = tmp_path / "states"
    with Session(_cfg(model_path, states)) as s:
        s.set_history([], tag="3")
        hist = _chat(s, QUESTIONS[:2])
        assert s.persist()
        s.model.snapshots.disk.flush()
    with Session(_cfg(model_path, tmp_path / "no-states")) as s:
        s.set_history(hist, tag="3")
        ref = s.turn(QUESTIONS[2], gp=gp)
        assert ref.gen.n_prompt_tokens_restored == 0
    (kept,) = states.glob("3-*" + SUFFIX)
    raw = kept.read_bytes()
    n = struct.unpack("<Q", raw[len(MAGIC):len(MAGIC) + 8])[0]
    head = json.loads(raw[len(MAGIC) + 8:len(MAGIC) + 8 + n])
    # a flipped byte in the state, a file cut short, another model's identity, not a state
    flipped = bytearray(raw)
    flipped[-100] ^= 0xFF
    foreign = dict(head, identity=dict(head["identity"], model="another"))
    fh = json.dumps(foreign).encode()
    for name, data in (("3-flipped", bytes(flipped)), ("3-short", raw[:len(raw) // 2]),
                       ("3-foreign", MAGIC + struct.pack("<Q", len(fh)) + fh + raw[len(MAGIC) + 8 + n:]),
                       ("3-junk", b"not a state at all")):
        kept.unlink(missing_ok=True)
        for p in states.glob("*" + SUFFIX):
            p.unlink()
        (states / (name + SUFFIX)).write_bytes(data)
        with Session(_cfg(model_path, states)) as s:
            s.set_history(hist, tag="3")
            r = s.turn(QUESTIONS[2], gp=gp)  # evaluated again as if nothing were kept
            assert r.gen.n_prompt_tokens_restored == 0, name
            assert r.gen.n_prompt_tokens_evaluated == r.gen.n_prompt_tokens, name
            agree_where_decided(r.gen.logprobs, ref.gen.logprobs)
        # a damaged file is removed; another model's is left for that model
        assert (states / (name + SUFFIX)).exists() == (name == "3-foreign"), name


def test_the_folder_keeps_its_budget_least_recently_used_first(tmp_path):
    files = StateFiles(tmp_path, {"model": "m"}, budget_bytes=10_000)
    for i in range(5):
        files.save((bytes(3000), list(range(100 * i, 100 * i + 20)), list(range(20)), 20), f"c{i}")
        files.flush()
    kept = sorted(e.tag for e in files.entries())
    assert files.nbytes <= 10_000 and "c4" in kept and "c0" not in kept, kept
    # a prefix of a newer state of the same cells is of no more use
    files.save((bytes(1000), list(range(400, 440)), list(range(40)), 40), "c4")
    files.flush()
    assert [len(e.keys) for e in files.entries() if e.tag == "c4"] == [40]
    assert trim_folder(tmp_path, 0) and not list(tmp_path.glob("*" + SUFFIX))
    files.close()


def test_the_window_takes_a_chat_back_from_its_kept_memory(qtbot, tmp_path):
    from PySide6.QtCore import Qt

    from app.core.store import Store
    from tests.helpers import fresh_store, open_window, send, wait_for

    def open_chat(w, cid):
        items = [w.chats.list.item(i) for i in range(w.chats.list.count())]
        w.chats.open_item(next(i for i in items if i.data(Qt.ItemDataRole.UserRole) == cid))

    store = fresh_store(tmp_path)
    states = tmp_path / "data" / "states"
    w = open_window(qtbot, store, max_tokens=12)
    for q in QUESTIONS[:2]:
        send(qtbot, w, q)
    cid = w.conv_id
    # another chat, then back: the first one's memory comes back instead of being evaluated
    w.chats.new_chat()
    send(qtbot, w, "Hello.")
    open_chat(w, cid)
    send(qtbot, w, QUESTIONS[2])
    stats = store.messages(cid)[-1].stats
    assert stats.n_prompt_tokens_restored > 0
    assert stats.n_prompt_tokens_evaluated < stats.n_prompt_tokens_restored  # the new question
    assert "Memory of this chat restored when the chat was opened" in w.statusBar().currentMessage()
    w.close()  # the open chat's memory goes to disk
    assert list(states.glob(f"chat{cid}-*" + SUFFIX))
    store.close()

    # after a restart: the chat opens as it was left and its memory is read from disk
    store = Store(tmp_path / "data")
    w = open_window(qtbot, store, max_tokens=12)
    assert w.conv_id == cid
    send(qtbot, w, "Name a colour.")
    stats = store.messages(cid)[-1].stats
    # taken back from disk as the window opened on the chat, before the question (#54)
    assert stats.n_prompt_tokens_restored > 0, stats
    assert "Memory of this chat restored when the chat was opened" in w.statusBar().currentMessage()
    # deleting the chat deletes its memory
    w.chats.delete_chat(cid)
    wait_for(lambda: not list(states.glob(f"chat{cid}-*" + SUFFIX)))
    store.close()


def test_kept_bytes_are_checked_piece_by_piece_and_old_files_still_read(tmp_path):
    """A state's bytes are hashed in pieces (XXH3), each on a pool thread while the next is
    read (#54); files written before, with each piece's sha256 or one sha256 of the whole, read
    back the same way."""
    import hashlib
    import io
    import os

    from engine.kept_files import HASH_CHUNK, digests, read_checked, read_header, write_atomically

    data = os.urandom(2 * HASH_CHUNK + 12345)
    path = tmp_path / "kept"
    assert write_atomically(path, MAGIC, {"tag": "x", **digests(data)}, data)
    with open(path, "rb") as f:
        head = read_header(f, MAGIC, 1 << 20)
        assert len(head["xxh3_chunks"]) == 3 and read_checked(f, head) == data
    raw = bytearray(path.read_bytes())
    raw[-HASH_CHUNK - 20] ^= 1  # a flipped bit in the middle piece
    f = io.BytesIO(bytes(raw))
    with pytest.raises(ValueError):
        read_checked(f, read_header(f, MAGIC, 1 << 20))
    pieces = [data[i:i + HASH_CHUNK] for i in range(0, len(data), HASH_CHUNK)]
    by_piece = {"nbytes": len(data), "hash_chunk": HASH_CHUNK,
                "sha256_chunks": [hashlib.sha256(p).hexdigest() for p in pieces]}
    whole = {"nbytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    for old in (by_piece, whole):
        assert read_checked(io.BytesIO(data), old) == data
        with pytest.raises(ValueError):
            read_checked(io.BytesIO(data[:-1] + bytes([data[-1] ^ 1])), old)  # the last bit flipped
        with pytest.raises(ValueError):
            read_checked(io.BytesIO(data + b"more"), old)  # longer than its header says
    stop = threading.Event()
    stop.set()
    assert read_checked(io.BytesIO(data), old, stop) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kept files are mapped on Linux only")
def test_kept_bytes_are_mapped_checked_and_a_file_cut_short_under_the_map_is_an_error(tmp_path, monkeypatch):
    """#54: a state is read back mapped, not copied; its pages are populated before each use,
    so a file cut short under the mapping is an error to handle, not a SIGBUS that takes the
    window down."""
    import os

    from engine.kept_files import HASH_CHUNK, Mapped, digests, map_checked, read_header, write_atomically

    data = os.urandom(HASH_CHUNK + 4321)
    path = tmp_path / "kept"
    assert write_atomically(path, MAGIC, {"tag": "x", **digests(data)}, data)
    with open(path, "rb") as f:
        mapped = map_checked(f, read_header(f, MAGIC, 1 << 20))
    assert isinstance(mapped, Mapped) and len(mapped) == len(data)
    assert mapped.populated() and bytes(mapped.as_ctypes()) == data
    with monkeypatch.context() as m, open(path, "rb") as f:  # a kernel before 5.14: read instead
        m.setattr("engine.kept_files.MADV_POPULATE_READ", 1 << 20)
        assert map_checked(f, read_header(f, MAGIC, 1 << 20)) == data

    def cannot_map(*_a, **_k):
        raise OSError(19, "No such device")

    with monkeypatch.context() as m, open(path, "rb") as f:  # a file system that cannot map
        m.setattr("engine.kept_files.mmap.mmap", cannot_map)
        assert map_checked(f, read_header(f, MAGIC, 1 << 20)) == data
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 1
    path.write_bytes(raw)
    with open(path, "rb") as f, pytest.raises(ValueError):  # a flipped bit in the last piece
        map_checked(f, read_header(f, MAGIC, 1 << 20))
    with open(path, "rb") as f:  # checked while a restore copies it: found after, said once
        later = map_checked(f, read_header(f, MAGIC, 1 << 20), checked_later=True)
    told = []
    assert isinstance(later, Mapped)
    later.on_damaged = lambda: told.append(1)
    assert not later.intact() and not later.intact() and told == [1]
    os.truncate(path, len(raw) - 1)
    with open(path, "rb") as f, pytest.raises(ValueError):  # shorter than its header says
        map_checked(f, read_header(f, MAGIC, 1 << 20))
    os.truncate(path, 4096)  # cut short while mapped (the first mapping still holds the file)
    assert not mapped.populated()


def test_an_endpoint_request_reads_its_conversations_state_while_it_waits(model_path, tmp_path):
    """#54: a client comes back to a restarted server. Its request names the conversation by
    its opening (system and first message), and the state kept under it is read as the request
    is queued, before its prompt is rendered; the turn takes that read instead of reading
    again, and answers as a turn that read it itself."""
    import shutil

    from engine.server.answering import answer_job
    from engine.server.api.chat import parse_chat_request
    from engine.server.jobs import Job, read_ahead

    def job(messages):
        req = parse_chat_request({"model": "m", "messages": messages, "temperature": 0, "max_tokens": 8})
        return Job(req, "test", lambda _ev: None, image_dir=tmp_path)

    kept = tmp_path / "kept"
    msgs = [{"role": "user", "content": QUESTIONS[1]}]
    with Session(_cfg(model_path, kept)) as s:
        s, first = answer_job(s, job(msgs), None)
        assert s.persist()
        s.model.snapshots.disk.flush()
    assert len(list(kept.glob("api_*" + SUFFIX))) == 1  # named by the conversation, not "x"
    msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And lions?"}]
    answers = []
    for ahead in (False, True):  # each restart on its own copy of what was kept
        states = Path(shutil.copytree(kept, tmp_path / f"states-{ahead}"))
        with Session(_cfg(model_path, states)) as s:
            j = job(msgs)
            if ahead:
                read_ahead(s, j)
            s, got = answer_job(s, j, None)
            answers.append(got)
            assert s.model.snapshots.disk.n_read_ahead == int(ahead)
    plain, early = answers
    assert early.turn.gen.n_prompt_tokens_restored == plain.turn.gen.n_prompt_tokens_restored > 0
    assert early.text == plain.text  # SAME PATH: the same restored cells, the same new tokens
    # another conversation's request reads nothing ahead (its opening names no kept state)
    with Session(_cfg(model_path, tmp_path / "states-True")) as s:
        read_ahead(s, job([{"role": "user", "content": QUESTIONS[0]}]))
        assert s.model.snapshots.disk._ahead is None
