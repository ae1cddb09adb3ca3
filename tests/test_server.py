"""`ebb-engine serve`, driven by the official `openai` client (a client we did not write) and by
raw HTTP for what a client library would not send. The server is a real process with the real
model; the accelerator is an RPC server on loopback."""
from __future__ import annotations

import base64
import http.client
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from tests.helpers import N_THREADS, RpcServer, agree_where_decided, free_port, run_cli

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
    def __init__(self, *flags: str, api_key: str | None = KEY, parallel: str | None = "1") -> None:
        """`parallel`: 1 by default, the session alone, whose replies are the CLI's SAME PATH
        (several at once turn flash attention on: engine/config.py); None: serve's own default."""
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log: list[str] = []
        self.logged = threading.Condition()
        args = [sys.executable, "-m", "engine", "serve", "--port", str(self.port), "--threads",
                str(N_THREADS), "--ctx", "2048", *flags, *(("--parallel", parallel) if parallel else ())]
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
            with self.logged:
                self.log.append(line)
                self.logged.notify_all()

    def wait_log(self, needle: str, timeout: float = 60) -> None:
        """Until a line of the server's log holds `needle` (read on the reader's thread)."""
        with self.logged:
            assert self.logged.wait_for(lambda: any(needle in ln for ln in self.log), timeout), \
                f"no {needle!r} in the server's log:\n" + "".join(self.log)

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


@pytest.mark.numerics
def test_models_and_a_greedy_reply_equal_the_cli(server):
    """The first reply is SAME PATH as the CLI's: the server's first request, from an empty
    cache, evaluates the prompt in one batch as the CLI does. The streamed one reuses the
    cached prompt but its last token: DECIDED (tests/helpers.py), by their logprobs."""
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert client.models.retrieve("SmolLM2-135M-Instruct.Q4_1").id == "SmolLM2-135M-Instruct.Q4_1"
    from openai import NotFoundError

    with pytest.raises(NotFoundError):
        client.models.retrieve("gpt-4")
    # a reply the model decides from its first step (the streamed one is compared DECIDED)
    prompt = "Repeat after me: the cat sat on the mat, and the dog sat on the log by the door."
    done = client.chat.completions.create(model="any", messages=[{"role": "user", "content": prompt}],
                                          temperature=0, max_tokens=12, seed=1, logprobs=True,
                                          top_logprobs=2)
    text = done.choices[0].message.content
    assert text and text == cli_reply("--prompt", prompt, "--max-tokens", "12")
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 12 and done.usage.prompt_tokens > 5
    assert done.usage.total_tokens == done.usage.prompt_tokens + 12
    # the same, streamed: the pieces make the same text, [DONE] ends it, usage comes last
    stream = client.chat.completions.create(model="any", messages=[{"role": "user", "content": prompt}],
                                            temperature=0, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True},
                                            logprobs=True, top_logprobs=2)
    chunks = list(stream)
    streamed = [lp.model_dump() for c in chunks if c.choices and c.choices[0].logprobs
                for lp in c.choices[0].logprobs.content or []]
    whole = [lp.model_dump() for lp in done.choices[0].logprobs.content]
    assert len(streamed) == 12 and "".join(c.choices[0].delta.content or "" for c in chunks
                                           if c.choices).strip()
    agree_where_decided(streamed, whole)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert [c.usage is not None for c in chunks].count(True) == 1  # once: a client sums chunks
    plain = list(client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=2,
        stream=True))
    assert all(c.usage is None for c in plain)  # not asked for: not sent


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
    # the streamed reply reuses the cached prompt (another evaluation path): its own shape
    streamed = json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    assert streamed["colour"] in ("red", "green", "blue") and isinstance(streamed["sure"], bool)
    obj = client.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=60,
                                         response_format={"type": "json_object"})
    print(f"\njson_schema: {answer}; json_object: {obj.choices[0].message.content!r}")
    assert obj.choices[0].message.content.lstrip().startswith("{")
    # a cap that cuts a rambling reply still ends in one whole JSON value (#52: it was cut
    # inside a string, "f/f/f…", where llama-cpp-python's server stopped with valid JSON)
    for cap in (12, 40):
        capped = client.chat.completions.create(
            model="m", temperature=0.8, seed=3, max_tokens=cap, response_format={"type": "json_object"},
            messages=[{"role": "user", "content": "Describe the weather in Paris as JSON, in detail."}])
        assert isinstance(json.loads(capped.choices[0].message.content), dict)
        assert capped.usage.completion_tokens <= cap


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
    # streamed: each chunk carries the entries of the tokens its text is made of
    chunks = [c for c in client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Name a colour."}], temperature=0,
        max_tokens=6, logprobs=True, top_logprobs=3, stream=True) if c.choices and c.choices[0].delta.content]
    streamed = [e for c in chunks for e in c.choices[0].logprobs.content]
    assert all("".join(e.token for e in c.choices[0].logprobs.content) == c.choices[0].delta.content
               for c in chunks)
    assert len(streamed) == 6
    for e in streamed:  # the same checks as above, for what the stream carried
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
    # (not compared with the first reply's: this request reuses its cached prompt and evaluates
    # only the last token, a batch of another shape; with flash attention off, as on a CPU by
    # default, llama.cpp's sums then differ in the last digits, and near-tied greedy picks can
    # differ: seen "The colour I..." against "The colour is...")


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
    # /health says only whether it is up without the key; with it, what it serves (#52)
    for key in (None, "wrong"):
        assert Raw(server.port).call("GET", "/health", key=key)[2] == {"status": "ok"}
    full = Raw(server.port).call("GET", "/health", key=KEY)[2]
    assert full["status"] == "ok" and full["model"] == "SmolLM2-135M-Instruct.Q4_1"


