"""`ebb-engine serve`, driven by the official `openai` client (a client we did not write) and by
raw HTTP for what a client library would not send. The server is a real process with the real
model; the accelerator is an RPC server on loopback."""
from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import http.client
import pytest

from tests.conftest import N_THREADS, RpcServer, free_port, run_cli

KEY = "test-key-123"


class Raw:
    """Plain HTTP (the standard library's) for what a client library would not send."""

    def __init__(self, port: int, timeout: float = 120) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)

    def request(self, method: str, path: str, body: bytes | dict | None = None,
                key: str | None = None) -> http.client.HTTPResponse:
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        self.conn.request(method, path, body=data, headers=headers)
        return self.conn.getresponse()

    def call(self, method: str, path: str, body: bytes | dict | None = None,
             key: str | None = None) -> tuple[int, dict, dict]:
        r = self.request(method, path, body, key)
        raw = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(raw) if raw else {}

    def close(self) -> None:
        self.conn.close()


def sse_lines(r: http.client.HTTPResponse):
    while True:
        line = r.readline()
        if not line:
            return
        yield line.decode().rstrip("\r\n")


class Server:
    def __init__(self, *flags: str, api_key: str | None = KEY) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log: list[str] = []
        args = [sys.executable, "-m", "engine", "serve", "--port", str(self.port), "--threads",
                str(N_THREADS), "--ctx", "2048", *flags]
        if api_key:
            args += ["--api-key", api_key]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "serve ended:\n" + "".join(self.log)
            try:
                raw = Raw(self.port, timeout=1)
                ok = raw.call("GET", "/health")[2].get("status") == "ok"
                raw.close()
                if ok:
                    return
            except (OSError, ValueError, http.client.HTTPException):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("serve did not become ready:\n" + "".join(self.log))

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)

    def turns(self) -> list[dict]:
        """The server's own line per answered request."""
        prefix = "ebb-engine serve: "
        return [json.loads(ln[len(prefix):]) for ln in list(self.log) if ln.startswith(prefix)]

    def turns_when(self, ready, timeout: float = 10.0) -> list[dict]:
        """The turns once `ready(turns)` holds: the log line is written before the reply is
        sent, but this process reads the pipe on its own thread."""
        deadline = time.monotonic() + timeout
        while not ready(self.turns()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.turns()

    def client(self, key: str = KEY):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.base}/v1", api_key=key, max_retries=0, timeout=120)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def server(model_path):
    s = Server("--max-body", "1MiB")
    yield s
    s.stop()


def data_url(path: Path) -> str:
    kind = "png" if path.suffix == ".png" else "jpeg"
    return f"data:image/{kind};base64," + base64.b64encode(path.read_bytes()).decode()


def cli_reply(*flags: str) -> str:
    r = run_cli("chat", "--threads", str(N_THREADS), "--ctx", "2048", "--temp", "0", "--json",
                *flags, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])["text"]


# ------------------------------------------------------------------ text


def test_models_and_a_greedy_reply_equal_the_cli(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct.Q4_1"]
    prompt = "Write a short poem about the sea."
    done = client.chat.completions.create(model="any", messages=[{"role": "user", "content": prompt}],
                                          temperature=0, max_tokens=12, seed=1)
    text = done.choices[0].message.content
    assert text and text == cli_reply("--prompt", prompt, "--max-tokens", "12")
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 12 and done.usage.prompt_tokens > 5
    assert done.usage.total_tokens == done.usage.prompt_tokens + 12
    # the same, streamed: the pieces make the same text, [DONE] ends it, usage comes last
    stream = client.chat.completions.create(model="any", messages=[{"role": "user", "content": prompt}],
                                            temperature=0, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_a_json_schema_reply_parses_and_follows_the_schema(server):
    """#29: response_format through llama.cpp's grammar sampling: streamed or not, the reply is
    JSON of the schema's shape (json_object: any JSON object)."""
    client = server.client()
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                                               "sure": {"type": "boolean"}},
              "required": ["colour", "sure"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    msgs = [{"role": "user", "content": "What colour is the sky? Answer in JSON."}]
    done = client.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=40,
                                          response_format=fmt)
    answer = json.loads(done.choices[0].message.content)
    assert answer["colour"] in ("red", "green", "blue") and isinstance(answer["sure"], bool)
    stream = client.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=40,
                                            response_format=fmt, stream=True)
    assert json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)) == answer
    obj = client.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=60,
                                         response_format={"type": "json_object"})
    print(f"\njson_schema: {answer}; json_object: {obj.choices[0].message.content!r}")
    assert obj.choices[0].message.content.lstrip().startswith("{")


