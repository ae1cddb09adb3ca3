"""Function calling in OpenAI's shape.

- **The model's own format** where its chat template has one Ebb knows (it lists `tools`
  itself and teaches a format):
  - Hermes (Qwen2.5, Qwen3, Hermes and others):
    `<tool_call>{"name": ..., "arguments": ...}</tool_call>`; the reply is held by llama.cpp's
    grammar to plain text (it may not begin with "<") or one such block;
  - Llama 3.1, 3.2 and 3.3: `{"name": ..., "parameters": ...}`, results in `ipython` turns;
    the reply is plain text (it may not begin with "{") or one such call;
  - Mistral (7B v0.3, Nemo and others of that template): `[TOOL_CALLS] [{"name": ...,
    "arguments": ...}]`, results in `[TOOL_RESULTS]`; the reply is plain text (it may not begin
    with "[") or one such call. `[TOOL_CALLS]` is a control token: llama.cpp's grammar matches it
    by its text, and the reply's text leaves it out. Its template takes call ids of exactly 9
    letters and digits: a client's other ids are mapped to such ids (`template_id`).
    Mistral's later format (`[TOOL_CALLS]name[ARGS]{...}`) gets the universal one below.
  The template gets the tools, the assistant's `tool_calls` and the `tool` messages as they are.
- **Any other model**: the tools are described in the system prompt, and the reply is held to
  plain text (it may not begin with "{") or one call, `{"name": ..., "arguments": {...}}`. A
  call comes back in the history as the assistant's JSON text; a tool's result as a user
  message that says which call it answers.

Either way the arguments follow the function's JSON schema (llama-cpp-python's schema
converter writes the grammar). Pure: no HTTP and no llama.cpp here.
"""
from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from engine.errors import EbbError

class ToolsRefused(EbbError):
    """Tools (or a choice of them) that cannot be offered: `param` names the field at fault
    (the endpoint answers 400 with it)."""

    def __init__(self, what: str, param: str | None = None) -> None:
        super().__init__(what)
        self.param = param


NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema for the arguments object


HERMES = "hermes"  # <tool_call>{"name": ..., "arguments": ...}</tool_call>
LLAMA3 = "llama3"  # {"name": ..., "parameters": ...}: Llama 3.1, 3.2 and 3.3's JSON tool calls
MISTRAL = "mistral"  # [TOOL_CALLS] [{"name": ..., "arguments": ...}]
# where a template teaches a format, it says so by the tag it wraps calls in, or its wording
_FORMATS = ((HERMES, re.compile(r"<tool_call>")),
            (LLAMA3, re.compile(r'"name": function name, "parameters": dictionary of argument')),
            (MISTRAL, re.compile(r"\[TOOL_CALLS\](?![\s\S]*\[ARGS\])")))
# the text a call in each format opens with, after any blank space (CallGate holds such a reply)
OPENERS = {HERMES: "<", MISTRAL: "["}
# the key a format puts a call's arguments under
_ARGUMENTS = {LLAMA3: "parameters"}
_TOOLS_VAR = re.compile(r"\btools\b")


def template_id(fmt: str | None, call_id: str) -> str:
    """A call's id as the template `fmt` takes it: Mistral's takes 9 letters and digits only,
    so any other id becomes 9 hex digits of its hash (the same for the call and its result)."""
    if fmt != MISTRAL or re.fullmatch(r"[A-Za-z0-9]{9}", call_id):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def template_extra(fmt: str | None, extra: dict[str, Any] | None) -> dict[str, Any] | None:
    """A message's calls or call id (its `extra`) with the ids as the template takes them."""
    if fmt != MISTRAL or not extra:
        return extra
    out = dict(extra)
    if "tool_call_id" in out:
        out["tool_call_id"] = template_id(fmt, str(out["tool_call_id"]))
    if "tool_calls" in out:
        out["tool_calls"] = [{**c, "id": template_id(fmt, str(c.get("id", "")))}
                             for c in out["tool_calls"]]
    return out


def template_format(source: str) -> str | None:
    """The tool-call format a chat template teaches its model, if it lists `tools` itself and
    its format is one Ebb knows; None: the universal format (system prompt and JSON)."""
    if not _TOOLS_VAR.search(source):
        return None
    return next((name for name, pattern in _FORMATS if pattern.search(source)), None)


