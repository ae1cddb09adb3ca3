"""`ebb-engine bench tools`: what the tool loop costs beside the model's own work, and whether a
server that keeps crashing can hold it.

- **Next round**: a turn makes a (grammar-forced) call to Ebb's demo server (`lines`: a result
  of some hundred tokens); from the moment the result is back to the next round's first token,
  against a plain prefill of the same new tokens on the same session (the KV cache cut back to
  where that round's new tokens begin, then the same tokens evaluated as a completion, to its
  first token). The ratio is ≈ 1 when nothing before the new tokens is evaluated again.
  Alternating, median of the rounds.
- **Crash and restart**: a server that ends mid-call, restarted N times: each cycle must come
  back ready and fail its call cleanly; hangs (a cycle that does not settle in 60 s) are counted.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

CRASH_SERVER = """
import os, sys
from mcp.server.mcpserver import MCPServer
m = MCPServer("crashes")
def crash() -> str:
    '''Ends the server mid-call.'''
    os._exit(3)
m.add_tool(crash)
m.run()
"""


def bench_tools(model: Path, rounds: int, lines: int, cycles: int, threads: int | None,
                log: Callable[[str], None]) -> dict[str, Any]:
    from engine.config import SessionConfig
    from engine.llama.sampling import GenParams
    from engine.session import Session
    from engine.tools.host import READY, ToolHost
    from engine.tools.loop import Decision, first_choice, offer, run_tool_turn

    work = Path(tempfile.mkdtemp(prefix="ebb-tools-bench-"))
    host = ToolHost(work / "files")
    out: dict[str, Any] = {"model": model.name, "rounds": rounds, "result_lines": lines}
    try:
        host.set_servers([demo_server()], lambda d: True)
        host.settled(60)
        if host.state("demo") is None or host.state("demo").phase != READY:  # type: ignore[union-attr]
            raise RuntimeError(f"the demo server did not start: {host.state('demo')}")
        offered, _ = offer(host.tools())
        loop_s: list[float] = []
        plain_s: list[float] = []
        new_tokens: list[int] = []
        with Session(SessionConfig(model, n_ctx=4096, n_threads=threads)) as s:
            for r in range(rounds):
                s.set_history([], tag=f"bench{r}")
                marks: dict[str, float] = {}

                def on_call(rec: Any) -> None:
                    if rec.state == "done":
                        marks["result"] = time.perf_counter()

                def on_text(piece: str) -> None:
                    if "result" in marks and "first" not in marks:
                        marks["first"] = time.perf_counter()

                s, tt = run_tool_turn(
                    s, f"Show me {lines} lines. ({r})", [], GenParams(max_tokens=64, temperature=0),
                    offered, ask=lambda rec: Decision.ONCE,
                    call=lambda rec, c: host.call("demo", rec.fn, {**rec.arguments, "n": lines}, c),
                    on_call=on_call, on_text=on_text, choice=first_choice("lines", offered), max_rounds=1)
                second = tt.rounds[-1].gen
                if "first" not in marks or len(tt.rounds) < 2:
                    raise RuntimeError("the round after the call wrote nothing")
                loop_s.append(marks["first"] - marks["result"])
                n_new = second.n_prompt_tokens_evaluated
                new_tokens.append(n_new)
                # the plain prefill of the same tokens: the cache cut back to where they begin
                rt = s.model.runtime
                assert rt is not None
                prompt = [c for c in rt.slot.cells[:second.n_prompt_tokens]]
                if not all(isinstance(c, int) for c in prompt):
                    raise RuntimeError("the prompt holds pictures: the plain prefill needs tokens")
                rt.slot.drop_from(second.n_prompt_tokens - n_new)
                t0 = time.perf_counter()
                first: list[float] = []
                res = s.complete(prompt, GenParams(max_tokens=1, temperature=0),
                                 on_text=lambda p: first.append(time.perf_counter()) if not first else None)
                plain_s.append((first[0] if first else time.perf_counter()) - t0)
                log(f"round {r + 1}: {n_new} new tokens: after the result {loop_s[-1] * 1000:.0f} ms, "
                    f"plain prefill {plain_s[-1] * 1000:.0f} ms (evaluated {res.gen.n_prompt_tokens_evaluated})")
        ratio = statistics.median(a / b for a, b in zip(loop_s, plain_s))
        out.update(new_tokens=statistics.median(new_tokens), after_result_ms=statistics.median(loop_s) * 1000,
                   plain_prefill_ms=statistics.median(plain_s) * 1000, ratio=ratio)
        out.update(crash_restart(host, work, cycles, log))
    finally:
        host.close()
    return out


def demo_server() -> "Any":
    """Ebb's own demo MCP server (`ebb-engine mcp-demo`), as this Ebb starts itself (the
    bundle's launcher when frozen)."""
    from engine.paths import engine_argv
    from engine.tools.servers import ServerDef

    argv = engine_argv()
    return ServerDef("demo", command=argv[0], args=(*argv[1:], "mcp-demo"))


def crash_restart(host: Any, work: Path, cycles: int, log: Callable[[str], None]) -> dict[str, Any]:
    """A server that ends mid-call, restarted `cycles` times; a cycle that does not settle (ready,
    then failed after its call) within 60 s is a hang."""
    from engine.tools.servers import ServerDef

    script = work / "crashes.py"
    script.write_text(CRASH_SERVER)
    d = ServerDef("crashes", command=sys.executable, args=(str(script),))
    host.set_servers([demo_server(), d], lambda x: True)
    hangs = failed_cleanly = 0
    t0 = time.perf_counter()
    for i in range(cycles):
        if i:
            host.restart("crashes")
        if not host.settled(60, until=lambda st: any(x.name == "crashes" and x.phase == "ready" for x in st)):
            hangs += 1
            continue
        done = threading.Event()
        outcome: list[Any] = []

        def go() -> None:
            outcome.append(host.call("crashes", "crash", {}))
            done.set()
        threading.Thread(target=go, daemon=True).start()
        if not done.wait(60):
            hangs += 1
            continue
        failed_cleanly += outcome[0].state == "failed"
        if (i + 1) % 25 == 0:
            log(f"crash and restart: {i + 1} of {cycles}, {hangs} hangs")
    return {"crash_cycles": cycles, "crash_hangs": hangs, "crash_failed_cleanly": failed_cleanly,
            "crash_cycle_s": (time.perf_counter() - t0) / max(1, cycles)}