def test_a_bad_image_is_a_400_and_the_server_keeps_serving(server, tmp_path):
    from openai import BadRequestError

    client = server.client()
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 100)
    for url, says in ((data_url(broken), "image"),
                      ("https://example.com/cat.png", "does not fetch"),
                      ("data:image/png;base64,@@@@", "base64"),
                      (f"file://{tmp_path}/missing.png", "takes no file:// images")):
        with pytest.raises(BadRequestError) as err:
            client.chat.completions.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": url}}]}])
        assert err.value.status_code == 400 and says in err.value.message, err.value.message
    ok = client.chat.completions.create(model="m", max_tokens=3, temperature=0,
                                        messages=[{"role": "user", "content": "Hello"}])
    assert ok.choices[0].message.content


def _hostile(port: int, method: str, path: str, headers: dict[str, str],
             body: bytes = b"") -> tuple[int, dict]:
    """A request as a web page's browser (or anything else) sends it, headers as given."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for k, v in {**headers, "Content-Length": str(len(body))}.items():
            conn.putheader(k, v)
        conn.endheaders(body)
        r = conn.getresponse()
        raw = r.read()
        return r.status, json.loads(raw) if raw else {}
    finally:
        conn.close()


def test_web_pages_and_rebound_host_names_get_nothing(server):
    """What a page on another site can send without a preflight, and a DNS-rebound host name,
    are refused before any model work; the server's own names and JSON bodies still work."""
    me = f"127.0.0.1:{server.port}"
    chat = json.dumps({"messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 2})
    auth = {"Authorization": f"Bearer {KEY}"}
    before = Raw(server.port).call("GET", "/health", key=KEY)[2]["served"]
    cases = [  # (headers, expected status, error code)
        ({"Host": me, "Origin": "http://evil.example", "Content-Type": "text/plain"}, 403,
         "origin_not_allowed"),
        ({"Host": me, "Origin": "null", "Content-Type": "application/json"}, 403,
         "origin_not_allowed"),
        ({"Host": me, "Content-Type": "text/plain"}, 415, "unsupported_media_type"),
        ({"Host": me, "Content-Type": "application/x-www-form-urlencoded"}, 415,
         "unsupported_media_type"),
        ({"Host": f"evil.example:{server.port}", "Content-Type": "application/json"}, 403,
         "host_not_allowed"),
        ({"Host": "", "Content-Type": "application/json"}, 403, "host_not_allowed"),
    ]
    for headers, status, code in cases:
        got, body = _hostile(server.port, "POST", "/v1/chat/completions", {**headers, **auth},
                             chat.encode())
        assert (got, body["error"]["code"]) == (status, code), (headers, body)
    got, body = _hostile(server.port, "GET", "/v1/models",
                         {"Host": me, "Origin": "http://evil.example", **auth})
    assert got == 403 and body["error"]["code"] == "origin_not_allowed"
    assert Raw(server.port).call("GET", "/health", key=KEY)[2]["served"] == before  # nothing ran
    for host in (me, f"localhost:{server.port}", "localhost"):
        got, body = _hostile(server.port, "POST", "/v1/chat/completions",
                             {"Host": host, "Content-Type": "application/json; charset=utf-8",
                              **auth}, chat.encode())
        assert got == 200 and body["choices"][0]["message"]["content"] is not None, (host, body)


def test_file_images_are_off_and_say_nothing_of_what_exists(server, tmp_path):
    """A file:// URL is refused with one message whether the file exists, is a picture, or
    not; a data URL that is no picture says so without a server path."""
    pic = tmp_path / "pic.png"
    Image.new("RGB", (8, 8), (1, 2, 3)).save(pic)
    messages = []
    for url in ("file:///etc/passwd", f"file://{tmp_path}/missing.png", f"file://{pic}"):
        status, _, body = Raw(server.port).call("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]},
            key=KEY)
        assert status == 400 and body["error"]["code"] == "file_images_off", body
        messages.append(body["error"]["message"])
    assert len(set(messages)) == 1  # the same whether it exists, is a picture, or not
    assert str(tmp_path) not in messages[0] and "/etc" not in messages[0]
    junk = "data:image/png;base64," + base64.b64encode(b"root:x:0:0:root:/root:/bin/bash\n").decode()
    status, _, body = Raw(server.port).call("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": junk}}]}]},
        key=KEY)
    assert status == 400 and "not a picture" in body["error"]["message"]
    assert "/tmp" not in body["error"]["message"] and ".img" not in body["error"]["message"]


