"""Ebb's local server beside llama-cpp-python's own (`llama_cpp.server`), on the same model,
context, threads and flash-attention setting: `ebb-engine bench serve`.

Both servers run at once, each loaded once; every round asks each the same three things,
alternating which goes first, streamed and greedy:

- a new conversation (a prompt neither has seen: the round's number is in it): time to the
  first token (llama_cpp.server is asked for no repeat penalty, as Ebb applies none: its own
  default of 1.1 would change the reply);
- the same reply's generation speed: tokens after the first ÷ the time after the first;
- a follow-up that resends the whole history with one more question (what chat clients do):
  time to its first token, where reusing the cached prefix is what counts.

Prints the medians and ratios as speeds, Ebb ÷ peer (over 1.0: Ebb faster; the goal is ≥ 1.0
on each). The timings are the client's: HTTP and JSON are in both.
"""
from __future__ import annotations

import http.client
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

QUESTION = ("Round {n}: in a few sentences, explain why the sea is salty and where the salt "
            "comes from.")
FOLLOW_UP = "Thank you. Now say the same for lakes, briefly."


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Server:
    def __init__(self, name: str, args: list[str], port: int, ready_path: str) -> None:
        import tempfile

        self.name, self.port = name, port
        self.log = tempfile.TemporaryFile("w+")  # a pipe nobody reads would fill and stop it
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{name} ended: {self.log.read()[-2000:]}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", ready_path)
                resp = conn.getresponse()
                body = resp.read()
                conn.close()
                if resp.status == 200 and (ready_path != "/health"
                                           or json.loads(body).get("status") == "ok"):
                    return
            except (OSError, ValueError, http.client.HTTPException):
                pass
            time.sleep(0.2)  # polling a process we started for its port: not a test's sync
        self.stop()
        raise RuntimeError(f"{name} did not become ready")

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, float, int, str]:
        """Streamed, greedy: (seconds to the first token, seconds after it, tokens, text)."""
        ask: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": max_tokens,
                               "temperature": 0, "stream": True, "seed": 1}
        if self.name != "Ebb":  # llama_cpp.server's own default is 1.1; Ebb's (and OpenAI's) none
            ask["repeat_penalty"] = 1.0
        body = json.dumps(ask).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body=body,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        first = last = 0.0
        pieces: list[str] = []
        while True:
            line = resp.readline()
            if not line:
                break
            text = line.decode().strip()
            if not text.startswith("data: ") or text == "data: [DONE]":
                continue
            obj = json.loads(text[6:])
            delta = (obj.get("choices") or [{}])[0].get("delta", {}).get("content")
            if delta:
                now = time.perf_counter()
                first = first or now
                last = now
                pieces.append(delta)
        conn.close()
        return first - t0, last - first, len(pieces), "".join(pieces)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def bench_serve(model: Path, n_ctx: int, threads: int, rounds: int, max_tokens: int = 48,
                flash_attn: bool = True, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    try:
        import llama_cpp.server  # noqa: F401
        import fastapi  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"llama-cpp-python's server needs {exc.name}: it comes with Ebb's "
                           "test extra (make setup installs it)") from None
    ebb_port, peer_port = _free_port(), _free_port()
    servers = {
        "ebb": _Server("Ebb", [sys.executable, "-m", "engine", "serve", "--model", str(model),
                               "--port", str(ebb_port), "--threads", str(threads), "--ctx",
                               str(n_ctx), "--flash-attn", "on" if flash_attn else "off"],
                       ebb_port, "/health"),
    }
    try:
        servers["peer"] = _Server("llama_cpp.server", [
            sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--port",
            str(peer_port), "--host", "127.0.0.1", "--n_threads", str(threads), "--n_threads_batch", str(threads),
            "--n_ctx", str(n_ctx), "--flash_attn", str(flash_attn)], peer_port, "/v1/models")
        runs: dict[str, list[dict[str, float]]] = {"ebb": [], "peer": []}
        same = True
        for n in range(rounds + 1):  # round 0 warms both up and is not counted
            order = ("ebb", "peer") if n % 2 == 0 else ("peer", "ebb")
            texts = {}
            for who in order:
                s = servers[who]
                msgs = [{"role": "user", "content": QUESTION.format(n=n)}]
                ttft, after, n_tok, text = s.chat(msgs, max_tokens)
                msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": FOLLOW_UP}]
                follow_ttft, _, _, _ = s.chat(msgs, 1)
                texts[who] = text
                if n:
                    runs[who].append({"ttft_s": ttft, "gen_tps": (n_tok - 1) / after if after else 0.0,
                                      "follow_up_ttft_s": follow_ttft})
                    log(f"round {n} {who}: first token {ttft:.3f}s, {runs[who][-1]['gen_tps']:.1f} "
                        f"tok/s, follow-up's first token {follow_ttft:.3f}s")
            same = same and texts["ebb"] == texts["peer"]
    finally:
        for s in servers.values():
            s.stop()

    def med(who: str, key: str) -> float:
        return float(statistics.median(r[key] for r in runs[who]))

    out: dict[str, Any] = {"rounds": rounds, "model": str(model), "n_ctx": n_ctx, "threads": threads,
                           "flash_attn": flash_attn, "max_tokens": max_tokens,
                           "same_replies": same, "runs": runs}
    for key, faster_is_lower in (("ttft_s", True), ("gen_tps", False), ("follow_up_ttft_s", True)):
        e, p = med("ebb", key), med("peer", key)
        speed = (p / e if faster_is_lower else e / p) if e and p else 0.0
        out[key] = {"ebb": round(e, 4), "peer": round(p, 4), "speed_ratio": round(speed, 3)}
    return out
