"""A turn that calls tools: the model's call, the user's say, the tool's result, the model
again, until a reply without a call, for the window and `ebb-engine chat --mcp`.

- The tools go to the model in its template's own format where it has one Ebb knows (Hermes,
  Llama 3.1, Mistral: calls.template_format), else in the universal one (described in the
  system prompt, calls as bare JSON); either way the call is held to the tool's schema by
  llama.cpp's grammar, and a reply that begins like a call is held back from the text shown.
- One call a round. Each round is a turn on the same session: the call stays in the history as
  the template writes calls, the result follows as a `tool` message (a user message in the
  universal format), and only those new tokens are evaluated: the KV cache holds the rest.
- A result's pictures and clips go in with its message, through the same swap as attached ones,
  when the projector sees (hears); else the model is told in words what it cannot see.
- Every call is asked (`ask`) unless the user said "always" for that tool in this chat; the
  same call with the same arguments a second time in one turn ends the turn with a message;
  after `max_rounds` rounds of calls the model answers without tools. A Stop ends the running
  call (the host abandons it; the server is told) and the turn.
"""
from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from engine.tools.calls import (
    NAME_RE,
    OPENERS,
    CallGate,
    Tool,
    ToolCall,
    ToolChoice,
    ToolsRefused,
    call_text,
    grammar,
    read_calls,
    result_text,
    spec,
    system_text,
    template_format,
    text_grammar,
)

if TYPE_CHECKING:
    from engine.events import TurnResult
    from engine.llama.sampling import GenParams
    from engine.session import Session
    from engine.tools.host import CallOutcome, ServerTool

MAX_ROUNDS = 8


class Decision(str, Enum):
    ONCE = "once"  # Allow once
    ALWAYS = "always"  # Always for this tool in this chat
    DENY = "deny"


@dataclass(frozen=True)
class Offered:
    """A server's tool as the model is offered it: `fn` is the name it calls (the tool's own,
    or server_tool where two servers offer the same name)."""
    fn: str
    tool: "ServerTool"

    @property
    def label(self) -> str:
        return self.tool.label


@dataclass
class CallRecord:
    """One call of a turn, as the window's card and `chat --json` show it."""
    id: str
    fn: str
    label: str  # server:tool
    arguments: dict[str, Any]
    round: int
    state: str = "asked"  # asked | running | done | failed | denied | cancelled | timeout | repeat
    decision: str = ""  # once | always | deny | allowed (the chat's "always")
    outcome: "CallOutcome | None" = None
    said_to_model: str = ""  # the result as the model read it

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "tool": self.label, "function": self.fn, "arguments": self.arguments,
                "round": self.round, "state": self.state, "decision": self.decision,
                "result": self.outcome.to_dict() if self.outcome else None,
                "said": self.said_to_model}


def stored_record(call: dict[str, Any]) -> dict[str, Any]:
    """A call as a chat keeps it, from its CallRecord.to_dict (what the window was told)."""
    result = call.get("result") or {}
    return {"id": call.get("id", ""), "fn": call.get("function", ""), "label": call.get("tool", ""),
            "arguments": call.get("arguments", {}), "state": call.get("state", ""),
            "decision": call.get("decision", ""), "seconds": result.get("seconds", 0.0),
            "is_error": bool(result.get("is_error")), "chars": result.get("chars", 0),
            "result": str(result.get("text", ""))[:4000]}


def result_message(fn: str, said: str, n_files: int) -> str:
    """A result as a user message says it (the generic format). With pictures or clips the
    message says what it brings ("returned this picture."): after "returned: " and a picture,
    the demo model wrote `The function returned: "picture".`; told what came, it says what it
    sees ("a solid red picture")."""
    if not n_files:
        return result_text(fn, said)
    what = "this" if n_files == 1 else f"these {n_files}"
    kind = "picture" if n_files == 1 else "attachments"
    return f"The function {fn} returned {what} {kind}." + (f"\n{said}" if said else "")


def history_turns(turns: list[tuple[Any, ...]], fmt: str | None) -> list[tuple[Any, ...]]:
    """A saved chat's messages as the session takes them, each kept call (role "tool", with
    its stored record) as the two messages the loop made of it: the model's call (as the
    template `fmt` writes calls, else as the bare JSON the model wrote) and its result."""
    out: list[tuple[Any, ...]] = []
    for role, text, images, *more in turns:
        tool = more[0] if more else None
        if role != "tool" or not isinstance(tool, dict):
            out.append((role, text, images))
            continue
        fn, cid = str(tool.get("fn") or "tool"), str(tool.get("id") or "call_0")
        args = tool.get("arguments") if isinstance(tool.get("arguments"), dict) else {}
        call = ToolCall(cid, fn, json.dumps(args))
        if fmt is not None:
            out.append(("assistant", "", [], {"tool_calls": [call.for_template()]}))
            out.append(("tool", text, images, {"tool_call_id": cid, "name": fn}))
        else:
            out.append(("assistant", call_text(fn, call.arguments), [], None))
            out.append(("user", result_message(fn, text, len(images)), images, None))
    return out


