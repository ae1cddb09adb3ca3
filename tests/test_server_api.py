"""The server's request checks and stop sequences (engine/server/api/): pure logic."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from engine.server.api.chat import image_from_url, parse_chat_request

from engine.server.api.common import ApiError, StopWatcher


def read_call(text, tools, choice, fmt=None):
    """The one call a reply makes, or None (text, or several calls)."""
    from engine.tools.calls import read_calls

    calls = read_calls(text, tools, choice, fmt)
    return calls[0] if len(calls) == 1 else None


def user(content):
    return {"messages": [{"role": "user", "content": content}]}


def test_a_conversation_becomes_system_history_and_the_last_user_turn(tmp_path):
    import io

    from PIL import Image

    pic = tmp_path / "p.png"
    pic.write_bytes(b"png")
    png = io.BytesIO()
    Image.new("RGB", (2, 2)).save(png, "PNG")
    req = parse_chat_request({
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "developer", "content": "Use English."},
                     {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": None},
                     {"role": "user", "content": [
                         {"type": "text", "text": "What is"},
                         {"type": "image_url", "image_url": {"url": f"file://{pic}"}},
                         {"type": "text", "text": "this?"},
                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                             + base64.b64encode(png.getvalue()).decode()}}]}],
        "temperature": 0, "top_p": 0.5, "max_tokens": 7, "stop": "END", "seed": 3,
        "stream": True, "stream_options": {"include_usage": True}, "user": "ed"})
    assert req.system == "Be brief.\n\nUse English."
    assert [(t.role, t.text) for t in req.history] == [("user", "Hi"), ("assistant", "")]
    assert req.last.text == "What is\nthis?"
    assert req.last.attachments[0].path == pic and req.last.attachments[1].data == png.getvalue()
    assert (req.temperature, req.top_p, req.max_tokens, req.stop, req.seed) == (0.0, 0.5, 7, ("END",), 3)
    assert req.stream and req.include_usage and req.user == "ed"
    assert parse_chat_request({**user("x"), "max_completion_tokens": 9}).max_tokens == 9
    assert parse_chat_request(user("x")).max_tokens == 0  # no cap


@pytest.mark.parametrize("body, param, says", [
    ({}, "messages", "non-empty list"),
    (user("x") | {"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "unsupported role"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "messages", "last message"),
    (user([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]),
     "messages[0].content[0].image_url", "does not fetch"),
    (user([{"type": "image_url", "image_url": {"url": "data:image/png,raw"}}]),
     "messages[0].content[0].image_url", "base64"),
    (user([{"type": "image_url", "image_url": {"url": "ftp://x"}}]),
     "messages[0].content[0].image_url", "scheme"),
    # a clip sent as a picture (#52): pointed to input_audio, not only "not a picture"
    (user([{"type": "image_url", "image_url": {"url": "data:audio/wav;base64,UklGRg=="}}]),
     "messages[0].content[0].image_url", "send a sound clip as an 'input_audio' part"),
    (user([{"type": "image_url", "image_url": {"url": "file://otherhost/x.png"}}]),
     "messages[0].content[0].image_url", "local file"),
    ({"messages": [{"role": "assistant", "content": [{"type": "image_url", "image_url": "x"}]},
                   {"role": "user", "content": "x"}]}, "messages[0].content[0]", "user messages only"),
    (user("x") | {"top_p": 2}, "top_p", "between"),
    (user("x") | {"max_tokens": 0}, "max_tokens", "at least 1"),
    (user("x") | {"stream_options": []}, "stream_options", "object"),
])
def test_what_is_wrong_and_where(body, param, says):
    with pytest.raises(ApiError) as err:
        parse_chat_request(body)
    assert err.value.status == 400 and err.value.param == param and says in err.value.message
    shape = err.value.body()["error"]
    assert shape["type"] == "invalid_request_error" and shape["param"] == param


def test_a_file_url_may_be_percent_encoded(tmp_path):
    pic = tmp_path / "a picture.png"
    pic.write_bytes(b"x")
    assert image_from_url(f"file://{str(pic).replace(' ', '%20')}", "p").path == pic


@pytest.mark.parametrize("pieces, stops, shown, hit", [
    (["Hello", " world"], (), "Hello world", False),
    (["Hel", "lo E", "ND more"], ("END",), "Hello ", True),
    (["ab", "c"], ("abcd",), "abc", False),  # held back, then given at the end: no stop
    (["x<", "|", "im_end|>y"], ("<|im_end|>",), "x", True),
    (["one two"], ("two", "one"), "", True),  # the first in the text wins
    (["aXb", "Yc"], ("XbY", "Yc"), "a", True),
])
def test_stop_sequences_cut_the_reply_where_the_first_begins(pieces, stops, shown, hit):
    w = StopWatcher(stops)
    out = "".join(w.feed(p) for p in pieces) + w.flush()
    assert out == shown and w.hit == hit


def test_a_field_ebb_cannot_honour_is_refused_by_name_never_ignored():
    """#29: response_format, legacy functions, logprobs... get a 400 that names them; their neutral values
    (what clients send by default) and fields that change nothing are accepted."""
    from engine.server.api.chat import parse_chat_request
    from engine.server.api.common import ApiError

    base = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    for name, value in (("response_format", {"type": "xml"}), ("functions", [{"name": "f"}]),
                        ("top_logprobs", 3), ("frequency_penalty", "high"),
                        ("tool_choice", "required"), ("something_new", 1)):
        with pytest.raises(ApiError) as exc:
            parse_chat_request({**base, name: value})
        assert exc.value.status == 400 and exc.value.param == name and name in str(exc.value)
    ok = {**base, "response_format": {"type": "text"}, "tools": [], "logprobs": False,
          "frequency_penalty": 0, "presence_penalty": 0.0, "metadata": {"a": "b"}, "store": False,
          "tool_choice": None, "logit_bias": {}, "parallel_tool_calls": True}
    assert parse_chat_request(ok).last.text == "Hi"



def test_response_format_becomes_a_grammar():
    from engine.server.api.chat import parse_chat_request
    from engine.server.api.common import ApiError

    base = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    assert parse_chat_request({**base, "response_format": {"type": "text"}}).grammar == ""
    assert "root" in parse_chat_request({**base, "response_format": {"type": "json_object"}}).grammar
    # llama-server's json_object with a schema follows the schema, not just any object
    shaped = parse_chat_request({**base, "response_format": {"type": "json_object", "schema": {
        "type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}}})
    assert "answer" in shaped.grammar
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}},
              "required": ["colour"]}
    g = parse_chat_request({**base, "response_format": {"type": "json_schema",
                                                        "json_schema": {"name": "c", "schema": schema}}}).grammar
    assert "root" in g and "red" in g
    with pytest.raises(ApiError) as exc:
        parse_chat_request({**base, "response_format": {"type": "json_schema", "json_schema": {}}})
    assert exc.value.param == "response_format"


def test_cors_is_off_unless_an_origin_is_allowed():
    """#29: a browser page may call the API only from an origin given with --cors."""
    import threading

    from starlette.testclient import TestClient

    from engine.server.http import build_app

    class Idle:
        ready = threading.Event()
        load_error = None
        model_id = "m"
        served = 0

        def waiting(self) -> int:
            return 0

    pre = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"}
    closed = TestClient(build_app(Idle()), base_url="http://127.0.0.1")
    assert "access-control-allow-origin" not in closed.options("/v1/chat/completions", headers=pre).headers
    opened = TestClient(build_app(Idle(), cors=("http://localhost:3000",)), base_url="http://127.0.0.1")
    r = opened.options("/v1/chat/completions", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    other = opened.options("/v1/chat/completions", headers={**pre, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    assert opened.get("/health", headers={"Origin": "http://localhost:3000"}).headers[
        "access-control-allow-origin"] == "http://localhost:3000"



def test_logprobs_are_asked_for_with_their_count():
    from engine.server.api.chat import parse_chat_request
    from engine.server.api.common import ApiError

    base = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    assert parse_chat_request(base).top_logprobs == -1
    assert parse_chat_request({**base, "logprobs": True}).top_logprobs == 0
    assert parse_chat_request({**base, "logprobs": True, "top_logprobs": 5}).top_logprobs == 5
    for bad in ({"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 2},
                {"logprobs": "yes"}):
        with pytest.raises(ApiError) as exc:
            parse_chat_request({**base, **bad})
        assert exc.value.status == 400 and exc.value.param in ("logprobs", "top_logprobs")


# ------------------------------------------------------------------ tools (#29)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


def test_a_tool_loop_becomes_a_history_the_model_can_read():
    from engine.server.api.chat import parse_chat_request

    req = parse_chat_request({"model": "m", "tools": [WEATHER, TIME], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees, rain"}]})
    assert req.tool_choice.mode == "auto" and [t.name for t in req.callable_tools()] == ["get_weather", "get_time"]
    assert [t.role for t in req.history] == ["user", "assistant"]
    assert json.loads(req.history[1].text) == {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}
    assert req.last.role == "user" and req.last.text == "The function get_weather returned: 4 degrees, rain"
    assert "Be brief." in req.system and '"get_time"' in req.system and "plain text" in req.system
    assert "ebb-tool-call" in req.grammar and "ebb-text" in req.grammar
    # required, or one function by name: the grammar allows a call only
    named = parse_chat_request({"model": "m", "tools": [WEATHER, TIME], "messages": [
        {"role": "user", "content": "Hi"}],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert [t.name for t in named.callable_tools()] == ["get_time"] and "ebb-text" not in named.grammar
    assert "get_weather" not in named.grammar and "get_weather" not in named.system
    # none: the tools are not offered at all
    none = parse_chat_request({"model": "m", "tools": [WEATHER], "tool_choice": "none",
                               "messages": [{"role": "user", "content": "Hi"}]})
    assert none.callable_tools() == () and none.grammar == "" and none.system is None


@pytest.mark.parametrize("bad, param", [
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "tool", "tool_call_id": "x", "content": "1"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": {}}}]},
                   {"role": "user", "content": "Hi"}]}, "messages[0].tool_calls[0]"),
])
def test_a_bad_tool_request_is_a_400_naming_the_field(bad, param):
    from engine.server.api.chat import parse_chat_request
    from engine.server.api.common import ApiError

    with pytest.raises(ApiError) as exc:
        parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "Hi"}], **bad})
    assert exc.value.status == 400 and exc.value.param == param


def test_the_tool_grammars_are_ones_llama_cpp_accepts(text_runtime):
    """Each format's grammar, for every kind of tool choice, compiles in llama.cpp's own parser:
    the grammar sampler a request would build (NULL for a grammar llama.cpp refuses, as the
    broken one beside them shows)."""
    from dataclasses import replace

    from engine.llama.lib import llama
    from engine.tools.calls import HERMES, LLAMA3, MISTRAL, grammar, parse_tool_choice, parse_tools

    L = llama()

    def compiles(gbnf: str) -> bool:
        sampler = L.llama_sampler_init_grammar(text_runtime.vocab, gbnf.encode(), b"root")
        if sampler:
            L.llama_sampler_free(sampler)
        return bool(sampler)

    assert not compiles('root ::= "unclosed')  # the check can fail
    tools = parse_tools([WEATHER, TIME])
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_time"}}):
        for fmt in (None, HERMES, LLAMA3, MISTRAL):
            for parallel in (False, True):
                picked = replace(parse_tool_choice(choice, tools), parallel=parallel)
                gbnf = grammar(tools, picked, fmt)
                assert gbnf and compiles(gbnf), (choice, fmt, parallel, gbnf)


def test_a_reply_is_a_call_only_when_it_is_one():
    from engine.tools.calls import CallGate, parse_tool_choice, parse_tools

    tools = parse_tools([WEATHER])
    auto = parse_tool_choice("auto", tools)
    call = read_call('{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}', tools, auto)
    assert call is not None and call.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Oslo", "unit": "C"}
    assert read_call("It rains.", tools, auto) is None
    assert read_call('{"name": "get_weather", "argu', tools, auto) is None  # cut short: text
    assert read_call('{"name": "other", "arguments": {}}', tools, auto) is None
    assert read_call('{"name": "get_weather", "arguments": {}}', tools,
                     parse_tool_choice("none", tools)) is None
    # streaming: text goes out as it comes; what may be a call is held to the end
    gate = CallGate(True)
    assert [gate.feed(p) for p in (" ", "\n", "It", " rains")] == ["", "", " \nIt", " rains"]
    gate = CallGate(True)
    assert [gate.feed(p) for p in (" ", '{"na', 'me"')] == ["", "", ""] and gate.flush() == ' {"name"'
    assert CallGate(False).feed("{") == "{"


def test_a_template_that_teaches_tool_calls_is_recognised_and_its_calls_are_read():
    """#29: Hermes-format templates (Qwen2.5, Qwen3, Hermes: <tool_call> blocks) get the tools
    themselves; a template without tools, or with a format Ebb does not know, gets the
    universal system-prompt format."""
    from engine.server.api.chat import parse_chat_request
    from engine.tools.calls import (
        HERMES,
        LLAMA3,
        MISTRAL,
        CallGate,
        grammar,
        parse_tool_choice,
        parse_tools,
        template_format,
        template_id,
    )

    hermes = (Path(__file__).parent / "templates" / "hermes-tools.jinja").read_text()
    assert template_format(hermes) == HERMES
    assert template_format("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}") is None
    assert template_format("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}{% endif %}") is None
    llama3 = (Path(__file__).parent / "templates" / "llama3-tools.jinja").read_text()
    assert template_format(llama3) == LLAMA3
    tools = parse_tools([WEATHER])
    auto = parse_tool_choice("auto", tools)
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>'
    call = read_call(block, tools, auto, HERMES)
    assert call is not None and json.loads(call.arguments) == {"city": "Oslo", "unit": "C"}
    assert read_call(block[:-5], tools, auto, HERMES) is None  # cut short: text
    assert read_call('{"name": "get_weather", "arguments": {}}', tools, auto, HERMES) is None
    assert read_call("It rains.", tools, auto, HERMES) is None
    # Llama 3.1's: the arguments under "parameters", bare JSON; its grammar writes that key
    call = read_call('{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "F"}}', tools,
                     auto, LLAMA3)
    assert call is not None and json.loads(call.arguments) == {"city": "Oslo", "unit": "F"}
    assert r'\"parameters\"' in grammar(tools, auto, LLAMA3) and "arguments" not in grammar(tools, auto, LLAMA3)
    assert r'\"arguments\"' in grammar(tools, auto, None)
    # Mistral's: a [TOOL_CALLS] list of one call; a real model writes [TOOL_CALLS] as a control
    # token, which is not in the reply's text
    for text in ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}]',
                 ' [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}]'):
        call = read_call(text, tools, auto, MISTRAL)
        assert call is not None and json.loads(call.arguments) == {"city": "Oslo", "unit": "C"}
        assert len(call.id) == 9 and call.id.isalnum()  # what Mistral's template takes back
    assert read_call('[TOOL_CALLS] [{"name": "get_weather", "argu', tools, auto, MISTRAL) is None
    assert read_call("[1] is a footnote", tools, auto, MISTRAL) is None
    assert '"[TOOL_CALLS]"' in grammar(tools, auto, MISTRAL)
    assert template_id(MISTRAL, "call_1") == template_id(MISTRAL, "call_1") != "call_1"
    assert template_id(MISTRAL, "abc123XYZ") == "abc123XYZ" and template_id(HERMES, "call_1") == "call_1"
    gate = CallGate(True, "[")
    assert [gate.feed(p) for p in (" ", "[{", '"name"')] == ["", "", ""]
    gate = CallGate(True, "<")
    assert [gate.feed(p) for p in ("\n", "<tool", "_call>")] == ["", "", ""]
    assert CallGate(True, "<").feed("{") == "{"  # bare JSON is text in this format
    # the request keeps the messages as they came, for such a template
    req = parse_chat_request({"model": "m", "tools": [WEATHER], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees, rain"}]})
    assert req.own_system == "Be brief." and [m.role for m in req.messages] == ["user", "assistant", "tool"]
    assert req.messages[1].extra == {"tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}}]}
    assert req.messages[2].extra == {"tool_call_id": "call_1", "name": "get_weather"}
    assert req.messages[2].text == "4 degrees, rain"


# ------------------------------------------------------------------ completions, embeddings (#29)

def test_a_completion_request_is_checked():
    from engine.server.api.common import ApiError
    from engine.server.api.completions import DEFAULT_COMPLETION_TOKENS, parse_completion_request

    req = parse_completion_request({"model": "m", "prompt": "Once upon"})
    assert req.prompt == "Once upon" and req.max_tokens == DEFAULT_COMPLETION_TOKENS and req.top_logprobs == -1
    assert parse_completion_request({"model": "m", "prompt": ["Once"]}).prompt == "Once"
    assert parse_completion_request({"model": "m", "prompt": [1, 2, 3]}).prompt == (1, 2, 3)
    assert parse_completion_request({"model": "m", "prompt": [[1, 2]], "logprobs": 2}).top_logprobs == 2
    two = parse_completion_request({"model": "m", "prompt": ["a", [1, 2]]})
    assert two.all_prompts == ("a", (1, 2)) and two.prompt == "a"
    for bad, param in (({"prompt": ["a"] * 9}, "prompt"), ({}, "prompt"), ({"prompt": 5}, "prompt"),
                       ({"prompt": "a", "suffix": "z"}, "suffix"), ({"prompt": "a", "n": 2}, "n"),
                       ({"prompt": "a", "logprobs": 6}, "logprobs"),
                       ({"prompt": "a", "logprobs": 1, "echo": True}, "logprobs"),
                       ({"prompt": "a", "messages": []}, "messages")):
        with pytest.raises(ApiError) as exc:
            parse_completion_request({"model": "m", **bad})
        assert exc.value.status == 400 and exc.value.param == param


def test_an_embedding_request_is_checked():
    from engine.server.api.common import ApiError
    from engine.server.api.embeddings import embedding_list, parse_embedding_request

    assert parse_embedding_request({"input": "a"}).inputs == ("a",)
    assert parse_embedding_request({"input": ["a", "b"]}).inputs == ("a", "b")
    assert parse_embedding_request({"input": [5, 6]}).inputs == ((5, 6),)
    assert parse_embedding_request({"input": [[5], [6, 7]], "encoding_format": "base64"}).base64
    for bad, param in (({"input": ""}, "input"), ({}, "input"), ({"input": []}, "input"),
                       ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
                       ({"input": "a", "truncate": True}, "truncate")):
        with pytest.raises(ApiError) as exc:
            parse_embedding_request(bad)
        assert exc.value.status == 400 and exc.value.param == param
    packed = embedding_list("m", [[0.5, -1.0]], 3, True)["data"][0]["embedding"]
    import struct
    assert struct.unpack("<2f", base64.b64decode(packed)) == (0.5, -1.0)


def test_the_host_header_must_name_where_the_server_listens():
    """Loopback: only loopback names and addresses; every interface: any address literal (a
    rebinding needs a name); one address: that one; --allow-host adds names."""
    from engine.server.guard import Policy, host_name, refusal

    assert host_name("[::1]:8089") == "::1" and host_name("LocalHost:1") == "localhost"
    loop = Policy("127.0.0.1")
    assert all(loop.host_allowed(h) for h in ("127.0.0.1:8089", "localhost", "[::1]:80", "127.0.0.2"))
    assert not any(loop.host_allowed(h) for h in ("evil.example:8089", "192.168.1.4", "", "[::1"))
    every = Policy("0.0.0.0")
    assert every.host_allowed("192.168.1.4:8089") and every.host_allowed("[fe80::1]:8089")
    assert not every.host_allowed("rebound.example:8089")
    lan = Policy("192.168.1.4", allow_hosts=("box.local",))
    assert lan.host_allowed("192.168.1.4:8089") and lan.host_allowed("BOX.local:8089")
    assert not lan.host_allowed("127.0.0.1:8089") and not lan.host_allowed("other.local")
    named = Policy("localhost")
    assert named.host_allowed("127.0.0.1:1") and not named.host_allowed("evil.example")
    json_post = {"host": "127.0.0.1:8089", "content-type": "application/json"}
    assert refusal("POST", json_post, loop) is None
    assert refusal("GET", {"host": "127.0.0.1:8089"}, loop) is None  # no body, no type needed
    assert refusal("POST", {**json_post, "origin": "http://127.0.0.1:8089"}, loop) is None  # its own
    for headers, status in (({**json_post, "origin": "https://evil.example"}, 403),
                            ({**json_post, "content-type": "text/plain"}, 415),
                            ({**json_post, "content-type": "multipart/form-data; boundary=x"}, 415),
                            ({**json_post, "host": "evil.example"}, 403)):
        error = refusal("POST", headers, loop)
        assert error is not None and error.status == status, headers
    allowed = Policy("127.0.0.1", origins=("http://localhost:3000",))
    assert refusal("POST", {**json_post, "origin": "http://localhost:3000"}, allowed) is None
    # #67: Origin null is every sandboxed frame and file page: said so, never "--cors null"
    null = refusal("POST", {**json_post, "origin": "null"}, loop)
    assert null is not None and null.status == 403 and "sandboxed frames" in null.message
    assert "--cors null" not in null.message
    # OpenAI's transcription endpoint takes a form, there alone; a page's post of one is still
    # refused by its Origin
    form = {**json_post, "content-type": "multipart/form-data; boundary=x"}
    assert refusal("POST", form, loop, "/v1/audio/transcriptions") is None
    assert refusal("POST", form, loop, "/v1/chat/completions").status == 415
    hostile = refusal("POST", {**form, "origin": "https://evil.example"}, loop, "/v1/audio/transcriptions")
    assert hostile is not None and hostile.status == 403


def test_llama_cpp_sampler_fields_are_read_and_checked():
    from engine.server.api.chat import parse_chat_request
    from engine.server.api.common import ApiError
    from engine.server.api.completions import parse_completion_request

    base = {"messages": [{"role": "user", "content": "Hi"}]}
    req = parse_chat_request({**base, "top_k": 0, "min_p": 0.05, "repeat_penalty": 1.1,
                              "presence_penalty": -0.5, "frequency_penalty": 1,
                              "logit_bias": {"15": -100, "16": 5.5}})
    assert req.sampling.gen_overrides() == {
        "top_k": 0, "min_p": 0.05, "repeat_penalty": 1.1, "presence_penalty": -0.5,
        "frequency_penalty": 1.0, "logit_bias": ((15, -100.0), (16, 5.5))}
    assert parse_chat_request(base).sampling.gen_overrides() == {
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": ()}  # defaults kept
    assert parse_chat_request({**base, "logit_bias": [[15, 1]]}).sampling.logit_bias == ((15, 1.0),)
    assert parse_chat_request({**base, "grammar": 'root ::= "a"'}).grammar == 'root ::= "a"'
    assert parse_completion_request({"prompt": "x", "grammar": 'root ::= "a"', "top_k": 3}
                                    ).sampling.grammar == 'root ::= "a"'
    for bad, param in (({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"min_p": 2}, "min_p"),
                       ({"repeat_penalty": 0}, "repeat_penalty"),
                       ({"presence_penalty": 2.5}, "presence_penalty"),
                       ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"1": 500}}, "logit_bias"),
                       ({"grammar": 5}, "grammar"),
                       ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar")):
        with pytest.raises(ApiError) as err:
            parse_chat_request({**base, **bad})
        assert err.value.status == 400 and err.value.param == param, bad


def test_parallel_tool_calls_are_read_in_each_format_and_off_unless_asked():
    from dataclasses import replace

    from engine.server.api.chat import parse_chat_request
    from engine.tools.calls import HERMES, MISTRAL, parse_tool_choice, parse_tools, read_calls

    tools = parse_tools([WEATHER, TIME])
    auto = replace(parse_tool_choice("auto", tools), parallel=True)
    w = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}'
    t = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    for text, fmt in ((f"{w}\n{t}", None), (f"<tool_call>\n{w}\n</tool_call>\n<tool_call>\n{t}\n</tool_call>", HERMES),
                      (f"[TOOL_CALLS] [{w}, {t}]", MISTRAL)):
        calls = read_calls(text, tools, auto, fmt)
        assert [c.name for c in calls] == ["get_weather", "get_time"], fmt
        assert read_call(text, tools, auto, fmt) is None  # more than one: not "the" call
    assert read_calls(f"{w} and then some text", tools, auto) == []
    assert read_calls(f"<tool_call>\n{w}\n</tool_call> trailing", tools, auto, HERMES) == []
    assert read_calls('{"name": "get_weather", "argu', tools, auto) == []  # cut short
    base = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER, TIME]}
    assert not parse_chat_request(base).tool_choice.parallel  # as llama-server: off by default
    assert parse_chat_request({**base, "parallel_tool_calls": True}).tool_choice.parallel


