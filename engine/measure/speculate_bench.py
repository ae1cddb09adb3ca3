"""`ebb-engine bench speculate`: greedy replies with n-gram drafts against the same replies
without (`--speculate off`), alternating, on a prompt whose reply repeats it (a quote, code to
edit) and one whose reply does not (drafting must switch itself off and cost little)."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Callable

QUOTE = ("def area(width, height):\n    return width * height\n\n"
         "def perimeter(width, height):\n    return 2 * (width + height)\n\n") * 3
PROMPTS = {
    "quote": f"Repeat this code exactly:\n\n{QUOTE}",
    "fresh": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def bench_speculate(model: Path, rounds: int, max_tokens: int, threads: int | None,
                    log: Callable[[str], None], peer_binary: Path | None = None) -> dict[str, Any]:
    """`peer_binary`: llama.cpp's llama-server, run beside (after each round's two) on the same
    prompts as the chat template writes them, with its own defaults (no drafts: this llama.cpp's
    server drafts only with a draft model)."""
    from engine.measure.contention_bench import ServerPeer

    rows: dict[str, dict[str, Any]] = {}
    peer = ServerPeer(peer_binary, model, 4096) if peer_binary is not None else None
    try:
        _rounds(model, rounds, max_tokens, threads, log, peer, rows)
    finally:
        if peer is not None:
            peer.close()
    return {"model": model.name, "rounds": rounds, "max_tokens": max_tokens, "rows": rows,
            "peer": peer.name if peer is not None else None}


def _rounds(model: Path, rounds: int, max_tokens: int, threads: int | None, log: Callable[[str], None],
            peer: Any, rows: dict[str, dict[str, Any]]) -> None:
    from engine.config import SessionConfig
    from engine.llama.sampling import GenParams
    from engine.session import Session

    with Session(SessionConfig(model, n_ctx=4096, n_threads=threads)) as s:
        for name, prompt in PROMPTS.items():
            rates: dict[str, list[float]] = {"auto": [], "off": [], "peer": []}
            assert s.model.runtime is not None
            as_written = s.model.runtime.format_chat([{"role": "user", "content": prompt}])[0]
            taken = drafted = 0
            for r in range(rounds):
                for mode in (("auto", "off") if r % 2 == 0 else ("off", "auto")):
                    s.set_history([], tag=f"spec-{name}-{r}-{mode}")
                    res = s.turn(prompt, gp=GenParams(max_tokens=max_tokens, temperature=0, speculate=mode))
                    rates[mode].append(res.gen.gen_tokens_per_s)
                    if mode == "auto":
                        taken, drafted = taken + res.gen.n_draft_accepted, drafted + res.gen.n_drafted
                    log(f"{name} round {r + 1} {mode}: {res.gen.gen_tokens_per_s:.1f} tok/s, "
                        f"{res.gen.n_gen_tokens} tokens, {res.gen.n_draft_accepted} of "
                        f"{res.gen.n_drafted} drafted taken")
                if peer is not None:
                    rates["peer"].append(peer.run(as_written, max_tokens)[1])
                    log(f"{name} round {r + 1} peer: {rates['peer'][-1]:.1f} tok/s")
            on, off = statistics.median(rates["auto"]), statistics.median(rates["off"])
            rows[name] = {"tok_s_auto": on, "tok_s_off": off, "ratio": on / off if off else 0.0,
                          "drafted": drafted, "taken": taken}
            if rates["peer"]:
                rows[name]["tok_s_peer"] = statistics.median(rates["peer"])
                rows[name]["vs_peer"] = on / rows[name]["tok_s_peer"]


def copy_of(model: Path, ftype: str, log: Callable[[str], None]) -> Path:
    """The model requantized to `ftype` (q8_0 or f16) with llama.cpp's own quantize, once, in
    Ebb's cache: the same vocabulary and weights, a larger and slower model to draft for."""
    import ctypes

    from engine.llama.lib import llama
    from engine.paths import cache_dir

    L = llama()
    kinds = {"q8_0": L.LLAMA_FTYPE_MOSTLY_Q8_0, "f16": L.LLAMA_FTYPE_MOSTLY_F16}
    out = cache_dir() / "models" / f"{model.stem}.{ftype.upper()}.gguf"
    if not out.is_file():
        log(f"making {out.name} with llama.cpp's quantize (once)")
        out.parent.mkdir(parents=True, exist_ok=True)
        params = L.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize = kinds[ftype], True
        part = out.with_suffix(".part")
        if L.llama_model_quantize(str(model).encode(), str(part).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama.cpp could not make {out.name}")
        part.replace(out)
    return out


def bench_draft(model: Path, ftype: str, rounds: int, max_tokens: int, threads: int | None,
                log: Callable[[str], None]) -> dict[str, Any]:
    """`model` drafting for its own `ftype` copy, against the copy alone (drafts of neither
    kind), alternating; greedy, on a reply that repeats nothing."""
    from dataclasses import replace

    from engine.config import SessionConfig
    from engine.llama.sampling import GenParams
    from engine.session import Session

    target = copy_of(model, ftype, log)
    rates: dict[str, list[float]] = {"draft": [], "alone": []}
    taken = drafted = 0
    base = SessionConfig(target, n_ctx=4096, n_threads=threads)
    with Session(base) as alone, Session(replace(base, draft_path=model)) as drafting:
        sessions = {"alone": alone, "draft": drafting}
        for r in range(rounds + 1):  # round 0 warms both up
            for mode in (("draft", "alone") if r % 2 == 0 else ("alone", "draft")):
                s = sessions[mode]
                s.set_history([], tag=f"draft-{r}-{mode}")
                res = s.turn(PROMPTS["fresh"], gp=GenParams(max_tokens=max_tokens, temperature=0,
                                                            speculate="auto" if mode == "draft" else "off"))
                if not r:
                    continue
                rates[mode].append(res.gen.gen_tokens_per_s)
                if mode == "draft":
                    taken, drafted = taken + res.gen.n_draft_accepted, drafted + res.gen.n_drafted
                log(f"round {r} {mode}: {res.gen.gen_tokens_per_s:.1f} tok/s, {res.gen.n_gen_tokens} "
                    f"tokens, {res.gen.n_draft_accepted} of {res.gen.n_drafted} drafted taken")
    on, off = statistics.median(rates["draft"]), statistics.median(rates["alone"])
    return {"model": model.name, "target": target.name, "rounds": rounds, "max_tokens": max_tokens,
            "tok_s_draft": on, "tok_s_alone": off, "ratio": on / off if off else 0.0,
            "drafted": drafted, "taken": taken}