@dataclass
class ToolTurn:
    """What a turn with tools did: each round's TurnResult, the calls, and how it ended."""
    rounds: list["TurnResult"] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    ended: str = "reply"  # reply | repeat | rounds | stopped | error
    text: str = ""  # the text shown, every round's (calls held back)
    message: str = ""  # what the user should read about how it ended (a repeat, the limit)

    @property
    def last(self) -> "TurnResult":
        return self.rounds[-1]


def offer(tools: list["ServerTool"], on: Callable[["ServerTool"], bool] = lambda t: True
          ) -> tuple[list[Offered], list[str]]:
    """The tools offered to the model (those `on` allows), each with a name the model can call
    (1-64 of A-Z a-z 0-9 _ -, unique), and what was left out and why (a schema llama.cpp's
    grammar cannot follow)."""
    picked = [t for t in tools if on(t)]
    counts: dict[str, int] = {}
    for t in picked:
        counts[t.name] = counts.get(t.name, 0) + 1
    out: list[Offered] = []
    left: list[str] = []
    used: set[str] = set()
    for t in picked:
        base = t.name if counts[t.name] == 1 and NAME_RE.match(t.name) else f"{t.server}_{t.name}"
        fn = re.sub(r"[^A-Za-z0-9_-]", "_", base)[:64]
        n = 2
        while fn in used:
            fn = f"{fn[:60]}_{n}"
            n += 1
        try:
            grammar((Tool(fn, t.description, t.schema),), ToolChoice("required"))
        except ToolsRefused as exc:
            left.append(f"{t.label}: {exc.what}")
            continue
        used.add(fn)
        out.append(Offered(fn, t))
    return out, left


def first_choice(value: str, offered: list[Offered]) -> ToolChoice:
    """--tool-choice auto|required|none|NAME (a tool's name, or server:tool) for the first
    round."""
    if value in ("auto", "required", "none"):
        return ToolChoice(value)
    for o in offered:
        if value in (o.fn, o.label, o.tool.name):
            return ToolChoice("required", o.fn)
    from engine.errors import EbbError

    raise EbbError(f"no tool offered is called {value!r}",
                   "offered: " + (", ".join(o.label for o in offered) or "none"))


def _sees(session: "Session", clips: bool) -> bool:
    pr = session.encoder.ram
    return pr is not None and session.encoder.enabled and (pr.hears if clips else pr.sees)


def _for_model(session: "Session", outcome: "CallOutcome") -> tuple[str, list[Path]]:
    """The result's text and files as the model gets them: pictures (clips) it cannot take are
    said in words."""
    text = outcome.text
    files: list[Path] = []
    notes: list[str] = []
    for group, clips in ((outcome.pictures, False), (outcome.clips, True)):
        if not group:
            continue
        if _sees(session, clips):
            files.extend(group)
        else:
            what = "sound clip" if clips else "picture"
            why = ("no projector that hears is loaded" if clips else
                   "no projector that sees is loaded") if session.encoder.ram is None or not \
                session.encoder.enabled else ("the projector does not hear" if clips else
                                              "the projector does not see")
            notes.append(f"[the tool returned {len(group)} {what}{'s' if len(group) > 1 else ''}, "
                         f"which you cannot {'hear' if clips else 'see'}: {why}]")
    text = "\n".join(x for x in (text, *notes) if x)
    return text or ("(no output)" if not files else ""), files


