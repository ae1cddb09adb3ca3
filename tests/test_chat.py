"""Headless chat with the real SmolLM2 model through real llama.cpp."""
from __future__ import annotations

import pytest

import json
import signal
import subprocess
import sys
import threading

from engine.llama.sampling import GenParams
from tests.helpers import N_THREADS, agree_where_decided, run_cli

QUESTION = "What is the capital of France? Answer in one word."


def test_cli_answers_paris_at_temperature_zero():
    proc = run_cli("chat", "--prompt", QUESTION, "--temp", "0", "--json", "--threads", str(N_THREADS))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "paris" in out["text"].lower()
    for key in ("text", "n_prompt_tokens", "n_gen_tokens", "prompt_s", "gen_s",
                "gen_tokens_per_s", "stop_reason"):
        assert key in out
    assert out["stop_reason"] == "stop"
    assert out["flash_attn"] is False  # auto, on the CPU alone (#30)
    assert out["n_prompt_tokens"] > 10 and out["n_gen_tokens"] > 0


@pytest.mark.numerics
def test_two_greedy_cli_runs_give_identical_text():
    """SAME PATH: two processes, the same command."""
    args = ("chat", "--prompt", "Name three colours.", "--temp", "0", "--max-tokens", "40",
            "--json", "--threads", str(N_THREADS))
    a, b = run_cli(*args), run_cli(*args)
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    assert json.loads(a.stdout)["text"] == json.loads(b.stdout)["text"]


def test_cli_streams_text_to_stdout():
    proc = run_cli("chat", "--prompt", QUESTION, "--temp", "0", "--threads", "2")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "tok/s" in proc.stderr


@pytest.mark.numerics
def test_streamed_pieces_make_the_text_and_seed_repeats(text_runtime):
    """SAME PATH: each reply from an empty cache (the prompt in one batch). Another seed must
    change the draws: among four other seeds, at least one reply differs (one seed alone can
    draw the same 30 tokens by chance where the model is sure)."""
    msgs = [{"role": "user", "content": "Tell me a short story about a cat."}]
    pieces: list[str] = []
    gp = GenParams(max_tokens=30, temperature=0.9, seed=42)
    text_runtime.slot.reset()
    r1 = text_runtime.generate(msgs, gp, on_text=pieces.append)
    assert "".join(pieces) == r1.text and r1.stats.n_gen_tokens == 30 and r1.stats.stop_reason == "length"
    text_runtime.slot.reset()
    r2 = text_runtime.generate(msgs, gp)
    assert r2.text == r1.text
    others = set()
    for seed in range(43, 47):
        text_runtime.slot.reset()
        others.add(text_runtime.generate(msgs, GenParams(max_tokens=30, temperature=0.9, seed=seed)).text)
    assert others != {r1.text}


@pytest.mark.numerics
def test_prefix_reuse_evaluates_only_new_tokens(text_runtime):
    """DECIDED: the whole prompt against its cached prefix and last token."""
    msgs = [{"role": "user", "content": "Hello there, who are you?"}]
    gp = GenParams(max_tokens=8, temperature=0, top_logprobs=2)
    text_runtime.slot.reset()
    first = text_runtime.generate(msgs, gp)
    again = text_runtime.generate(msgs, gp)
    assert first.stats.n_prompt_tokens_evaluated == first.stats.n_prompt_tokens
    assert again.stats.n_prompt_tokens_evaluated == 1
    agree_where_decided(again.stats.logprobs, first.stats.logprobs)


def test_cancel_stops_between_tokens(text_runtime):
    cancel = threading.Event()
    seen: list[str] = []

    def on_text(piece: str) -> None:
        seen.append(piece)
        if len(seen) == 3:
            cancel.set()

    r = text_runtime.generate([{"role": "user", "content": "Count to one hundred."}],
                              GenParams(max_tokens=200, temperature=0), on_text=on_text,
                              cancel=cancel)
    assert r.stats.stop_reason == "cancelled"
    assert 3 <= r.stats.n_gen_tokens < 10


def test_ctrl_c_stops_cleanly_with_partial_result():
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "chat", "--prompt", "Count from 1 to 500, one per line.",
         "--temp", "0", "--max-tokens", "2000", "--threads", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.read(20)  # wait until tokens stream
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "Traceback" not in err
    assert "stop: cancelled" in err


@pytest.mark.numerics
def test_embeddings_leave_the_conversations_cache_as_it_was(text_runtime):
    """#29: an embedding is computed in a context of its own: the conversation's KV cache and
    the reply that follows are those of a run without it. SAME PATH: the run without it
    evaluates the same two turns the same way (the second on the first's cached prefix)."""
    rt = text_runtime
    msgs = [{"role": "user", "content": "Name three birds."}]
    gp = GenParams(max_tokens=8, temperature=0)

    def two_turns(embed_between: bool) -> str:
        rt.slot.reset()
        first = rt.generate(msgs, gp).text
        cached = list(rt.slot.cells)
        if embed_between:
            (vec,) = rt.embed([rt.tokenize("A red apple.", add_special=True)])
            assert len(vec) == rt.info.n_embd and abs(sum(x * x for x in vec) - 1) < 1e-6
            assert rt.slot.cells == cached
        again = rt.generate(msgs + [{"role": "assistant", "content": first},
                                    {"role": "user", "content": "And three fish?"}], gp)
        assert again.stats.n_prompt_tokens_evaluated < again.stats.n_prompt_tokens  # prefix reused
        return again.text

    assert two_turns(embed_between=True) == two_turns(embed_between=False)


def test_chat_titles_tell_chats_apart():
    """#43: the first line, cut at a word; attachments' names without text; a number when the
    title is taken."""
    from pathlib import Path

    from app.core.chat_state import chat_title

    assert chat_title("What colour is this picture?\nSecond line", [], set()) == "What colour is this picture?"
    assert chat_title("What colour is this picture?", [], {"What colour is this picture?"}) == \
        "What colour is this picture? (2)"
    assert chat_title("x", [], {"x", "x (2)"}) == "x (3)"
    long = "Please summarise the attached quarterly report and list every risk it names"
    assert chat_title(long, [], set()) == "Please summarise the attached quarterly report…"
    assert chat_title("   ", [Path("/a/red.png"), Path("/b/voice.wav")], set()) == "red.png, voice.wav"