def test_allowed_files_come_only_from_inside_the_folder(tmp_path):
    """--allow-files FOLDER: a picture inside it is used; outside it, through a link out of
    it, missing, inside but not a picture or too large: one message, with no path."""
    from engine.server.api.chat import Attachment, parse_chat_request
    from engine.server.errors import ApiError
    from engine.server.answering import attachment_path
    from engine.server.jobs import Job

    folder, outside = tmp_path / "shared", tmp_path / "private"
    folder.mkdir()
    outside.mkdir()
    Image.new("RGB", (8, 8)).save(folder / "in.png")
    Image.new("RGB", (8, 8)).save(outside / "out.png")
    (folder / "link.png").symlink_to(outside / "out.png")
    (folder / "notes.png").write_text("not a picture")  # inside, but no picture (#52)
    with open(folder / "huge.png", "wb") as f:  # inside, but over the size limit (sparse)
        f.truncate(2048 * 2**20)
    job = Job(parse_chat_request({"messages": [{"role": "user", "content": "x"}]}), "c",
              lambda ev: None, image_folder=folder)
    assert attachment_path(job, Attachment(path=folder / "in.png")) == (folder / "in.png").resolve()
    refused = set()
    for path in (outside / "out.png", folder / "link.png", folder / "missing.png",
                 folder / ".." / "private" / "out.png", folder, folder / "notes.png",
                 folder / "huge.png"):
        with pytest.raises(ApiError) as err:
            attachment_path(job, Attachment(path=path))
        refused.add((err.value.status, err.value.message))
    assert len(refused) == 1  # one message: nothing said of what exists or why
    assert str(tmp_path) not in next(iter(refused))[1]


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium not installed")
def test_a_page_on_another_origin_in_a_real_browser_gets_nothing(server, tmp_path):
    """Headless Chromium opens a page from another origin that tries what a hostile page
    would: a "simple" text/plain POST (no preflight), a JSON POST (preflight) and a GET. No
    request runs the model and the page reads nothing back."""
    import http.server
    import socketserver

    page = tmp_path / "index.html"
    target = f"http://127.0.0.1:{server.port}"
    page.write_text(f"""<!doctype html><title>hostile</title><body><pre id=out>pending</pre><script>
const body = JSON.stringify({{messages: [{{role: "user", content: "Say yes."}}], max_tokens: 2}});
const tries = [
  fetch("{target}/v1/chat/completions", {{method: "POST", mode: "no-cors",
        headers: {{"Content-Type": "text/plain"}}, body}}).then(r => "status unreadable, " + r.type),
  fetch("{target}/v1/chat/completions", {{method: "POST",
        headers: {{"Content-Type": "application/json", "Authorization": "Bearer {KEY}"}}, body}})
        .then(r => r.text()),
  fetch("{target}/v1/models").then(r => r.text()),
];
Promise.all(tries.map(p => p.then(v => "read: " + v, e => "blocked: " + e)))
  .then(rs => {{ document.getElementById("out").textContent = rs.join("\\n"); }});
</script></body>""")
    before = Raw(server.port).call("GET", "/health", key=KEY)[2]["served"]

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    handler = lambda *a, **k: Quiet(*a, directory=str(tmp_path), **k)  # noqa: E731
    with socketserver.TCPServer(("127.0.0.1", 0), handler) as site:
        threading.Thread(target=site.serve_forever, daemon=True).start()
        r = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu",
                            "--virtual-time-budget=15000", "--dump-dom",
                            f"http://127.0.0.1:{site.server_address[1]}/index.html"],
                           capture_output=True, text=True, timeout=120)
        site.shutdown()
    out = r.stdout[r.stdout.find("<pre"):r.stdout.find("</pre>")]
    print("\nthe page saw:", out)
    lines = out.split(">", 1)[-1].splitlines()
    assert lines[0] == "read: status unreadable, opaque", r.stdout[-3000:]  # no-cors: a blind send
    assert len(lines) == 3 and all(ln.startswith("blocked: ") for ln in lines[1:]), lines
    assert Raw(server.port).call("GET", "/health", key=KEY)[2]["served"] == before  # nothing ran


