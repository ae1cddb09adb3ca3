"""The MCP servers a user adds, in the file people already have: `{"mcpServers": {NAME: {...}}}`
(Claude Desktop, LM Studio's mcp.json, koboldcpp's --mcpfile, Cursor). Pure: reading, checking
and writing that file, where other apps keep theirs, and what a user consents to.

A server is either
- stdio: `command`, `args` (a list of strings), `env` (names to values), `cwd`; it gets a small
  environment (the SDK's: HOME, LOGNAME, PATH, SHELL, TERM, USER) plus `env`, never the whole
  of the user's;
- Streamable HTTP: `url` (http or https) and `headers`.
Ebb's own keys beside them: `timeout` (seconds a call may take, default 60), `disabled`.
Keys Ebb does not know are kept as they are when the file is written again.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import EbbError

DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 3600.0
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_. -]{0,63}$")
_KNOWN = {"command", "args", "env", "cwd", "url", "headers", "timeout", "disabled", "type",
          "transport"}


@dataclass(frozen=True)
class ServerDef:
    """One server of the file, checked."""
    name: str
    command: str = ""  # stdio
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    cwd: str = ""
    url: str = ""  # Streamable HTTP
    headers: tuple[tuple[str, str], ...] = ()
    timeout_s: float = DEFAULT_TIMEOUT_S
    disabled: bool = False
    other: tuple[tuple[str, Any], ...] = field(default=(), compare=False)  # kept, not read

    @property
    def stdio(self) -> bool:
        return bool(self.command)

    def fingerprint(self) -> str:
        """What the user consented to: the command, its arguments, its environment and folder
        (a URL server runs nothing here: its fingerprint is its address). Another definition,
        another consent."""
        what = ([self.command, list(self.args), sorted(self.env), self.cwd] if self.stdio
                else [self.url])
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:32]

    def describe(self) -> str:
        """What starts, as the consent asks it: the exact command line and the names of the
        environment variables it gets (not their values: they are often keys)."""
        if not self.stdio:
            return f"connects to {self.url}"
        line = " ".join(_quoted(a) for a in (self.command, *self.args))
        names = ", ".join(k for k, _ in self.env)
        return line + (f"\nwith the environment variables {names}" if names else "") + \
            (f"\nin {self.cwd}" if self.cwd else "")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.other)
        if self.stdio:
            out["command"] = self.command
            if self.args:
                out["args"] = list(self.args)
            if self.env:
                out["env"] = dict(self.env)
            if self.cwd:
                out["cwd"] = self.cwd
        else:
            out["url"] = self.url
            if self.headers:
                out["headers"] = dict(self.headers)
        if self.timeout_s != DEFAULT_TIMEOUT_S:
            out["timeout"] = self.timeout_s
        if self.disabled:
            out["disabled"] = True
        return out


def _quoted(arg: str) -> str:
    return arg if arg and re.fullmatch(r"[\w@%+=:,./-]+", arg) else json.dumps(arg)


def _strings(value: Any, what: str) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, (str, int, float))
                                              for k, v in value.items()):
        raise EbbError(f"{what} must be an object of names to strings")
    return tuple((k, str(v)) for k, v in value.items())


def parse_server(name: str, spec: Any) -> ServerDef:
    """One entry of `mcpServers`, or an EbbError that names it and what is wrong."""
    where = f"the server {name!r}"
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise EbbError(f"a server's name must be 1-64 letters, digits, spaces, '.', '_' or '-' "
                       f"(not {name!r})")
    if not isinstance(spec, dict):
        raise EbbError(f"{where} must be an object with 'command' or 'url'")
    command, url = spec.get("command"), spec.get("url") or spec.get("serverUrl")
    if command is not None and url is not None:
        raise EbbError(f"{where} has both 'command' and 'url': it is one or the other")
    timeout = spec.get("timeout", DEFAULT_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT_S:
        raise EbbError(f"{where}: 'timeout' must be seconds, more than 0 and at most {MAX_TIMEOUT_S:.0f}")
    other = tuple((k, v) for k, v in spec.items() if k not in _KNOWN)
    disabled = bool(spec.get("disabled", False))
    if command is not None:
        if not isinstance(command, str) or not command.strip():
            raise EbbError(f"{where}: 'command' must be a program to run")
        args = spec.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, (str, int, float)) for a in args):
            raise EbbError(f"{where}: 'args' must be a list of strings")
        cwd = spec.get("cwd") or ""
        if not isinstance(cwd, str):
            raise EbbError(f"{where}: 'cwd' must be a folder")
        if any("\0" in s for s in (command, cwd, *map(str, args))):
            raise EbbError(f"{where}: its command has a NUL character")
        return ServerDef(name, command=command.strip(), args=tuple(str(a) for a in args),
                         env=_strings(spec.get("env"), f"{where}: 'env'"), cwd=cwd,
                         timeout_s=float(timeout), disabled=disabled, other=other)
    if url is not None:
        if not isinstance(url, str) or not re.match(r"^https?://[^\s/]+", url.strip()):
            raise EbbError(f"{where}: 'url' must be an http:// or https:// address")
        return ServerDef(name, url=url.strip(), headers=_strings(spec.get("headers"), f"{where}: 'headers'"),
                         timeout_s=float(timeout), disabled=disabled, other=other)
    raise EbbError(f"{where} needs 'command' (a program Ebb starts) or 'url' (a server that runs)")


def parse_config(data: Any, source: str = "the file") -> tuple[ServerDef, ...]:
    """`{"mcpServers": {...}}` (also `servers`, as VS Code writes it), every entry checked."""
    if not isinstance(data, dict):
        raise EbbError(f"{source} is not an MCP servers file: it must be a JSON object "
                       '{"mcpServers": {NAME: {...}}}')
    servers = data.get("mcpServers", data.get("servers"))
    if servers is None:
        return ()
    if not isinstance(servers, dict):
        raise EbbError(f"{source}: 'mcpServers' must be an object of names to servers")
    return tuple(parse_server(name, spec) for name, spec in servers.items())


def read_config(path: Path) -> tuple[ServerDef, ...]:
    """The servers of a file; none when it does not exist; an EbbError that names the file when
    it cannot be read or is not such a file."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        return ()
    except (OSError, UnicodeDecodeError) as exc:
        raise EbbError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data = json.loads(text) if text.strip() else {}
    except ValueError as exc:
        raise EbbError(f"{path} is not valid JSON ({exc})") from None
    return parse_config(data, str(path))


