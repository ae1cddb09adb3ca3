"""What closes a JSON reply that is being written: fed the reply's text as it comes, `closer()`
says the shortest text that makes it one complete JSON value. A JSON reply with a length cap
ends in it (the runtime writes it when the cap is near), so a client always gets JSON it can
parse: a small model in llama.cpp's JSON grammar rambled on inside a string ("f/f/f…") until
the cap cut it (#52). `looping()` says when the value has gone round in a circle (the same
text again and again, or container after container opened and none closed): the runtime then
closes it at once rather than at the cap, where llama.cpp's grammar alone loops to it (#67).
Pure; the engine's worker thread calls it."""
from __future__ import annotations

from dataclasses import dataclass, field

LITERALS = ("true", "false", "null")
LOOP_REPEATS = 6  # the same text (with a string in it) this many times back to back is a loop
LOOP_UNIT_CHARS = (6, 160)  # ... for a repeated unit of these lengths
LOOP_OPENS = 8  # objects or arrays opened one inside the other with none closed: a loop
_TAIL_CHARS = LOOP_UNIT_CHARS[1] * LOOP_REPEATS


@dataclass
class _Open:
    """An object or array being written."""
    opener: str  # "{" or "["
    expect: str  # what it waits for: "key", "colon", "value" or "next" (a comma or its end)
    empty: bool = True  # nothing in it yet


@dataclass
class JsonTail:
    stack: list[_Open] = field(default_factory=list)  # innermost last
    in_string: bool = False
    escape: str = ""  # an escape begun in a string: "\\", or "\\u" and the hex digits so far
    word: str = ""  # a number or a literal being written
    started: bool = False  # the top value has begun
    done: bool = False  # the top value is complete
    opens_in_a_row: int = 0  # containers opened since one was last closed
    tail: str = ""  # the last text written (what `looping` looks at)
    closed_a_loop: bool = False  # the runtime closed it because it went round (not at the cap)

    def feed(self, text: str) -> None:
        for ch in text:
            self._char(ch)
        self.tail = (self.tail + text)[-_TAIL_CHARS:]

    def looping(self) -> bool:
        """The value goes round: its text ends in LOOP_REPEATS copies of one piece with a string
        in it (spaces aside: numbers alone may repeat, a row of zeros is data), or LOOP_OPENS
        containers were opened one in another with none closed."""
        if self.done:
            return False
        if self.opens_in_a_row >= LOOP_OPENS:
            return True
        text = "".join(self.tail.split())
        low, high = LOOP_UNIT_CHARS
        for n in range(low, min(high, len(text) // LOOP_REPEATS) + 1):
            unit = text[-n:]
            if '"' in unit and text.endswith(unit * LOOP_REPEATS):
                return True
        return False

    def _char(self, ch: str) -> None:
        if self.in_string:
            self._string_char(ch)
            return
        if self.word and not (ch.isalnum() or ch in "+-."):
            self.word = ""
            self._value_done()
        if ch.isspace():
            return
        if ch in "{[":
            self._begins()
            self.stack.append(_Open(ch, "key" if ch == "{" else "value"))
            self.opens_in_a_row += 1
        elif ch in "}]":
            self.opens_in_a_row = 0
            if self.stack:
                self.stack.pop()
                self._value_done()
        elif ch == '"':
            self._begins()
            self.in_string = True
        elif ch == ":":
            if self.stack:
                self.stack[-1].expect = "value"
        elif ch == ",":
            if self.stack:
                top = self.stack[-1]
                top.expect = "key" if top.opener == "{" else "value"
        else:  # a number or a literal
            if not self.word:
                self._begins()
            self.word += ch

    def _begins(self) -> None:
        """A key or a value begins here."""
        self.started = True
        if self.stack:
            self.stack[-1].empty = False

    def _string_char(self, ch: str) -> None:
        if self.escape:
            if self.escape == "\\" and ch != "u":
                self.escape = ""
            else:
                self.escape += ch
                if len(self.escape) == 6:  # \uXXXX
                    self.escape = ""
            return
        if ch == "\\":
            self.escape = "\\"
        elif ch == '"':
            self.in_string = False
            if self.stack and self.stack[-1].expect == "key":
                self.stack[-1].expect = "colon"
            else:
                self._value_done()

    def _value_done(self) -> None:
        if self.stack:
            self.stack[-1].expect = "next"
        elif self.started:
            self.done = True

    def closer(self) -> str:
        """The shortest text after which the reply is one complete JSON value."""
        if self.done:
            return ""
        if not self.started:
            return "{}"
        out = ""
        pending = [o.expect for o in self.stack]
        if self.in_string:
            if self.escape == "\\":
                out += "n"
            elif self.escape:  # \u and fewer than four hex digits
                out += "0" * (6 - len(self.escape))
            out += '"'
            if pending:
                pending[-1] = "colon" if pending[-1] == "key" else "next"
        elif self.word:
            out += _finish_word(self.word)
            if pending:
                pending[-1] = "next"
        for depth, o in enumerate(reversed(self.stack)):
            wants = pending[-1] if depth == 0 else "next"  # an outer one holds the inner as a value
            if wants == "colon":
                out += ": null"
            elif wants == "value" and not o.empty:  # after a colon or a comma
                out += "null"
            elif wants == "key" and not o.empty:  # after a comma
                out += '"": null'
            out += "}" if o.opener == "{" else "]"
        return out


def _finish_word(word: str) -> str:
    """What completes a number or a literal cut short."""
    for lit in LITERALS:
        if lit.startswith(word):
            return lit[len(word):]
    if word[-1] in "+-eE.":
        return "0"
    return ""