def test_llama_cpp_sampler_fields_are_honoured(server, text_runtime):
    """What clients tuned for local servers send: logit_bias changes a greedy reply as asked,
    grammar shapes it, penalties and top_k / min_p are taken; a bias on a token the model does
    not have and a grammar llama.cpp refuses are 400s."""
    client = server.client()
    ask = {"model": "m", "temperature": 0, "max_tokens": 6,
           "messages": [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]}
    plain = client.chat.completions.create(**ask, logprobs=True, top_logprobs=1)
    first = plain.choices[0].logprobs.content[0].token
    (first_id,) = text_runtime.tokenize(first, add_special=False)  # the same model's vocabulary
    banned = client.chat.completions.create(**ask, logprobs=True, top_logprobs=1,
                                            logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.content[0].token != first  # the greedy pick is gone
    knobs = client.chat.completions.create(**ask, extra_body={
        "top_k": 5, "min_p": 0.1, "repeat_penalty": 1.1, "presence_penalty": 0.5,
        "frequency_penalty": 0.5})
    assert knobs.choices[0].message.content  # every knob at once is taken
    forced = client.chat.completions.create(**ask, extra_body={"grammar": 'root ::= "maybe" "."'})
    assert forced.choices[0].message.content == "maybe."
    status, _, body = Raw(server.port).call("POST", "/v1/chat/completions", {
        **ask, "logit_bias": {"99999999": -100}}, key=KEY)
    assert status == 400 and "vocabulary" in body["error"]["message"], body
    status, _, body = Raw(server.port).call("POST", "/v1/chat/completions", {
        **ask, "grammar": 'root ::= "unclosed'}, key=KEY)
    assert status == 400 and "grammar" in body["error"]["message"], body
    status, _, body = Raw(server.port).call("POST", "/v1/chat/completions", {
        **ask, "presence_penalty": 3}, key=KEY)
    assert status == 400 and body["error"]["param"] == "presence_penalty"


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
    json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 9}).encode(),
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
    """SAME PATH: the server's first request and the CLI's turn are one session's first turn with
    the same flags, threads and context (the picture encoded by the same strategy), each from
    an empty cache."""
    rpc = RpcServer()
    # no pictures kept on disk: each strategy encodes (the CLI keeps none by default)
    flags = ("--mmproj", str(base_projector), "--rpc", rpc.endpoint, "--vision", strategy,
             "--memory-disk", "0")
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


# ------------------------------------------------------------------ tools, completions, embeddings (#29)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}


def test_the_official_clients_tool_calling_loop(server):
    """#29: a call that follows the function's schema (streamed: its arguments as written), then the call
    and its result go back in the history and the model answers in text."""
    client = server.client()
    msgs: list = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = client.chat.completions.create(model="m", messages=msgs, tools=[WEATHER],
                                           tool_choice="required", temperature=0, max_tokens=80)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.type == "function" and call.id
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str) and args["unit"] in ("C", "F")
    streamed = list(client.chat.completions.create(model="m", messages=msgs, tools=[WEATHER],
                                                   tool_choice="required", temperature=0,
                                                   max_tokens=80, stream=True))
    calls = [tc for c in streamed if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    # streamed as written: the first delta names the call, the others add to its arguments
    assert calls[0].function.name == "get_weather" and calls[0].id and calls[0].index == 0
    assert len(calls) > 2 and all(tc.index == 0 and not tc.id for tc in calls[1:])
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == args
    assert not any(c.choices[0].delta.content for c in streamed if c.choices)
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "tool_calls"
    # the loop: the client sends the call (the message object itself) and the tool's result
    msgs += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "4 degrees, rain"}]
    final = client.chat.completions.create(model="m", messages=msgs, tools=[WEATHER],
                                           tool_choice="none", temperature=0, max_tokens=20)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    # auto: the model picks; whichever it is, it is well formed
    auto = client.chat.completions.create(model="m", messages=msgs, tools=[WEATHER],
                                          temperature=0, max_tokens=60).choices[0]
    print(f"\ncall: {args}; after the result: {final.choices[0].message.content!r}; "
          f"auto: {auto.finish_reason} {auto.message.content or auto.message.tool_calls}")
    if auto.finish_reason == "tool_calls":
        assert set(json.loads(auto.message.tool_calls[0].function.arguments)) == {"city", "unit"}
    else:
        assert auto.message.content and not auto.message.content.lstrip().startswith("{")


BARE = """
import json, sys
from llama_cpp import LLAMA_POOLING_TYPE_MEAN, Llama
model, threads, what, arg = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
if what == "complete":
    llm = Llama(model, n_ctx=2048, n_threads=threads, flash_attn=False, logits_all=True,  # logprobs
                verbose=False)  # flash attention off: as auto on a CPU
    out = llm.create_completion(arg, max_tokens=12, temperature=0, logprobs=2)
    print(json.dumps({"text": out["choices"][0]["text"], "n_prompt": len(llm.tokenize(arg.encode())),
                      "logprobs": out["choices"][0]["logprobs"]}, default=float))
else:
    llm = Llama(model, n_ctx=512, n_threads=threads, embedding=True,
                pooling_type=LLAMA_POOLING_TYPE_MEAN, verbose=False)
    texts = json.loads(arg)
    print(json.dumps({"vectors": [llm.embed(t, normalize=True) for t in texts],
                      "n_tokens": sum(len(llm.tokenize(t.encode())) for t in texts)}))
"""


def bare(model_path, what: str, arg: str) -> dict:
    """llama-cpp-python's own Llama on the same model, the peer the endpoints are checked
    against, in a process of its own (this one has RPC devices registered by earlier tests,
    which a Llama here would try to use)."""
    r = subprocess.run([sys.executable, "-c", BARE, str(model_path), str(N_THREADS), what, arg],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _legacy_entries(lp: Any) -> list[dict[str, Any]]:
    """/v1/completions' logprobs (tokens, token_logprobs, top_logprobs as dicts), as the
    entries `agree_where_decided` compares."""
    lp = lp if isinstance(lp, dict) else lp.model_dump()
    return [{"token": t, "bytes": list(t.encode()), "logprob": p,
             "top_logprobs": [{"token": k, "logprob": v} for k, v in sorted(top.items(), key=lambda kv: -kv[1])]}
            for t, p, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])]