def test_logprobs_are_the_models_own(server):
    """#29: each sampled token's log-probability and the top k, from llama.cpp's logits; greedy,
    the sampled token is the most likely one."""
    import math

    client = server.client()
    done = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Name a colour."}], temperature=0,
        max_tokens=6, logprobs=True, top_logprobs=3)
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens == 6
    assert "".join(c.token for c in content) == done.choices[0].message.content
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 3
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob
        assert sum(math.exp(t.logprob) for t in c.top_logprobs) <= 1.0 + 1e-6


@pytest.mark.slow  # make test's time budget: CI runs it in make test-slow
def test_history_system_and_stop_sequences(server):
    client = server.client()
    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "What colour is grass?"},
                {"role": "assistant", "content": "Green."},
                {"role": "user", "content": [{"type": "text", "text": "And the sky?"}]}]
    full = client.chat.completions.create(model="m", messages=messages, temperature=0,
                                          max_tokens=16).choices[0].message.content
    assert full
    cut = full.strip()[1:3]  # a stop sequence from inside the reply: it ends there
    stopped = client.chat.completions.create(model="m", messages=messages, temperature=0,
                                             max_tokens=16, stop=[cut])
    assert stopped.choices[0].message.content == full[:full.index(cut)]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="m", messages=messages, temperature=0,
                                              max_tokens=16, stop=cut, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == full[:full.index(cut)]


def test_a_wrong_key_is_refused(server):
    from openai import AuthenticationError

    with pytest.raises(AuthenticationError) as err:
        server.client("wrong").models.list()
    assert err.value.status_code == 401 and "API key" in err.value.message
    status, headers, body = Raw(server.port).call(
        "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 401 and body["error"]["type"] == "authentication_error"


def test_a_bad_image_is_a_400_and_the_server_keeps_serving(server, tmp_path):
    from openai import BadRequestError

    client = server.client()
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 100)
    for url, says in ((data_url(broken), "image"),
                      ("https://example.com/cat.png", "does not fetch"),
                      ("data:image/png;base64,@@@@", "base64"),
                      (f"file://{tmp_path}/missing.png", "no such image file")):
        with pytest.raises(BadRequestError) as err:
            client.chat.completions.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": url}}]}])
        assert err.value.status_code == 400 and says in err.value.message, err.value.message
    ok = client.chat.completions.create(model="m", max_tokens=3, temperature=0,
                                        messages=[{"role": "user", "content": "Hello"}])
    assert ok.choices[0].message.content


BAD_BODIES = [
    b"", b"not json", b"[]", b"null", b'"text"', b"{}",
    json.dumps({"messages": []}).encode(),
    json.dumps({"messages": "hi"}).encode(),
    json.dumps({"messages": [{"role": "user"}]}).encode(),
    json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(),
    json.dumps({"messages": [{"role": "assistant", "content": "x"}]}).encode(),
    json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(),
    json.dumps({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}).encode(),
    json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
    json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!notbase64!!"}}]}]}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": 9}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "x"}], "stop": [1, 2]}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 2}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "x"}], "seed": True}).encode(),
    b"\xff\xfe\x00garbage",
    b"[" * 100_000 + b"]" * 100_000,  # deeper than the JSON parser recurses
    b'{"messages": [{"role": "user", "content": "x"}], "seed": ' + b"9" * 5000 + b"}",
]


def test_fuzzed_bad_requests_get_a_4xx_each_and_no_crash(server):
    import random

    rng = random.Random(7)
    bodies = list(BAD_BODIES)
    good = json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode()
    bodies += [good[:rng.randrange(1, len(good) - 1)] for _ in range(10)]  # cut short
    bodies += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))) for _ in range(10)]
    for body in bodies:
        raw = Raw(server.port)
        status, _, answer = raw.call("POST", "/v1/chat/completions", body, KEY)
        raw.close()
        assert 400 <= status < 500, (body[:80], status, answer)
        assert answer["error"]["message"], body[:80]
    huge = b'{"messages": [{"role": "user", "content": "' + b"a" * (2 << 20) + b'"}]}'
    status, _, answer = Raw(server.port).call("POST", "/v1/chat/completions", huge, KEY)
    assert status == 413 and "body" in answer["error"]["message"]
    status, _, answer = Raw(server.port).call("GET", "/v1/nothing", None, KEY)
    assert status == 404 and "/v1/chat/completions" in answer["error"]["message"]
    assert server.proc.poll() is None
    assert server.client().models.list().data