def test_a_calls_arguments_stream_as_they_are_written():
    from engine.tools.calls import HERMES, ArgumentStream

    stream = ArgumentStream(HERMES)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os'
    first = stream.deltas(text)
    assert first[0]["function"] == {"name": "get_weather", "arguments": ""} and first[0]["id"]
    assert first[1] == {"index": 0, "function": {"arguments": '{"city": "Os'}}
    text += 'lo \\"}\\" {", "unit": "C"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}'
    more = stream.deltas(text)
    args0 = '{"city": "Os' + more[0]["function"]["arguments"]
    assert json.loads(args0) == {"city": 'Oslo "}" {', "unit": "C"}  # braces in strings skipped
    assert more[1]["index"] == 1 and more[1]["function"]["name"] == "get_time"
    assert more[2] == {"index": 1, "function": {"arguments": "{}"}}
    assert stream.deltas(text) == [] and len(stream.ids) == 2  # nothing new: nothing sent


def test_the_calls_answered_since_the_users_last_message_are_known_in_any_spelling():
    """#38: what a reply may not simply repeat: calls whose results came back after the user's
    last message, keyed by function and argument values (not spacing or key order)."""
    from engine.tools.calls import call_key

    def req(*after_user):
        return parse_chat_request({"model": "m", "tools": [WEATHER], "messages": [
            {"role": "user", "content": "Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather",
                                                            "arguments": '{"city": "Oslo", "unit": "C"}'}},
                {"id": "b", "type": "function", "function": {"name": "get_weather",
                                                            "arguments": '{"city": "Bergen", "unit": "C"}'}}]},
            {"role": "tool", "tool_call_id": "a", "content": "4"}, *after_user]})

    answered = req().answered
    assert answered == {call_key("get_weather", '{"unit":"C","city":"Oslo"}')}  # b has no result
    assert call_key("get_weather", {"city": "Oslo", "unit": "F"}) not in answered
    assert req({"role": "user", "content": "And Paris?"}).answered == frozenset()  # a new question