def test_completions_equal_the_bare_librarys(server, model_path):
    """#29: /v1/completions is the prompt as it is (no chat template), greedy what
    llama-cpp-python's create_completion gives: DECIDED against it (another program: its prompt
    threads default to the machine's cores). Then streamed, echoed and with logprobs, each
    SAME PATH as a plain request made after the first (every one from the cached prompt, its
    last token evaluated again)."""
    client = server.client()
    prompt = "Monday, Tuesday, Wednesday, Thursday,"  # decided from its first step
    peer = bare(model_path, "complete", prompt)
    first = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0,
                                      logprobs=2)
    agree_where_decided(_legacy_entries(first.choices[0].logprobs), _legacy_entries(peer["logprobs"]), at_least=2)
    assert first.choices[0].finish_reason == "length"
    assert first.usage.completion_tokens == 12 and first.usage.prompt_tokens == peer["n_prompt"]
    done = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0)
    want = done.choices[0].text
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 12
    streamed = list(client.completions.create(model="m", prompt=prompt, max_tokens=12,
                                              temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "length"
    echoed = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == prompt + want
    lp = client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0,
                                   logprobs=2).choices[0].logprobs
    assert "".join(lp.tokens) == want[:len("".join(lp.tokens))] and len(lp.tokens) == 4
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0


def test_embeddings_equal_the_bare_librarys_mean(server, model_path):
    """#29: /v1/embeddings from the loaded model, mean-pooled and unit length, as
    llama-cpp-python's embed gives them; floats or base64; the chat is unaffected."""
    import math
    import struct

    texts = ["A red apple.", "The sea is calm tonight, and the tide is full."]
    peer = bare(model_path, "embed", json.dumps(texts))
    want = peer["vectors"]
    client = server.client()
    got = client.embeddings.create(model="m", input=texts)
    assert [d.index for d in got.data] == [0, 1]
    for g, w in zip(got.data, want):
        assert len(g.embedding) == len(w) == 576
        assert abs(math.sqrt(sum(x * x for x in g.embedding)) - 1) < 1e-4
        assert sum(a * b for a, b in zip(g.embedding, w)) > 0.999  # cosine
    assert got.usage.prompt_tokens == peer["n_tokens"]
    status, _, body = Raw(server.port).call("POST", "/v1/embeddings", {
        "model": "m", "input": texts[0], "encoding_format": "base64"}, key=KEY)
    assert status == 200
    packed = base64.b64decode(body["data"][0]["embedding"])
    assert struct.unpack(f"<{len(packed) // 4}f", packed) == pytest.approx(got.data[0].embedding, abs=1e-6)
    status, _, body = Raw(server.port).call("POST", "/v1/embeddings", {
        "model": "m", "input": "x", "dimensions": 64}, key=KEY)
    assert status == 400 and body["error"]["param"] == "dimensions"
    models = Raw(server.port).call("GET", "/v1/models", key=KEY)[2]["data"][0]
    assert {"completions", "embeddings", "tools"} <= set(models["capabilities"])


# ------------------------------------------------------------------ a template's own tool format

HERMES_TEMPLATE = Path(__file__).parent / "templates" / "hermes-tools.jinja"
# bounded arguments: the hermes test model has random weights, and a free string could run on
FORECAST = {"type": "function", "function": {
    "name": "get_forecast", "description": "Tomorrow's or today's weather in Oslo",
    "parameters": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["C", "F"]},
                                                    "tomorrow": {"type": "boolean"}},
                   "required": ["unit", "tomorrow"]}}}


@pytest.fixture(scope="module")
def hermes_model(tmp_path_factory, model_path):
    """A tiny model (random weights, SmolLM2's tokenizer) whose chat template lists tools itself
    in the Hermes format, as Qwen2.5's and Qwen3's do (the template is Ebb's own)."""
    from engine.synth.model_gen import SHAPES, write_model

    out = tmp_path_factory.mktemp("hermes") / "hermes-tiny.gguf"
    return write_model(out, SHAPES["tiny"], model_path, chat_template=HERMES_TEMPLATE.read_text())


