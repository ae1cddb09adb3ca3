"""`ebb-engine bench reopen`: the first token of the next reply after a conversation is
taken up again, three ways, on one loaded model:

- **never left**: the conversation stayed in the KV cache (the reference);
- **restored**: the cache and the RAM states are emptied, as in a new process, and the
  conversation's state is read back from the disk folder (engine/llama/state_files.py);
- **opened, then asked**: emptied the same; the conversation is opened as the window opens a
  chat (`Session.take_up` reads its state back at once), and the question comes after a pause
  (the user reading and typing, `--pause`): the wait the user sees. Its reference is **never
  left, asked after the same pause**: a pause alone makes the next first token slower (the
  CPU's caches and llama.cpp's threads go cold: 0.086 s against 0.103 s for SmolLM2 here);
- **evaluated again**: emptied the same, with nothing kept on disk: the whole history is
  evaluated (and its pictures encoded) again, as Ebb did before it kept states on disk.

For each conversation size (tokens of history) the three are timed in turn, the order rotating
every round, each round with a new question, so a busy machine slows all three alike. Printed:
the median seconds of each, restored ÷ never left (goal ≤ 1.2), opened ÷ never left after the
same pause (goal ≤ 1.05) and evaluated ÷ restored (goal ≥ 10 at 16k tokens on a CPU). The state file is read through the OS's page cache once it has
been read: a first read from a cold disk costs its size over the disk's speed on top. A
conversation with a picture (a generated projector) is one more row when asked.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from engine.llama.runtime import TextRuntime
    from engine.session import Session

MODES = ("never_left", "restored", "never_left_paused", "opened", "evaluated")
FILLER = ("The keeper of the lighthouse wrote in the log each night: the wind, the sea, the "
          "ships that passed, the birds that rested on the rail, and what the lamp needed. ")


def _history(count: Callable[[str], int], n_tokens: int) -> list[tuple[str, str, list[str]]]:
    """Turns of about `n_tokens` tokens together, a question and an answer at a time."""
    turns: list[tuple[str, str, list[str]]] = []
    total, i = 0, 0
    while total < n_tokens:
        q = f"Entry {i + 1}. " + FILLER * 3 + "What did the log say?"
        a = f"Entry {i + 1} said: " + FILLER * 3
        total += count(q) + count(a) + 10
        turns += [("user", q, []), ("assistant", a, [])]
        i += 1
    return turns


def _runtime(s: Session) -> TextRuntime:
    rt = s.model.runtime
    assert rt is not None, "the model is loaded"
    return rt


def _forget_all(s: Session) -> None:
    """As a new process holds nothing: no KV cells, no RAM states, no encoded pictures."""
    _runtime(s).slot.reset()
    s.model.snapshots.clear()
    s.encoder.forget_all()


def bench_reopen(model: Path, sizes: tuple[int, ...], threads: int, rounds: int,
                 picture: bool = False, pause_s: float = 1.0,
                 log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    from engine.config import SessionConfig
    from engine.gguf.info import model_info, read_gguf
    from engine.llama.sampling import GenParams
    from engine.session import Session

    info = model_info(read_gguf(model))
    limit = info.max_context
    gp = GenParams(temperature=0, max_tokens=1)
    rows: list[dict[str, Any]] = []
    skipped = [n for n in sizes if n + 512 > limit]
    work = [(n, False) for n in sizes if n + 512 <= limit]
    if picture:
        work.append((min(1024, limit - 512), True))
    with tempfile.TemporaryDirectory(prefix="ebb-bench-reopen-") as tmp:
        folder = Path(tmp)
        projector = None
        pic = folder / "picture.png"
        if picture:
            from PIL import Image

            from engine.synth.projector_gen import write_projector

            projector = write_projector(folder / "projector.gguf", info.n_embd, size="tiny", seed=1)
            Image.new("RGB", (320, 240), (200, 40, 40)).save(pic)
        for n, with_picture in work:
            states = folder / f"states-{n}-{int(with_picture)}"
            cfg = SessionConfig(model, projector if with_picture else None, n_ctx=n + 512,
                                n_threads=threads, accel="CPU", vision="cpu", state_dir=states)
            with Session(cfg) as s:
                rt = _runtime(s)
                hist = _history(lambda t: len(rt.tokenize(t, add_special=False)), n)
                if with_picture:
                    hist[0] = ("user", hist[0][1], [str(pic)])
                log(f"{n} tokens{' with a picture' if with_picture else ''}: the conversation "
                    "evaluated once and kept on disk")
                s.set_history(hist, tag="bench")
                first = s.turn("Anything else?", gp=gp)
                n_history = first.gen.n_prompt_tokens
                s.set_history(hist, tag="bench")
                _runtime(s).slot.keep_on_drop = False
                assert s.persist()
                disk = s.model.snapshots.disk
                assert disk is not None
                disk.flush()
                state_bytes = max(e.nbytes for e in disk.entries())
                times: dict[str, list[float]] = {m: [] for m in MODES}
                restored_tokens, asked = 0, 0
                evaluated: dict[str, int] = {}  # tokens each mode's last turn evaluated
                for r in range(rounds):
                    order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
                    for mode in order:
                        s.set_history(hist, tag="bench")
                        _runtime(s).slot.keep_on_drop = False  # nothing written while timed
                        if not mode.startswith("never_left"):
                            _forget_all(s)
                        saved_disk, saved_pics = s.model.snapshots.disk, s.encoder.disk
                        if mode == "evaluated":
                            s.model.snapshots.disk, s.encoder.disk = None, None
                        if mode == "opened":  # as the window opens a chat; then the user types
                            s.take_up()
                        if mode in ("opened", "never_left_paused"):
                            time.sleep(pause_s)
                        try:
                            t0 = time.perf_counter()
                            # a question of its own each time, from its first token: the same
                            # question in every mode of a round left it in the cache, so a
                            # never-left turn after another mode evaluated one token, not the
                            # question (0.04 s against 0.10: "never left ranged 0.21-0.61 s by the
                            # order of the rounds"); "Question 11", "Question 12" still shared
                            # two tokens with the one before
                            asked += 1
                            res = s.turn(f"{chr(65 + asked % 26)}{asked}: and the weather?", gp=gp)
                            times[mode].append(time.perf_counter() - t0)
                            evaluated[mode] = res.gen.n_prompt_tokens_evaluated
                        finally:
                            s.model.snapshots.disk, s.encoder.disk = saved_disk, saved_pics
                        if mode == "restored":
                            restored_tokens = res.gen.n_prompt_tokens_restored
                        if mode == "opened":
                            assert res.gen.n_prompt_tokens_restored == restored_tokens or not \
                                restored_tokens, "opened, the chat was taken back before the question"
                        log(f"  round {r + 1} {mode}: {times[mode][-1]:.3f}s")
                med = {m: statistics.median(v) for m, v in times.items()}
                rows.append({"tokens": n_history, "picture": with_picture, **med,
                             "state_bytes": state_bytes, "restored_tokens": restored_tokens,
                             "evaluated_tokens": evaluated,
                             "restored_vs_never_left": round(med["restored"] / med["never_left"], 3),
                             "opened_vs_never_left_paused": round(med["opened"] / med["never_left_paused"], 3),
                             "evaluated_vs_restored": round(med["evaluated"] / med["restored"], 2)})
    return {"threads": threads, "rounds": rounds, "model": model.name, "rows": rows, "pause_s": pause_s,
            "skipped": [{"tokens": n, "why": f"the model allows {limit} tokens"} for n in skipped]}


def parse_sizes(text: str) -> tuple[int, ...]:
    """"1k,4k,16k" or "1024,4096": tokens (k: 1,024)."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part:
            out.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
    return tuple(out)
