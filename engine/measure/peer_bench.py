"""`ebb-engine bench peer`: Ebb's server (`ebb-engine serve --parallel N`) beside llama.cpp's own
`llama-server -np N`, built once from the same vendored llama.cpp into Ebb's cache (or the one
EBB_LLAMA_SERVER names), on the same model, context and threads, through one client script,
alternating which goes first each round:

- one client: the first token of a new conversation, and generation tok/s after it;
- N clients at once (N questions sent together): every reply's tokens ÷ the wall time until the
  last ends, and each first token; and Ebb's N at once ÷ Ebb's one client;
- a reply that copies what the prompt gave (a list to repeat): generation tok/s, where Ebb's
  n-gram drafts pay (this llama.cpp's server drafts only with a draft model).

Prints medians and ratios (Ebb ÷ llama-server, over 1.0: Ebb faster). Replies are greedy; the
servers' replies may part where the model's choice is close (a batch's arithmetic differs from
one token's), so each side counts its own tokens (the usage the server reports).
"""
from __future__ import annotations

import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from engine.measure.serve_bench import _free_port, _Server

# replies that run to the cap: generation speed is measured over whole replies
QUESTIONS = [f"Round {{n}}: write a long story about {what}." for what in (
    "a lighthouse keeper who finds a message in a bottle", "a girl who builds a robot from scrap",
    "a baker who opens a shop on the moon", "an old dog who learns a new trick",
    "a sailor lost in a storm", "a town where it never stops snowing",
    "a musician who loses her voice", "a boy who can talk to birds")]
COPY = ("Here is my shopping list:\n\n1. Apples, two kilos\n2. Bread, one loaf\n3. Milk, two litres\n"
        "4. Eggs, a dozen\n5. Rice, one bag\n6. Tea, one box\n\nWrite it out again exactly as it is.")


def llama_server(log: Callable[[str], None]) -> Path:
    """llama.cpp's llama-server: EBB_LLAMA_SERVER, else the one built in Ebb's cache from the
    llama.cpp source the setup unpacked there (built now, once, ~10 minutes on 2 cores)."""
    given = os.environ.get("EBB_LLAMA_SERVER")
    if given:
        if not (Path(given).is_file() and os.access(given, os.X_OK)):
            raise RuntimeError(f"EBB_LLAMA_SERVER names {given}, which is not a program")
        return Path(given)
    from engine.paths import cache_dir

    root = cache_dir() / "llama-server"
    binary = root / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    source = _llama_source()
    log(f"building llama-server from {source} into {root} (once)")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "build.log", "w") as out:
        for cmd in (["cmake", "-S", str(source), "-B", str(root / "build"), "-DCMAKE_BUILD_TYPE=Release",
                     "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"],
                    ["cmake", "--build", str(root / "build"), "--target", "llama-server", "-j",
                     str(os.cpu_count() or 2)]):
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise RuntimeError(f"building llama-server failed: see {root / 'build.log'}")
    return binary


def _llama_source() -> Path:
    from importlib import metadata

    from engine.paths import cache_dir

    version = metadata.version("llama_cpp_python")
    src = cache_dir() / "src" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        raise RuntimeError(f"llama.cpp's source is not in {src}: run `make setup` (it unpacks "
                           "it there), or name a llama-server with EBB_LLAMA_SERVER")
    return src