def write_config(path: Path, servers: tuple[ServerDef, ...] | list[ServerDef]) -> None:
    """The file anew (written beside and moved over it: a crash leaves the old one whole)."""
    from engine.json_file import write_object

    write_object(path, {"mcpServers": {s.name: s.to_json() for s in servers}})


def other_apps_files(home: Path | None = None) -> list[tuple[str, Path]]:
    """Where other apps keep their MCP servers on this machine (the ones that exist)."""
    home = home or Path.home()
    appdata = Path(os.environ.get("APPDATA", home / "AppData" / "Roaming"))
    places = [
        ("Claude Desktop", home / ".config" / "Claude" / "claude_desktop_config.json"),
        ("Claude Desktop", home / "Library" / "Application Support" / "Claude" / "claude_desktop_config.json"),
        ("LM Studio", home / ".lmstudio" / "mcp.json"),
        ("Cursor", home / ".cursor" / "mcp.json"),
    ]
    if sys.platform == "win32":
        places.append(("Claude Desktop", appdata / "Claude" / "claude_desktop_config.json"))
    return [(app, p) for app, p in places if p.is_file()]


def merged(ours: tuple[ServerDef, ...], theirs: tuple[ServerDef, ...]) -> tuple[ServerDef, ...]:
    """An import: their servers added after ours; one whose name is taken gets a number."""
    names = {s.name for s in ours}
    out = list(ours)
    for s in theirs:
        name, n = s.name, 2
        while name in names:
            name, n = f"{s.name} {n}", n + 1
        names.add(name)
        out.append(ServerDef(**{**s.__dict__, "name": name}))
    return tuple(out)