def _forecast_follow_up(model, fmt: str, system: str | None = None, last_user: bool = True):
    """A follow-up after a forecast call and its result, with calls required, answered on
    `model` (whose template teaches tool format `fmt`): the prompt the reply answered, and
    the answer. `last_user`: a user message after the result (else the result is last, as
    Mistral's template wants: it allows no two user messages without a reply between)."""
    from engine.server.api.chat import parse_chat_request
    from engine.tools.calls import template_format
    from engine.server.answering import answer_job
    from engine.server.jobs import Job
    from engine.session import Session, SessionConfig

    called = '{"unit": "C", "tomorrow": false}'
    req = parse_chat_request({"model": "m", "tools": [FORECAST], "tool_choice": "required",
                              "max_tokens": 60, "temperature": 0, "messages": [
        *([{"role": "system", "content": system}] if system else []),
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_forecast", "arguments": called}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4 degrees, rain"},
        *([{"role": "user", "content": "And tomorrow?"}] if last_user else [])]})
    with Session(SessionConfig(model, n_ctx=1024, n_threads=N_THREADS)) as s:
        assert s.model.runtime is not None and template_format(s.model.runtime.template_source) == fmt
        s, ans = answer_job(s, Job(req, "test", lambda ev: None), None)
        prompt, _ = s.model.runtime.format_chat(s.messages[:-1], s.chat.tools)  # what the reply answered
    return prompt, ans


def _is_one_forecast_call(ans) -> None:
    """The answer is one call of get_forecast, its arguments as the schema allows."""
    assert ans.finish_reason == "tool_calls" and ans.text == ""
    (call,) = ans.tool_calls
    assert call["function"]["name"] == "get_forecast"
    args = json.loads(call["function"]["arguments"])
    assert args["unit"] in ("C", "F") and isinstance(args["tomorrow"], bool)


def test_a_template_with_its_own_tool_format_is_given_the_tools_calls_and_results(hermes_model):
    """#29: with a template that knows tools, the tools, the assistant's call and the tool's
    result reach the template as they came (no universal system text), and the reply is held
    to the template's <tool_call> block."""
    from engine.tools.calls import HERMES

    prompt, ans = _forecast_follow_up(hermes_model, HERMES, system="Be brief.")
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and "<tools>\n{" in prompt
    assert '"name": "get_forecast"' in prompt and "You can call these functions" not in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_forecast", "arguments": '
            '{"unit": "C", "tomorrow": false}}\n</tool_call><|im_end|>') in prompt
    assert "<|im_start|>user\n<tool_response>\n4 degrees, rain\n</tool_response>\n<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n")
    _is_one_forecast_call(ans)


LLAMA3_TEMPLATE = Path(__file__).parent / "templates" / "llama3-tools.jinja"


def test_a_llama3_template_gets_its_own_json_calls_and_ipython_results(tmp_path, model_path):
    """#29: Llama 3.1's format: the tools in the first user turn, the earlier call written back
    as {"name", "parameters"}, its result in an ipython turn, and the reply held to such a call
    (read back into OpenAI's shape)."""
    from engine.synth.model_gen import SHAPES, write_model
    from engine.tools.calls import LLAMA3

    model = write_model(tmp_path / "llama3-tiny.gguf", SHAPES["tiny"], model_path,
                        chat_template=LLAMA3_TEMPLATE.read_text())
    prompt, ans = _forecast_follow_up(model, LLAMA3)
    assert "Environment: ipython" in prompt and '"name": "get_forecast"' in prompt
    assert "You can call these functions" not in prompt  # not the universal system text
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_forecast", '
            '"parameters": {"unit": "C", "tomorrow": false}}<|eot_id|>') in prompt
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n4 degrees, rain<|eot_id|>" in prompt
    assert prompt.endswith("And tomorrow?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    _is_one_forecast_call(ans)


MISTRAL_TEMPLATE = Path(__file__).parent / "templates" / "mistral-tools.jinja"


def test_a_mistral_template_gets_its_tool_calls_with_ids_it_accepts(tmp_path, model_path):
    """#29: Mistral's format: the tools in [AVAILABLE_TOOLS], the earlier call written back as
    [TOOL_CALLS] with a 9-character id (the client's "c1" mapped; the template raises on any
    other length), its result in [TOOL_RESULTS] under the same id, and the reply held to one
    [TOOL_CALLS] call, read back into OpenAI's shape."""
    from engine.synth.model_gen import SHAPES, write_model
    from engine.tools.calls import MISTRAL, template_format, template_id

    source = MISTRAL_TEMPLATE.read_text()
    assert template_format(source) == MISTRAL
    # Mistral's later format ([TOOL_CALLS]name[ARGS]{...}) is not this one: the universal format
    assert template_format(source.replace("[TOOL_CALLS] [", "[TOOL_CALLS]' + name + '[ARGS]")) is None
    model = write_model(tmp_path / "mistral-tiny.gguf", SHAPES["tiny"], model_path,
                        chat_template=source)
    prompt, ans = _forecast_follow_up(model, MISTRAL, last_user=False)
    cid = template_id(MISTRAL, "c1")
    assert len(cid) == 9 and cid.isalnum()
    assert '[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_forecast"' in prompt
    assert "You can call these functions" not in prompt  # not the universal system text
    assert ('[TOOL_CALLS] [{"name": "get_forecast", "arguments": {"unit": "C", "tomorrow": false}'
            f', "id": "{cid}"}}]') in prompt
    assert prompt.endswith(f'[TOOL_RESULTS] {{"content": 4 degrees, rain, "call_id": "{cid}"}}'
                           "[/TOOL_RESULTS]")
    _is_one_forecast_call(ans)
    assert len(ans.tool_calls[0]["id"]) == 9  # an id the template takes when the client sends it back


def test_the_official_clients_loop_with_a_templates_own_tool_format(hermes_model):
    """#29: the same loop through HTTP: a call (streamed: one delta), its result sent back as a
    `tool` message, then a reply the tools may not be called in."""
    s = Server("--model", str(hermes_model), api_key=None)
    try:
        client = s.client(key="none")
        msgs: list = [{"role": "user", "content": "Weather in Oslo tomorrow?"}]
        first = client.chat.completions.create(model="m", messages=msgs, tools=[FORECAST],
                                               tool_choice="required", temperature=0, max_tokens=60)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_forecast" and call.id
        assert set(json.loads(call.function.arguments)) == {"unit", "tomorrow"}
        streamed = list(client.chat.completions.create(
            model="m", messages=msgs, tools=[FORECAST], tool_choice="required", temperature=0,
            max_tokens=60, stream=True))
        calls = [tc for c in streamed if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert calls[0].function.name == "get_forecast" and calls[0].id
        assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == \
            json.loads(call.function.arguments)
        assert not any(c.choices[0].delta.content for c in streamed if c.choices)
        msgs += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "4 degrees"}]
        final = client.chat.completions.create(model="m", messages=msgs, tools=[FORECAST],
                                               tool_choice="none", temperature=0, max_tokens=8)
        assert final.choices[0].message.tool_calls is None
        assert final.choices[0].finish_reason in ("stop", "length")
    finally:
        s.stop()