MAX_PARALLEL_CALLS = 4  # calls in one reply with parallel_tool_calls


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none", "auto", "required"
    name: str = ""  # with "required": this function only
    parallel: bool = False  # parallel_tool_calls: up to MAX_PARALLEL_CALLS calls in one reply


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def for_template(self) -> dict[str, Any]:
        """The call as chat templates read it (arguments as an object, as Hugging Face's do)."""
        try:
            args: Any = json.loads(self.arguments) if self.arguments.strip() else {}
        except ValueError:
            args = self.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": args}}

    def key(self) -> tuple[str, str]:
        """What makes two calls the same call: the function and its arguments' values."""
        return call_key(self.name, self.arguments)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:  # a streamed delta's
            out = {"index": index, **out}
        return out


def parse_tools(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ToolsRefused("'tools' must be a list", "tools")
    tools: list[Tool] = []
    for i, spec in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(spec, dict) or spec.get("type") != "function":
            raise ToolsRefused("a tool must be {\"type\": \"function\", \"function\": {...}}", where)
        fn = spec.get("function")
        if not isinstance(fn, dict):
            raise ToolsRefused("a tool needs 'function' as an object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ToolsRefused("a function's name must be 1-64 letters, digits, _ or -",
                           f"{where}.function.name")
        if any(t.name == name for t in tools):
            raise ToolsRefused(f"two tools are named {name!r}", f"{where}.function.name")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolsRefused("'parameters' must be a JSON schema object",
                           f"{where}.function.parameters")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise ToolsRefused("'description' must be a string", f"{where}.function.description")
        tools.append(Tool(name, description, params))
    return tuple(tools)


def parse_tool_choice(value: Any, tools: tuple[Tool, ...]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise ToolsRefused(f"'tool_choice' {value!r} needs 'tools'", "tool_choice")
        return ToolChoice(str(value))
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not any(t.name == name for t in tools):
            raise ToolsRefused(f"'tool_choice' names {name!r}, which is not among the tools",
                           "tool_choice")
        return ToolChoice("required", str(name))
    raise ToolsRefused("'tool_choice' must be none, auto, required or "
                        "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


def offered(tools: tuple[Tool, ...], choice: ToolChoice) -> tuple[Tool, ...]:
    """The tools the model may call now."""
    if choice.mode == "none":
        return ()
    return tuple(t for t in tools if not choice.name or t.name == choice.name)


def system_text(tools: tuple[Tool, ...], choice: ToolChoice) -> str:
    """What the system prompt says of the tools ("" when none may be called)."""
    usable = offered(tools, choice)
    if not usable:
        return ""
    listed = "\n".join(json.dumps({"name": t.name, "description": t.description,
                                   "parameters": t.parameters}) for t in usable)
    how = ('To call a function, reply with only a JSON object: {"name": "<function name>", '
           '"arguments": {<its arguments>}}.')
    if choice.mode == "auto":
        how += " Otherwise reply in plain text as usual."
    return f"You can call these functions:\n{listed}\n{how}"


def call_text(name: str, arguments: str) -> str:
    """A call as the model writes it (what the history shows of an assistant's call)."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        args = arguments
    return json.dumps({"name": name, "arguments": args})


def result_text(name: str, content: str) -> str:
    """A tool's result as the model reads it."""
    return f"The function {name} returned: {content}"


def spec(tool: Tool) -> dict[str, Any]:
    """A tool as OpenAI sends it (what a chat template that lists `tools` reads)."""
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": tool.parameters}}


def grammar(tools: tuple[Tool, ...], choice: ToolChoice, fmt: str | None = None) -> str:
    """GBNF for the reply: one call to an offered function (in the template's format `fmt`,
    else bare JSON), or (auto) text that does not begin like a call. "" when no tool may be
    called."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    usable = offered(tools, choice)
    if not usable:
        return ""
    key = _ARGUMENTS.get(fmt or "", "arguments")
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, key: t.parameters},
              "required": ["name", key], "additionalProperties": False} for t in usable]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    try:
        gbnf = str(json_schema_to_gbnf(json.dumps(schema), prop_order=["name", key]))
    except Exception as exc:  # noqa: BLE001 - the converter raises many kinds
        raise ToolsRefused(f"a tool's parameters cannot be followed: {exc}", "tools") from None
    parallel = choice.parallel and fmt != LLAMA3  # Llama 3's template takes one call a turn
    more = f"{{0,{MAX_PARALLEL_CALLS - 1}}}"
    call = re.sub(r"^root ::= ", "ebb-tool-call ::= ", gbnf, flags=re.M)
    if fmt in OPENERS:
        inner = f'ebb-tool-call ("," " "? ebb-tool-call){more}' if parallel and fmt == MISTRAL \
            else "ebb-tool-call"
        block = {HERMES: '"<tool_call>\\n" ebb-tool-call "\\n</tool_call>"',
                 MISTRAL: f'"[TOOL_CALLS]" " "? "[" {inner} "]"'}[fmt]
        call += f"\nebb-call-block ::= {block}"
        several = parallel and fmt == HERMES  # several calls: several blocks
        call += f'\nebb-calls ::= ebb-call-block' + (f' ("\\n" ebb-call-block){more}' if several else "")
        if choice.mode == "required":
            return call + "\nroot ::= ebb-calls"
        opener = "\\[" if fmt == MISTRAL else OPENERS[fmt]  # "[" is escaped in a GBNF class
        return (call + "\nroot ::= ebb-calls | ebb-text"
                + f'\nebb-text ::= [^{opener} \\t\\r\\n] [^\\x00]*')
    if choice.mode == "required" and not parallel:  # bare JSON: the call is the whole reply
        return gbnf
    call += "\nebb-calls ::= ebb-tool-call" + (f' ("\\n" ebb-tool-call){more}' if parallel else "")
    if choice.mode == "required":  # the calls, a line each, are the whole reply
        return call + "\nroot ::= ebb-calls"
    return (call + "\nroot ::= ebb-calls | ebb-text"
            + '\nebb-text ::= [^{ \\t\\r\\n] [^\\x00]*')


def text_grammar(fmt: str | None = None) -> str:
    """GBNF for a reply that is text and does not begin like a call in format `fmt`."""
    opener = "\\[" if fmt == MISTRAL else OPENERS.get(fmt or "", "{")
    return f'root ::= [^{opener} \\t\\r\\n] [^\\x00]*'


def call_key(name: str, arguments: Any) -> tuple[str, str]:
    """A call's function and its arguments in one canonical text (keys sorted), so that the
    same call written with other spacing or key order is known as the same."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass
    return name, json.dumps(arguments, sort_keys=True)


def answered_calls(messages: tuple[Any, ...] | list[Any]) -> frozenset[tuple[str, str]]:
    """The calls (`call_key`) made since the user's last message whose results have come back:
    the model has what they return, so the same call again is a loop, not a step (see
    engine/server/worker.py: such a reply is taken again as text). `messages` are the
    request's turns as they came (role, text, extra with `tool_calls` / `tool_call_id`)."""
    made: dict[str, tuple[str, str]] = {}
    done: set[tuple[str, str]] = set()
    for turn in messages:
        extra = turn.extra or {}
        if turn.role == "user":
            made.clear()
            done.clear()
        elif turn.role == "assistant":
            for c in extra.get("tool_calls") or ():
                fn = c.get("function") or {}
                made[str(c.get("id"))] = call_key(str(fn.get("name")), fn.get("arguments"))
        elif turn.role == "tool" and str(extra.get("tool_call_id")) in made:
            done.add(made[str(extra.get("tool_call_id"))])
    return frozenset(done)


_HERMES_BLOCK = re.compile(r"\s*<tool_call>\s*(.*?)\s*</tool_call>\s*", re.S)
# the reply's text has no [TOOL_CALLS] when the model wrote the control token (it is not text)
_MISTRAL_BLOCK = re.compile(r"^\s*(?:\[TOOL_CALLS\])?\s*\[\s*(.*?)\s*\]\s*$", re.S)


def read_calls(text: str, tools: tuple[Tool, ...], choice: ToolChoice,
               fmt: str | None = None) -> list[ToolCall]:
    """The calls a reply makes (in the template's format `fmt`, else bare JSON, a line each),
    or [] when it is text (or no tool could be called, or a call was cut short)."""
    usable = {t.name for t in offered(tools, choice)}
    if not usable:
        return []
    if fmt == HERMES:
        parts, end = [], 0
        for m in _HERMES_BLOCK.finditer(text):
            if m.start() != end:
                return []
            parts.append(m.group(1))
            end = m.end()
        if not parts or end != len(text):
            return []
    elif fmt == MISTRAL:
        block = _MISTRAL_BLOCK.match(text)
        if block is None:
            return []
        try:
            objs = json.loads("[" + block.group(1) + "]")
        except ValueError:
            return []
        parts = [json.dumps(o) for o in objs] if isinstance(objs, list) else []
    else:
        parts = _json_objects(text)
    calls = [_call(p, usable, fmt) for p in parts]
    if not calls or any(c is None for c in calls):
        return []  # cut short (max_tokens): the client gets the text and finish "length"
    return [c for c in calls if c is not None]


def _json_objects(text: str) -> list[str]:
    """Bare JSON objects one after another (blank space between): each one's text."""
    out: list[str] = []
    pos, decoder = 0, json.JSONDecoder()
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return out
        if text[pos] != "{":
            return []
        try:
            _, end = decoder.raw_decode(text, pos)
        except ValueError:
            return []
        out.append(text[pos:end])
        pos = end


def _call(text: str, usable: set[str], fmt: str | None) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in usable:
        return None
    call_id = secrets.token_hex(5)[:9] if fmt == MISTRAL else "call_" + secrets.token_hex(12)
    return ToolCall(call_id, str(obj["name"]),
                    json.dumps(obj.get(_ARGUMENTS.get(fmt or "", "arguments"), {})))


_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _object_end(text: str, start: int) -> int | None:
    """Where the JSON value starting at `start` ends (its closing brace + 1), or None when the
    text ends first. Strings and escapes are stepped over."""
    depth, i, in_string = 0, start, False
    while i < len(text):
        ch = text[i]
        if in_string:
            if ch == "\\":
                i += 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


class ArgumentStream:
    """A held call's arguments streamed as the model writes them, in OpenAI's delta shape: the
    first delta of a call has its id and name, the next ones add to its arguments' text."""

    def __init__(self, fmt: str | None) -> None:
        self.fmt = fmt
        self.sent: list[tuple[str, int]] = []  # per call: its id, how much of its arguments

    def deltas(self, held: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        pos = 0
        for index in range(MAX_PARALLEL_CALLS):
            head = _CALL_HEAD.search(held, pos)
            if head is None:
                break
            end = _object_end(held, head.end())
            args = held[head.end():end] if end is not None else held[head.end():]
            if index == len(self.sent):
                call_id = (secrets.token_hex(5)[:9] if self.fmt == MISTRAL
                           else "call_" + secrets.token_hex(12))
                self.sent.append((call_id, 0))
                out.append({"index": index, "id": call_id, "type": "function",
                            "function": {"name": json.loads(f'"{head.group(1)}"'), "arguments": ""}})
            call_id, done = self.sent[index]
            if len(args) > done:
                out.append({"index": index, "function": {"arguments": args[done:]}})
                self.sent[index] = (call_id, len(args))
            if end is None:
                break
            pos = end
        return out

    @property
    def ids(self) -> list[str]:
        return [call_id for call_id, _ in self.sent]


class CallGate:
    """Streams a reply that may be a call: text goes out as it comes, unless it begins with
    `opener` ("{", or "<" for a template's <tool_call>; after any blank space), which may be a
    call: that is held to the end."""

    def __init__(self, active: bool, opener: str = "{") -> None:
        self.active, self.opener = active, opener
        self.held = ""
        self.holding = active  # until the first visible character says which

    def feed(self, piece: str) -> str:
        if not self.holding:
            return piece
        self.held += piece
        start = self.held.lstrip()
        if not start:
            return ""
        if start.startswith(self.opener):
            return ""  # held to the end
        self.holding = False
        out, self.held = self.held, ""
        return out

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out
