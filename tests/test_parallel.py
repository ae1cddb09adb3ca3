"""Several sequences in one context (engine/llama/lanes.py) and the endpoint's requests answered
on them together (engine/server/parallel.py), through real llama.cpp and the real model.

Replies decoded beside others are compared with the same replies decoded alone where the
choice was decided (agree_where_decided): a batch of several sequences is evaluated with other
arithmetic than one sequence's token."""
from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import pytest

from tests.helpers import N_THREADS, agree_where_decided

STORY = "Write a long story about a lighthouse keeper who finds a message in a bottle."
OTHER = "Write a long story about a girl who builds a robot from scrap."


@pytest.fixture(scope="module")
def laned(model_path):
    from engine.llama.loaded_model import LoadParams
    from engine.llama.runtime import TextRuntime

    rt = TextRuntime(LoadParams(model_path, n_ctx=1024, n_threads=N_THREADS, lanes=2, lane_cells=512))
    yield rt
    rt.close()


def _tokens(rt, text: str) -> list[int]:
    prompt, added = rt.format_chat([{"role": "user", "content": text}])
    return rt.tokenize(prompt, not added)


def _clear(rt) -> None:
    from engine.llama.lib import llama

    L = llama()
    for lane in rt.lanes.lanes:
        L.llama_memory_seq_rm(L.llama_get_memory(rt.ctx), lane.seq, -1, -1)
        lane.cells.clear()
    rt.slot.reset()


def _request(rt, text: str, ends: list, max_tokens: int = 24, **kw):
    from engine.llama.lanes import LaneRequest
    from engine.llama.sampling import GenParams

    return LaneRequest(_tokens(rt, text), GenParams(max_tokens=max_tokens, temperature=0, top_logprobs=2, **kw),
                       lambda s: None, ends.append)


def test_a_lane_beside_the_session_says_what_it_says_alone(laned):
    """OTHER ARITHMETIC: a lane's reply and the session's, each decoded alone and then together
    in one batch per step, agree wherever the choice was decided (raw prompts whose
    continuations are: counting, the alphabet)."""
    from engine.llama.lanes import LaneRequest
    from engine.llama.sampling import GenParams

    rt = laned
    gp = GenParams(max_tokens=24, temperature=0, top_logprobs=2)
    counting, letters = rt.tokenize("1, 2, 3, 4, 5, 6, 7,", True), rt.tokenize("a b c d e f g h", True)
    _clear(rt)
    alone: list = []
    assert rt.lanes.start(LaneRequest(letters, gp, lambda s: None, alone.append))
    while rt.lanes.busy:
        rt.lanes.step()
    mine_alone = rt.generate_from(counting, gp)
    _clear(rt)
    beside: list = []
    assert rt.lanes.start(LaneRequest(letters, gp, lambda s: None, beside.append))
    steps = rt.lanes.steps
    mine = rt.generate_from(counting, gp)
    assert rt.lanes.steps - steps >= 20  # the lane went along in the session's batches
    while rt.lanes.busy:
        rt.lanes.step()
    [a], [b] = alone, beside
    assert a.error is None and b.error is None
    assert a.stats.n_gen_tokens == b.stats.n_gen_tokens == 24
    assert agree_where_decided(a.stats.logprobs, b.stats.logprobs) >= 4
    assert agree_where_decided(mine_alone.stats.logprobs, mine.stats.logprobs) >= 4


def test_each_request_has_its_room_and_a_lane_keeps_its_prefix(laned):
    """The pool (512 cells) is reserved per request: one that would not fit waits (start says
    no) and starts once the other ends; a request sent again finds its prompt in its lane."""
    rt = laned
    _clear(rt)
    first: list = []
    second: list = []
    n = len(_tokens(rt, STORY))
    assert not rt.lanes.start(_request(rt, STORY, first, max_tokens=600))  # more than the pool
    big = _request(rt, STORY, first, max_tokens=400 - n)
    assert rt.lanes.start(big)
    assert not rt.lanes.start(_request(rt, OTHER, second, max_tokens=200))  # its room is not there
    assert rt.lanes.start(_request(rt, OTHER, second, max_tokens=60))  # this one's is
    rt.lanes.step()
    big.cancel.set()  # the client left: its lane ends at the next step, the other goes on
    while rt.lanes.busy:
        rt.lanes.step()
    assert first[0].stats.n_prompt_tokens_evaluated == n
    assert second[0].stats.n_prompt_tokens_evaluated == len(_tokens(rt, OTHER))
    assert second[0].stats.n_gen_tokens > 1
    again: list = []
    assert rt.lanes.start(_request(rt, STORY, again, max_tokens=4))
    while rt.lanes.busy:
        rt.lanes.step()
    assert again[0].stats.n_prompt_tokens_evaluated == 1  # the rest was in the lane's cells