def _loop_to_an_answer(client, question: str, tool: dict, result: str, stream: bool) -> list:
    """The official client's agent loop: a call (required at first), its result back as a
    `tool` message, then `auto` until the model answers in text; every reply, in order."""
    msgs: list = [{"role": "user", "content": question}]
    replies: list = []
    for step in range(4):
        kw = dict(model="m", messages=msgs, tools=[tool], temperature=0, max_tokens=40,
                  tool_choice="required" if step == 0 else "auto")
        if stream and step:
            chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            deltas = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
            calls = [{"id": d.id, "type": "function", "function": {
                "name": d.function.name, "arguments": "".join(
                    e.function.arguments or "" for e in deltas if e.index == d.index)}}
                for d in deltas if d.id]
            message = {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}
        else:
            m = client.chat.completions.create(**kw).choices[0].message
            message = m.model_dump(exclude_none=True)
        replies.append(message)
        if not message.get("tool_calls"):
            return replies
        msgs.append(message)
        msgs += [{"role": "tool", "tool_call_id": c["id"], "content": result} for c in message["tool_calls"]]
    return replies


def test_a_tool_loop_ends_with_an_answer(tmp_path, model_path):
    """#38: after a call's result, SmolLM2 (real weights) given a template with its own tool
    format (Hermes, as Qwen's) calls the same function with the same arguments again, round
    after round (measured before the fix: 5 of 5 rounds). Such a reply is taken again as text,
    so the official client's loop reaches an answer, streamed or not; the universal format
    (SmolLM2's own template) the same."""
    from engine.synth.model_gen import with_chat_template

    hermes = with_chat_template(model_path, tmp_path / "smollm2-hermes.gguf", HERMES_TEMPLATE.read_text())
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    result = json.dumps({"temperature_c": 18, "sky": "cloudy"})
    for model in (hermes, model_path):
        s = Server("--model", str(model), api_key=None)
        try:
            client = s.client(key="none")
            for stream in (False, True):
                replies = _loop_to_an_answer(client, "What is the weather in Paris?", weather,
                                             result, stream)
                print(f"\n{model.name} stream={stream}: {replies}")
                assert replies[0]["tool_calls"][0]["function"]["name"] == "get_weather"
                assert not replies[-1].get("tool_calls") and replies[-1]["content"]
                made = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                        for r in replies for c in r.get("tool_calls", [])]
                assert len(made) == len({json.dumps(m, sort_keys=True) for m in made}), made
        finally:
            s.stop()


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")


def test_reasoning_effort_reaches_a_template_with_a_thinking_switch(tmp_path, model_path):
    """Qwen3-style templates take `enable_thinking`: reasoning_effort none/minimal turn it off
    (as llama-server's chat_template_kwargs do, which are honoured too); a template without
    the switch renders as before; Ebb's own names cannot be replaced."""
    from engine.synth.model_gen import SHAPES, write_model
    from engine.server.api.chat import parse_chat_request
    from engine.server.api.common import ApiError
    from engine.server.answering import answer_job
    from engine.server.jobs import Job
    from engine.session import Session, SessionConfig

    model = write_model(tmp_path / "think-tiny.gguf", SHAPES["tiny"], model_path,
                        chat_template=THINKING_TEMPLATE)
    base = {"model": "m", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}]}
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    with Session(SessionConfig(model, n_ctx=512, n_threads=N_THREADS)) as s:
        for extra, thinks in (({"reasoning_effort": "none"}, False), ({"reasoning_effort": "high"}, True),
                              ({}, True), ({"chat_template_kwargs": {"enable_thinking": False}}, False),
                              ({"reasoning_effort": "high",
                                "chat_template_kwargs": {"enable_thinking": False}}, False)):
            s, ans = answer_job(s, Job(parse_chat_request({**base, **extra}), "t", lambda ev: None), None)
            prompt, _ = s.model.runtime.format_chat(s.messages[:-1], s.chat.tools, s.chat.template_kwargs)
            assert prompt.endswith(closed) is not thinks, (extra, prompt)
    plain = parse_chat_request({**base, "reasoning_effort": "low"})
    assert plain.thinking_kwargs("{{ messages }}") == {}  # no switch in the template: nothing to set
    for bad in ({"reasoning_effort": "max"}, {"chat_template_kwargs": {"messages": []}},
                {"chat_template_kwargs": ["enable_thinking"]}):
        with pytest.raises(ApiError):
            parse_chat_request({**base, **bad})