@pytest.mark.slow  # make test's time budget: CI runs it in make test-slow
def test_two_clients_at_once_are_answered_in_order(server):
    client = server.client()
    events: list[tuple[str, str]] = []
    lock = threading.Lock()

    def ask(name: str, tokens: int) -> None:
        for c in client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"Tell me about {name}."}],
                temperature=0, max_tokens=tokens, stream=True, user=name):
            if c.choices and c.choices[0].delta.content:
                with lock:
                    events.append((name, "token"))
        with lock:
            events.append((name, "done"))

    first = threading.Thread(target=ask, args=("first", 10))
    first.start()
    deadline = time.monotonic() + 120
    while not any(e[0] == "first" for e in events):  # the first is being answered: the
        assert first.is_alive() and time.monotonic() < deadline, events  # second waits behind
        time.sleep(0.01)
    second = threading.Thread(target=ask, args=("second", 4))
    second.start()
    first.join(120)
    second.join(120)
    names = [n for n, _ in events]
    assert names.count("first") == 11 and names.count("second") == 5, events
    assert names.index("second") > names.index("first") + 10  # after the first was done
    turns = server.turns_when(lambda ts: ts and ts[-1]["client"] == "second")
    assert [t["client"] for t in turns[-2:]] == ["first", "second"]


def test_a_client_that_leaves_mid_stream_frees_the_worker(server):
    body = {"messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
            "max_tokens": 400, "temperature": 0, "stream": True, "user": "leaver"}
    raw = Raw(server.port)
    r = raw.request("POST", "/v1/chat/completions", body, KEY)
    got = 0
    for line in sse_lines(r):
        if line.startswith("data: {") and '"content": "' in line:
            got += 1
            if got == 3:
                break
    r.close()
    raw.close()  # the client leaves mid-stream
    answer = server.client().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0,
        user="next")
    assert answer.choices[0].message.content
    turns = server.turns_when(lambda ts: ts and ts[-1]["client"] == "next")
    left = next(t for t in turns if t["client"] == "leaver")
    assert left["client_gone"] and left["completion_tokens"] < 400, left
    assert turns[-1]["client"] == "next"


@pytest.mark.slow  # make test's time budget: CI runs it in make test-slow
def test_a_full_queue_is_a_503_with_retry_after(model_path):
    s = Server("--queue", "1", api_key=None)
    try:
        body = {"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 300,
                "temperature": 0, "stream": True}
        a, b = Raw(s.port), Raw(s.port)
        busy = a.request("POST", "/v1/chat/completions", body)
        assert busy.status == 200 and next(sse_lines(busy)).startswith("data: ")  # answered now
        waiting = b.request("POST", "/v1/chat/completions", body)
        assert waiting.status == 200  # waits in the queue (its one place)
        status, headers, answer = Raw(s.port).call("POST", "/v1/chat/completions", body)
        assert status == 503 and headers["retry-after"] == "2"
        assert "busy" in answer["error"]["message"]
        busy.close(), waiting.close(), a.close(), b.close()  # both leave
        for _ in range(5):  # as a client does: again after Retry-After, until the server saw them go
            status, headers, answer = Raw(s.port).call("POST", "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
            if status != 503:
                break
            time.sleep(int(headers["retry-after"]))
        assert status == 200 and answer["choices"][0]["message"]["content"]
        turns = s.turns_when(lambda ts: len(ts) >= 2)
        assert turns[-1]["client_gone"] is False and turns[-2]["client_gone"]
    finally:
        s.stop()


# ------------------------------------------------------------------ vision


def _vision_equals_cli(strategy: str, model_path: Path, base_projector: Path, pictures) -> None:
    rpc = RpcServer()
    flags = ("--mmproj", str(base_projector), "--rpc", rpc.endpoint, "--vision", strategy)
    s = Server(*flags, api_key=None)
    try:
        prompt = "Describe the picture."
        out = s.client().chat.completions.create(model="m", temperature=0, max_tokens=10, messages=[
            {"role": "user", "content": [{"type": "text", "text": prompt},
                                         {"type": "image_url", "image_url": {"url": data_url(pictures["a.png"])}}]}])
        text = out.choices[0].message.content
        turn = s.turns_when(lambda ts: bool(ts))[-1]
        assert turn["strategy"] == strategy and turn["n_images"] == 1
    finally:
        s.stop()
    try:
        assert text == cli_reply(*flags, "--prompt", prompt, "--image", str(pictures["a.png"]),
                                 "--max-tokens", "10")
    finally:
        rpc.stop()


@pytest.mark.slow  # a server and a CLI run per strategy, about 75 s each
@pytest.mark.parametrize("strategy", ["swap", "resident", "cpu"])
def test_an_image_through_each_strategy_equals_the_cli(strategy, model_path, base_projector,
                                                       pictures):
    _vision_equals_cli(strategy, model_path, base_projector, pictures)