def test_the_server_answers_several_requests_at_once(model_path):
    """Three chat requests sent together: the first goes to the session, the others begin on
    lanes while it writes (their first pieces come before its end), and all three end whole."""
    from engine.config import SessionConfig
    from engine.server.api.chat import parse_chat_request
    from engine.server.jobs import Done, Failed, Job, Piece
    from engine.server.worker import ServeWorker

    w = ServeWorker(SessionConfig(model_path, n_ctx=1024, n_threads=N_THREADS, parallel=3),
                    Path(tempfile.mkdtemp()))
    order: list[tuple[str, str]] = []
    ended = threading.Semaphore(0)
    others_queued = threading.Event()
    try:
        def listen(name: str):
            def on_event(ev) -> None:
                order.append((name, type(ev).__name__))
                if name == "a" and isinstance(ev, Piece):
                    assert others_queued.wait(60)  # b and c wait in line before a goes on
                if isinstance(ev, (Done, Failed)):
                    ended.release()
            return on_event

        jobs = {}
        for name, text in (("a", STORY), ("b", OTHER), ("c", "Write a long story about a sailor.")):
            req = parse_chat_request({"messages": [{"role": "user", "content": text}],
                                      "max_tokens": 24 if name == "a" else 8, "temperature": 0})
            jobs[name] = Job(req, name, listen(name))
            w.submit(jobs[name])
        others_queued.set()
        for _ in jobs:
            assert ended.acquire(timeout=300)
    finally:
        w.close()
    ends = {name: kind for name, kind in order if kind in ("Done", "Failed")}
    assert ends == {"a": "Done", "b": "Done", "c": "Done"}, order
    a_done = order.index(("a", "Done"))
    for name in "bc":
        assert order.index((name, "Piece")) < a_done, order
        assert order.index((name, "Done")) < a_done, order  # 8 tokens each, beside a's 24
    assert w.served == 3


def test_a_lane_drafts_a_reply_that_copies_and_says_the_same(laned):
    """A greedy reply on a lane that copies its prompt takes n-gram drafts (fewer batches
    than tokens), and its text begins with the token-by-token reply's up to that reply's first
    step decided by less than DECIDED_BY (a draft's batch is other arithmetic than one token)."""
    from engine.llama.lanes import LaneRequest
    from engine.llama.sampling import GenParams
    from tests.helpers import DECIDED_BY, margin

    rt = laned
    from tests.test_speculation import QUESTION

    copy = _tokens(rt, QUESTION)
    got: dict[str, object] = {}
    for mode, k in (("off", 2), ("auto", -1)):
        _clear(rt)
        out: list = []
        gp = GenParams(max_tokens=40, temperature=0, top_logprobs=k, speculate=mode)
        assert rt.lanes.start(LaneRequest(copy, gp, lambda s: None, out.append))
        steps = rt.lanes.steps
        while rt.lanes.busy:
            rt.lanes.step()
        got[mode] = (out[0], rt.lanes.steps - steps)
    (alone, alone_steps), (drafted, drafted_steps) = got["off"], got["auto"]
    assert alone.stats.n_drafts == 0 and drafted.stats.n_draft_accepted > 0, drafted.stats
    assert drafted_steps < alone_steps
    decided = b""
    for e in alone.stats.logprobs:
        if margin(e) < DECIDED_BY:
            break
        decided += bytes(e.to_dict()["bytes"])
    assert len(decided) > 20, "the reply was undecided from its start: nothing to compare"
    assert drafted.text.encode().startswith(decided), (drafted.text, decided.decode(errors="replace"))
    _clear(rt)  # a sampled reply drafts too: a guess is taken when the lane's own draw is it
    sampled: list = []
    assert rt.lanes.start(LaneRequest(copy, GenParams(max_tokens=24, temperature=0.7, seed=3),
                                      lambda s: None, sampled.append))
    while rt.lanes.busy:
        rt.lanes.step()
    assert sampled[0].stats.n_drafts > 0 and sampled[0].stats.n_gen_tokens > 0