def _ask(port: int, content: str, max_tokens: int) -> dict[str, float]:
    """One streamed greedy chat reply: seconds to its first token, its end, and its tokens."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    first, pieces, tokens = 0.0, 0, 0
    while line := resp.readline():
        text = line.decode().strip()
        if not text.startswith("data: ") or text == "data: [DONE]":
            continue
        obj = json.loads(text[6:])
        if (obj.get("usage") or {}).get("completion_tokens"):
            tokens = int(obj["usage"]["completion_tokens"])
        if (obj.get("choices") or [{}])[0].get("delta", {}).get("content"):
            first = first or time.perf_counter()
            pieces += 1
    end = time.perf_counter()
    conn.close()
    return {"first_s": (first or end) - t0, "end_s": end - t0, "tokens": tokens or pieces,
            "gen_s": end - (first or end)}


def _together(port: int, contents: list[str], max_tokens: int) -> dict[str, Any]:
    out: list[dict[str, float]] = [{} for _ in contents]
    go = threading.Barrier(len(contents) + 1)

    def one(i: int) -> None:
        go.wait()
        out[i] = _ask(port, contents[i], max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(contents))]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    go.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"tok_s": sum(r["tokens"] for r in out) / wall, "first_s": sorted(r["first_s"] for r in out),
            "tokens": [r["tokens"] for r in out]}


def bench_peer(model: Path, n_ctx: int, threads: int, rounds: int, max_tokens: int, clients: int,
               log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    binary = llama_server(log)
    ebb_port, peer_port = _free_port(), _free_port()
    servers: dict[str, _Server] = {}
    try:
        servers["ebb"] = _Server("Ebb", [sys.executable, "-m", "engine", "serve", "--model", str(model),
                                         "--port", str(ebb_port), "--threads", str(threads), "--ctx",
                                         str(n_ctx), "--parallel", str(clients)], ebb_port, "/health")
        servers["peer"] = _Server("llama-server", [str(binary), "-m", str(model), "--port", str(peer_port),
                                                   "-c", str(n_ctx * 2), "-np", str(clients), "-t", str(threads),
                                                   "-tb", str(threads)], peer_port, "/health")
        ports = {"ebb": ebb_port, "peer": peer_port}
        seen: dict[str, dict[str, list[Any]]] = {w: {"one": [], "many": [], "copy": []} for w in ports}
        for n in range(rounds + 1):  # round 0 warms both up and is not counted
            for who in (("ebb", "peer") if n % 2 == 0 else ("peer", "ebb")):
                port = ports[who]
                one = _ask(port, QUESTIONS[0].format(n=n), max_tokens)
                many = _together(port, [QUESTIONS[i % len(QUESTIONS)].format(n=n) for i in range(clients)],
                                 max_tokens)
                copy = _ask(port, COPY, max_tokens)
                if not n:
                    continue
                seen[who]["one"].append(one)
                seen[who]["many"].append(many)
                seen[who]["copy"].append(copy)
                log(f"round {n} {who}: one client first token {one['first_s']:.3f}s, "
                    f"{_gen_tps(one):.1f} tok/s; {clients} at once {many['tok_s']:.1f} tok/s in all, "
                    f"first tokens {', '.join(f'{s:.2f}' for s in many['first_s'])} s; copy "
                    f"{_gen_tps(copy):.1f} tok/s")
    finally:
        for s in servers.values():
            s.stop()
    return _summary(seen, model, n_ctx, threads, rounds, max_tokens, clients, binary)


def _gen_tps(r: dict[str, float]) -> float:
    return (r["tokens"] - 1) / r["gen_s"] if r["gen_s"] > 0 else 0.0


def _summary(seen: dict[str, dict[str, list[Any]]], model: Path, n_ctx: int, threads: int,
             rounds: int, max_tokens: int, clients: int, binary: Path) -> dict[str, Any]:
    def med(who: str, what: str, f: Callable[[Any], float]) -> float:
        return float(statistics.median(f(r) for r in seen[who][what]))

    rows: dict[str, dict[str, float]] = {}
    for key, what, f, lower in (("first_token_s", "one", lambda r: r["first_s"], True),
                                ("gen_tok_s", "one", _gen_tps, False),
                                ("many_tok_s", "many", lambda r: r["tok_s"], False),
                                ("many_last_first_token_s", "many", lambda r: r["first_s"][-1], True),
                                ("copy_tok_s", "copy", _gen_tps, False)):
        e, p = med("ebb", what, f), med("peer", what, f)
        rows[key] = {"ebb": round(e, 4), "peer": round(p, 4),
                     "ratio": round((p / e if lower else e / p) if e and p else 0.0, 3)}
    one_total = med("ebb", "one", lambda r: r["tokens"] / r["end_s"])
    rows["many_vs_one"] = {"ebb": round(rows["many_tok_s"]["ebb"] / one_total, 3) if one_total else 0.0}
    return {"model": model.name, "n_ctx": n_ctx, "threads": threads, "rounds": rounds,
            "max_tokens": max_tokens, "clients": clients, "peer": str(binary), "rows": rows}