def run_tool_turn(session: "Session", text: str, images: list[str], gp: "GenParams",
                  offered: list[Offered], *,
                  ask: Callable[[CallRecord], Decision],
                  call: Callable[[CallRecord, threading.Event], "CallOutcome"],
                  always: set[str] | None = None,
                  on_text: Callable[[str], None] | None = None,
                  on_call: Callable[[CallRecord], None] | None = None,
                  cancel: threading.Event | None = None,
                  choice: ToolChoice | None = None,
                  system: str | None = None,
                  max_rounds: int = MAX_ROUNDS,
                  turn: Callable[..., tuple["Session", "TurnResult"]] | None = None,
                  ) -> tuple["Session", ToolTurn]:
    """The user's message `text` (with `images`) and the rounds of calls it leads to. `always`:
    the labels (server:tool) the user allowed for this chat; a new "always" is added to it.
    `turn(session, text, images, gp, on_text, cancel, role, extra)`: one turn on the session
    (the window's survives a lost device). Returns the session to go on with."""
    from engine.session import turn_with_recovery

    if turn is None:
        def turn(s: "Session", t: str, i: list[Any], g: "GenParams", ot: Any, c: Any,
                 role: str, extra: Any) -> tuple["Session", "TurnResult"]:
            return turn_with_recovery(s, t, i, g, on_text=ot, cancel=c, role=role, extra=extra)
    cancel = cancel or threading.Event()
    always = always if always is not None else set()
    out = ToolTurn()
    tools = tuple(Tool(o.fn, o.tool.description, o.tool.schema) for o in offered)
    by_fn = {o.fn: o for o in offered}
    runtime = session.model.runtime
    fmt = template_format(runtime.template_source) if tools and runtime is not None else None
    # the same system prompt and tools every round: the KV cache keeps all before the new message
    if fmt is not None:
        session.set_tools([spec(t) for t in tools])
        session.set_system(system)
    else:
        session.set_tools(None)
        described = system_text(tools, ToolChoice("auto"))
        session.set_system("\n\n".join(x for x in (system, described) if x) or None)
    seen: set[tuple[str, str]] = set()
    choice = choice or ToolChoice("auto" if tools else "none")
    files: list[Any] = list(images)  # paths: the message's, then a result's
    message, role, extra = text, "user", None
    rounds = 0
    while True:
        if rounds >= max_rounds and choice.mode != "none" and out.ended != "repeat":
            choice = ToolChoice("none")
            out.message = (f"{max_rounds} rounds of tool calls in this turn: the model answers "
                           "without tools now")
        usable = tools if choice.mode != "none" else ()
        g = grammar(usable, choice, fmt) if usable else (text_grammar(fmt) if tools else gp.grammar)
        gate = CallGate(bool(usable), OPENERS.get(fmt or "", "{"))

        def shown(piece: str, gate: CallGate = gate) -> None:
            s = gate.feed(piece)
            if s:
                out.text += s
                if on_text is not None:
                    on_text(s)

        session, res = turn(session, message, files, replace(gp, grammar=g), shown, cancel, role, extra)
        out.rounds.append(res)
        held = gate.flush()
        calls = read_calls(held, usable, choice, fmt) if usable and res.error is None else []
        if not calls:
            if held:
                out.text += held
                if on_text is not None:
                    on_text(held)
            if res.error is not None:
                out.ended = "error"
            elif cancel.is_set():
                out.ended = "stopped"
            elif out.ended != "repeat" and out.message:
                out.ended = "rounds"
            return session, out
        c = calls[0]
        rounds += 1
        try:
            args = json.loads(c.arguments) if c.arguments.strip() else {}
        except ValueError:
            args = {}
        o = by_fn[c.name]
        rec = CallRecord(c.id, c.name, o.label, args if isinstance(args, dict) else {}, rounds)
        out.calls.append(rec)
        # the call stays as the template writes calls (universal: as the model wrote it)
        if fmt is not None:
            session.reply_was_calls("", [c.for_template()])
        if c.key() in seen:  # a loop a small model would not leave: the same message is
            # answered again, without tools (as the endpoint takes such a reply again as text)
            rec.state = "repeat"
            _tell(on_call, rec)
            out.ended = "repeat"
            out.message = (f"The model called {o.label} with the same arguments a second time in "
                           "this turn: it answers without tools instead of going round again.")
            out.calls.pop()
            session.take_back_last()
            choice, rounds = ToolChoice("none"), max_rounds
            continue
        seen.add(c.key())
        if o.label in always:
            rec.decision = "allowed"
        else:
            _tell(on_call, rec)
            decision = ask(rec) if not cancel.is_set() else Decision.DENY
            rec.decision = decision.value
            if decision is Decision.ALWAYS:
                always.add(o.label)
        from engine.tools.host import CallOutcome

        if cancel.is_set():
            rec.state, rec.outcome = "cancelled", CallOutcome("cancelled", "the call was stopped by the user")
        elif rec.decision == Decision.DENY.value:
            rec.state, rec.outcome = "denied", CallOutcome("denied", "the user did not allow this call")
        else:
            rec.state = "running"
            _tell(on_call, rec)
            rec.outcome = call(rec, cancel)
            rec.state = rec.outcome.state if rec.outcome.state != "done" or not rec.outcome.is_error \
                else "failed"
        said, files = _for_model(session, rec.outcome)
        rec.said_to_model = said
        _tell(on_call, rec)
        if fmt is not None:
            message, role, extra = said, "tool", {"tool_call_id": c.id, "name": c.name}
        else:
            message, role, extra = result_message(c.name, said, len(files)), "user", None
        choice = ToolChoice("auto")


def _tell(on_call: Callable[[CallRecord], None] | None, rec: CallRecord) -> None:
    if on_call is not None:
        on_call(rec)