def test_serve_answers_streams_at_once_by_default(model_path):
    """`ebb-engine serve` with its default (on the CPU alone: four at once): two streamed
    chats sent together both end whole, with their usage, and the server's log says each."""
    from tests.test_server import Server

    server = Server(api_key=None, parallel=None)
    try:
        client = server.client()
        results: dict[int, tuple[str, int]] = {}

        def ask(i: int) -> None:
            stream = client.chat.completions.create(
                model="any", messages=[{"role": "user", "content": f"Write a long story, number {i}."}],
                temperature=0, max_tokens=8, stream=True, stream_options={"include_usage": True})
            text, used = "", 0
            for ch in stream:
                if ch.choices and ch.choices[0].delta.content:
                    text += ch.choices[0].delta.content
                if ch.usage is not None:
                    used = ch.usage.completion_tokens
            results[i] = (text, used)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert sorted(results) == [0, 1]
        for text, used in results.values():
            assert text and used == 8
    finally:
        server.stop()
    assert any("answering up to 4 requests at once" in line for line in server.log), server.log
    assert sum('"completion_tokens": 8' in line for line in server.log) == 2, server.log


def test_the_windows_local_server_answers_beside_the_windows_reply(qtbot, store):
    """Settings → requests at once 2: an HTTP client's text request, sent while the window's
    own reply is being written, is answered on a lane in the same batches: it ends while the
    window's reply still runs (no longer "1 ahead" for the whole of it), and the window's chat
    is the window's."""
    from openai import OpenAI

    from tests.helpers import free_port, open_window, wait_for

    port = free_port()
    w = open_window(qtbot, store, max_tokens=2000, server=True, server_port=port, parallel=2)
    w.composer.edit.setPlainText(STORY)
    w.sending.send()
    wait_for(lambda: w.worker.turn_running.is_set())
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    answers: list = []

    def ask() -> None:
        answers.append(client.chat.completions.create(
            model="m", temperature=0, max_tokens=6, user="editor",
            messages=[{"role": "user", "content": "Write a poem about the sea."}]))

    t = threading.Thread(target=ask)
    t.start()
    wait_for(lambda: not t.is_alive(), timeout=120_000)
    assert w.chat.busy, "the window's reply ended before the client's: they were not decoded together"
    [a] = answers
    assert a.choices[0].message.content and a.usage.completion_tokens == 6
    w.worker.cancel()  # Stop the window's reply
    wait_for(lambda: not w.chat.busy, timeout=120_000)
    assert "1 answered" in w.server_status.text()
    assert [m.role for m in w.worker._session.history] == ["user", "assistant"]
    # the Memory panel's Steps: the client's request in a lane of its own, labelled by client
    lane = [sp for sp in w.telemetry.spans if sp.lane]
    assert [sp.name for sp in lane] == ["prefill", "decode"] and w.telemetry.labels[lane[0].request_id] == "editor"
    from engine.trace import row_names

    assert row_names(w.telemetry.spans)[3 + lane[0].lane] == f"request {lane[0].lane + 1}"


