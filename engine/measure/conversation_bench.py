"""A long conversation, Ebb against the bare library: `ebb-engine bench conversation`.

Three processes hold the same model with the same context and threads: Ebb (a `Session` with
its defaults: flash attention auto), and bare llama-cpp-python (`Llama.create_chat_completion`,
its own prefix reuse) with flash attention on and with it off. They are handed the same user
messages turn by turn, the order rotating every turn, so a busy machine slows all three
alike. Each times its own turn (the message in, the greedy reply out). Printed: each one's
turn time over turn ranges, and Ebb's over the faster bare setting's (the goal: ≤ 1.02 over
the last 20 turns).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any, Callable

TOPICS = ("rivers", "lighthouses", "bread", "comets", "bees", "glaciers", "violins", "maps",
          "tides", "owls", "copper", "deserts", "kites", "coral", "trains", "salt")
RUNNERS = ("ebb", "bare-fa-on", "bare-fa-off")


def message(i: int) -> str:
    t = TOPICS[i % len(TOPICS)]
    return (f"Turn {i + 1}. Tell me one short fact about {t}, and say how it connects to what "
            f"we talked about before. Keep it to a sentence or two, please.")


def _child(who: str, model: str, n_ctx: int, threads: int, reply: int) -> None:
    """Reads one user message per line, answers one JSON line per turn: seconds, reply."""
    out = sys.stdout
    if who == "ebb":
        from engine.config import SessionConfig
        from engine.llama.sampling import GenParams
        from engine.session import Session

        s = Session(SessionConfig(Path(model), n_ctx=n_ctx, n_threads=threads))
        gp = GenParams(max_tokens=reply, temperature=0)

        def turn(text: str) -> str:
            res = s.turn(text, [], gp)
            if res.error:
                raise RuntimeError(res.error)
            return res.text
        fa = s.cfg.flash_attn
    else:
        import llama_cpp

        fa = who == "bare-fa-on"
        llm = llama_cpp.Llama(model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                              flash_attn=fa, verbose=False)
        history: list[Any] = []

        def turn(text: str) -> str:
            history.append({"role": "user", "content": text})
            r: Any = llm.create_chat_completion(messages=history, max_tokens=reply, temperature=0,
                                                repeat_penalty=1.0)
            answer = r["choices"][0]["message"]["content"] or ""
            history.append({"role": "assistant", "content": answer})
            return answer
    print(json.dumps({"ready": True, "flash_attn": fa}), file=out, flush=True)
    for line in sys.stdin:
        t0 = time.perf_counter()
        text = turn(json.loads(line))
        print(json.dumps({"s": time.perf_counter() - t0, "text": text}), file=out, flush=True)


def _read(pipe: IO[str]) -> dict[str, Any]:
    line = pipe.readline()
    if not line:
        raise RuntimeError("a benchmark process ended early")
    out: dict[str, Any] = json.loads(line)
    return out


def bench_conversation(model: Path, n_ctx: int, threads: int, turns: int, reply: int,
                       log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    procs = {who: subprocess.Popen([sys.executable, "-m", "engine.measure.conversation_bench",
                                    who, str(model), str(n_ctx), str(threads), str(reply)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for who in RUNNERS}
    times: dict[str, list[float]] = {who: [] for who in RUNNERS}
    replies: dict[str, list[str]] = {who: [] for who in RUNNERS}
    try:
        fa: dict[str, bool] = {}
        for who, p in procs.items():  # each has loaded its model
            assert p.stdout is not None
            fa[who] = bool(_read(p.stdout)["flash_attn"])
        for i in range(turns):
            k = i % len(RUNNERS)
            for who in RUNNERS[k:] + RUNNERS[:k]:  # the first to run rotates
                p = procs[who]
                assert p.stdin is not None and p.stdout is not None
                p.stdin.write(json.dumps(message(i)) + "\n")
                p.stdin.flush()
                r = _read(p.stdout)
                times[who].append(float(r["s"]))
                replies[who].append(str(r["text"]))
            log(f"turn {i + 1}: " + ", ".join(f"{w} {times[w][-1]:.2f}s" for w in RUNNERS))
    finally:
        for p in procs.values():
            if p.stdin is not None:
                p.stdin.close()
            p.wait(60)
    last = min(20, turns)
    ranges = [(a, min(a + 10, turns)) for a in range(0, turns, 10)]

    def total(who: str, a: int, b: int) -> float:
        return sum(times[who][a:b])

    rows = []
    for a, b in ranges:
        bare = min(total("bare-fa-on", a, b), total("bare-fa-off", a, b))
        rows.append({"turns": f"{a + 1}-{b}", **{w: round(total(w, a, b) / (b - a), 3) for w in RUNNERS},
                     "ebb_vs_faster_bare": round(total("ebb", a, b) / bare, 3)})
    bare_last = min(total("bare-fa-on", turns - last, turns), total("bare-fa-off", turns - last, turns))
    same = "bare-fa-on" if fa["ebb"] else "bare-fa-off"
    return {"model": str(model), "n_ctx": n_ctx, "threads": threads, "turns": turns,
            "reply_tokens": reply, "flash_attn": fa, "rows": rows,
            "ebb_vs_faster_bare_last": round(total("ebb", turns - last, turns) / bare_last, 3),
            "last_turns": last,
            "median_turn_s": {w: round(statistics.median(times[w][-last:]), 3) for w in RUNNERS},
            # greedy: Ebb's replies against the bare library's with the same flash attention
            "same_replies_as_bare": replies["ebb"] == replies[same],
            "times": times}


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