def test_several_choices_and_several_prompts(server):
    """n > 1: the choices in order, each from its own seed, usage summed over the replies and
    the prompt counted once; streamed, each chunk names its choice. A list of prompts in
    /v1/completions: a choice each, the same as asking one at a time."""
    client = server.client()
    ask = {"model": "m", "max_tokens": 6, "temperature": 0.9, "seed": 5,
           "messages": [{"role": "user", "content": "Name a fruit."}]}
    three = client.chat.completions.create(**ask, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    one = client.chat.completions.create(**{**ask, "seed": 6})  # choice 1's seed, alone
    assert three.choices[1].message.content == one.choices[0].message.content
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == sum(
        client.chat.completions.create(**{**ask, "seed": 5 + i}).usage.completion_tokens
        for i in range(3))
    chunks = list(client.chat.completions.create(**ask, n=2, stream=True))
    by_choice: dict[int, str] = {}
    finished = set()
    for c in chunks:
        for ch in c.choices:
            by_choice[ch.index] = by_choice.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1}
    assert [by_choice[i] for i in (0, 1)] == [c.message.content for c in three.choices[:2]]
    prompts = ["Once upon a time", "The capital of France is"]
    both = client.completions.create(model="m", prompt=prompts, max_tokens=5, temperature=0)
    alone = [client.completions.create(model="m", prompt=p, max_tokens=5, temperature=0)
             for p in prompts]
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone]
    assert [c.index for c in both.choices] == [0, 1]
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)


def test_a_client_coming_back_gets_its_conversation_from_memory_then_from_disk(model_path):
    """#41: a client that resends its history after another client's turn, or after the
    server restarted, gets the prefix back instead of evaluating it again (usage says so in
    OpenAI's prompt_tokens_details.cached_tokens)."""
    long_q = "Tell me about zebras, giraffes and lions, in a paragraph each. " * 6
    a = [{"role": "user", "content": long_q}]
    s = Server()
    try:
        client = s.client()
        ask = lambda msgs: client.chat.completions.create(  # noqa: E731
            model="any", messages=msgs, temperature=0, max_tokens=8)
        first = ask(a)
        a += [{"role": "assistant", "content": first.choices[0].message.content},
              {"role": "user", "content": "And elephants?"}]
        ask([{"role": "user", "content": "Something else entirely: name a colour."}])  # B
        back = ask(a)
        assert back.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    finally:
        s.stop()  # the last conversation is kept on disk
    s = Server()
    try:
        again = s.client().chat.completions.create(model="any", messages=a, temperature=0, max_tokens=8)
        assert again.choices[0].message.content == back.choices[0].message.content
        assert again.usage.prompt_tokens_details.cached_tokens >= back.usage.prompt_tokens - 1
    finally:
        s.stop()


def test_a_request_waiting_behind_a_long_reply_sees_its_place_or_a_clear_503(monkeypatch):
    """#43: while the model is busy (here held in a prefill by the test hook), a stream that
    waits sees its place in line every second, and a request that is not streamed gets a 503
    with Retry-After once it has waited --max-wait, instead of nothing for minutes."""
    monkeypatch.setenv("EBB_TEST_PAUSE_AT", "prefill")
    s = Server("--queue", "4", "--max-wait", "1", api_key=None)
    try:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
        a, b = Raw(s.port), Raw(s.port)
        busy = a.request("POST", "/v1/chat/completions", body)
        assert busy.status == 200
        s.wait_log("paused in prefill")
        waiting = b.request("POST", "/v1/chat/completions", body)
        lines = sse_lines(waiting)
        assert next(lines).startswith("data: ")  # the role chunk
        # the reply being written goes first: it counts (#51: "0 ahead" while one was)
        assert next(ln for ln in lines if ln.startswith(":")) == ": waiting in line, 1 ahead"
        status, headers, answer = Raw(s.port, timeout=30).call("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert status == 503 and headers["retry-after"] == "2"
        message = answer["error"]["message"]
        assert "busy" in message and "with 2 ahead" in message and "stream the request" in message
        busy.close(), waiting.close(), a.close(), b.close()
    finally:
        s.proc.kill()  # held in the prefill for the test: nothing to close cleanly
        s.proc.wait()