def test_pictures_on_two_lanes_at_once_are_each_seen(model_path, colour_projector, tmp_path):
    """Two messages with a picture each (a solid red, a solid blue), answered on two lanes at
    once: each chunk encoded on the CPU as its lane's prompt is made and decoded into its own
    sequence by mtmd's helper, the text after it at the position llama.cpp gave. The colour
    projector makes the model name a solid picture's colour, so each reply names its own
    picture's (no output of two paths is compared: the check is what each reply says). The
    prompt is the one the session's own turn makes, cell for cell."""
    from PIL import Image

    from engine.config import SessionConfig
    from engine.llama.lanes import LaneRequest
    from engine.llama.sampling import GenParams
    from engine.measure.colour_check import QUESTION, SHADES
    from engine.session import Session
    from tests.helpers import first_colour

    files = {}
    for colour in ("red", "blue"):
        files[colour] = tmp_path / f"{colour}.png"
        Image.new("RGB", (300, 200), SHADES[colour][0]).save(files[colour])
    gp = GenParams(max_tokens=12, temperature=0)
    cfg = SessionConfig(model_path, colour_projector, n_ctx=1024, n_threads=N_THREADS, vision="cpu",
                        parallel=3)
    ends: dict[str, list] = {"red": [], "blue": []}
    with Session(cfg) as s:
        rt = s.model.runtime
        assert rt is not None and rt.lanes is not None
        prompts = {}
        for colour, path in files.items():
            lp = s.lane_prompt([("user", QUESTION, [path])], None, None, 99)
            assert lp is not None and sum(not isinstance(i, int) for i in lp.items) >= 1
            assert [sp.name for sp in lp.spans].count("encode") == 1  # encoded as the prompt was made
            prompts[colour] = lp
            assert rt.lanes.start(LaneRequest(lp.keys, gp, lambda t: None, ends[colour].append,
                                              items=lp.items, close=lp.close))
        while rt.lanes.busy:
            rt.lanes.step()
        own = s.turn(QUESTION, [files["red"]], gp)  # the session's: the picture cached by now
        assert own.error is None and own.n_images_cached == 1
        # a picture that cannot be read is the session's turn's to refuse, with its words
        assert s.lane_prompt([("user", QUESTION, [tmp_path / "gone.png"])], None, None, 100) is None
    for colour, [r] in ends.items():
        assert r.error is None and r.seq >= 1
        assert r.stats.n_prompt_tokens_evaluated == len(prompts[colour].keys)
        assert first_colour(r.text) == colour, (colour, r.text)
    assert ends["red"][0].seq != ends["blue"][0].seq
    assert ends["red"][0].stats.n_prompt_tokens == own.gen.n_prompt_tokens  # the same prompt
    assert first_colour(own.text) == "red", own.text


def test_the_server_answers_a_picture_on_a_lane_beside_the_session(model_path, tiny_projector, pictures):
    """A request with a picture that comes while the session writes another reply begins on a
    lane: its steps (the encode and its prefill) are in a lane's row, and it ends before the
    session's longer reply."""
    import base64

    from engine.config import SessionConfig
    from engine.server.api.chat import parse_chat_request
    from engine.server.jobs import Done, Failed, Job, Piece
    from engine.server.worker import ServeWorker

    w = ServeWorker(SessionConfig(model_path, tiny_projector, n_ctx=1024, n_threads=N_THREADS,
                                  vision="cpu", parallel=2), Path(tempfile.mkdtemp()))
    order: list[tuple[str, str]] = []
    done: dict[str, object] = {}
    ended = threading.Semaphore(0)
    picture_queued = threading.Event()
    url = "data:image/png;base64," + base64.b64encode(pictures["a.png"].read_bytes()).decode()
    try:
        def listen(name: str):
            def on_event(ev) -> None:
                order.append((name, type(ev).__name__))
                if name == "a" and isinstance(ev, Piece):
                    assert picture_queued.wait(60)
                if isinstance(ev, Done):
                    done[name] = ev.answer
                if isinstance(ev, (Done, Failed)):
                    ended.release()
            return on_event

        a = parse_chat_request({"messages": [{"role": "user", "content": STORY}], "max_tokens": 40,
                                "temperature": 0})
        b = parse_chat_request({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": url}}]}], "max_tokens": 6, "temperature": 0})
        w.submit(Job(a, "a", listen("a")))
        w.submit(Job(b, "b", listen("b"), image_dir=Path(tempfile.mkdtemp())))
        picture_queued.set()
        for _ in range(2):
            assert ended.acquire(timeout=300)
    finally:
        w.close()
    assert {n: k for n, k in order if k in ("Done", "Failed")} == {"a": "Done", "b": "Done"}, order
    assert order.index(("b", "Done")) < order.index(("a", "Done")), order
    assert done["b"].turn.n_images == 1 and done["b"].turn.strategy == "cpu"
    spans = done["b"].turn.spans
    assert {sp.name for sp in spans} >= {"encode", "prefill", "decode"}
    assert all(sp.lane >= 1 for sp in spans), spans
