"""The MCP servers' clients: the official SDK's `Client`, each server's connection a task on one
event loop in a thread of its own, so nothing a server does (never starting, garbage on stdout,
a hang, a crash, 50 MB of result) can hold the window's thread or the engine's.

- A stdio server runs in its own process group (the SDK starts it in a new session) with a small
  environment (the SDK's) plus the user's `env`; its stderr goes to a file of ours, whose last
  lines a failure shows. `close()` ends them all (the SDK closes stdin, then ends the group).
- Each server has a state (`ServerState`): off, starting, ready with its tools, failed with why.
  A server that dies while ready is seen at once (its stream ends), not at the next call.
- `call()` blocks its caller (the engine's thread), not the loop: a Stop (`cancel`) or the
  server's timeout abandons the request, which sends MCP's `notifications/cancelled`.
- A result becomes what the model reads: its text (capped), its pictures and sound as files in
  `files_dir` (they go through the same swap as attached ones).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import hashlib
import json
import re
import tempfile
import threading
import time
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable

from engine.tools.servers import ServerDef

START_TIMEOUT_S = 90.0  # a server that has not answered the handshake and its tools by then failed
# (npx and uvx fetch a server on its first start: a minute is not unusual)
MAX_RESULT_CHARS = 24_000  # of a result's text, for the model (the rest is said to be cut)
MAX_RESULT_FILES = 8  # pictures and clips of one result
MAX_FILE_BYTES = 64 << 20  # one picture's or clip's bytes
MAX_HTTP_EVENT_BYTES = 256 << 20  # one server-sent event (the SDK's default, 1 MiB, refuses big results)
STDERR_TAIL_LINES = 12
CLOSE_WAIT_S = 8.0  # the SDK ends a stdio server within ~6.5 s (stdin closed, TERM, KILL)

OFF, STARTING, READY, FAILED = "off", "starting", "ready", "failed"

_PICTURE_EXT = {"image/png": ".png", "image/jpeg": ".jpg", "image/jpg": ".jpg", "image/webp": ".webp",
                "image/gif": ".gif", "image/bmp": ".bmp"}
_SOUND_EXT = {"audio/wav": ".wav", "audio/x-wav": ".wav", "audio/wave": ".wav", "audio/mpeg": ".mp3",
              "audio/mp3": ".mp3", "audio/ogg": ".ogg", "audio/flac": ".flac", "audio/mp4": ".m4a",
              "audio/webm": ".webm"}


@dataclass(frozen=True)
class ServerTool:
    server: str
    name: str  # the tool's own name on its server
    description: str
    schema: dict[str, Any]  # its input's JSON schema

    @property
    def label(self) -> str:
        """As the window shows it: server:tool."""
        return f"{self.server}:{self.name}"


@dataclass(frozen=True)
class ServerState:
    name: str
    phase: str = OFF  # off | starting | ready | failed
    tools: tuple[ServerTool, ...] = ()
    message: str = ""  # why it failed, or what it is waiting for
    stderr_tail: str = ""  # a stdio server's last lines on stderr
    protocol: str = ""  # the protocol version the SDK agreed with it
    skipped: tuple[str, ...] = ()  # tools it offers that cannot be offered to a model, and why

    def words(self) -> str:
        if self.phase == READY:
            n = len(self.tools)
            out = f"ready with {n} tool{'s' if n != 1 else ''}"
            return out + (f" ({len(self.skipped)} left out)" if self.skipped else "")
        if self.phase == FAILED:
            return f"failed: {self.message}" if self.message else "failed"
        return self.message or self.phase


@dataclass
class CallOutcome:
    """A call's end as the model and the window see it."""
    state: str  # done | failed | cancelled | timeout
    text: str = ""  # what the model reads
    pictures: list[Path] = field(default_factory=list)
    clips: list[Path] = field(default_factory=list)
    seconds: float = 0.0
    is_error: bool = False  # the tool itself said it failed (its text says how)
    chars: int = 0  # the result text's whole length (more than `text` when it was cut)

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "text": self.text, "pictures": [str(p) for p in self.pictures],
                "clips": [str(p) for p in self.clips], "seconds": round(self.seconds, 3),
                "is_error": self.is_error, "chars": self.chars}


class _Entry:
    def __init__(self, defn: ServerDef) -> None:
        self.defn = defn
        self.state = ServerState(defn.name)
        self.client: Any = None
        self.stop: asyncio.Event | None = None
        self.task: asyncio.Task[None] | None = None
        self.errlog: Any = None  # the stdio server's stderr, a file of ours
        self.generation = 0  # its starts: a stopped start's last words do not overwrite a new one's


class ToolHost:
    """The servers' connections. Any thread may call its methods; `on_state` is called on the
    host's thread whenever a server's state changes (the window hands it to Qt)."""

    def __init__(self, files_dir: Path, on_state: Callable[[ServerState], None] | None = None,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.files_dir = Path(files_dir)
        self.on_state = on_state or (lambda s: None)
        self.start_timeout_s = start_timeout_s
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._changed = threading.Condition()

    def settled(self, timeout_s: float | None = None,
                until: Callable[[list[ServerState]], bool] | None = None) -> bool:
        """Wait (any thread but the host's) until no server is starting, or `until(states)`;
        False when `timeout_s` ran out first."""
        until = until or (lambda states: all(s.phase != STARTING for s in states))
        with self._changed:
            return self._changed.wait_for(lambda: until(self.states()), timeout_s)

    # ------------------------------------------------------------ the loop's thread

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def run() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                self._thread = threading.Thread(target=run, name="ebb-mcp", daemon=True)
                self._thread.start()
                ready.wait()
                self._loop = loop
            return self._loop

    def _submit(self, coro: Any) -> "concurrent.futures.Future[Any]":
        return asyncio.run_coroutine_threadsafe(coro, self._ensure_loop())

    # ------------------------------------------------------------ servers

    def set_servers(self, defs: Iterable[ServerDef], may_start: Callable[[ServerDef], bool]) -> None:
        """The servers as they are now: a new or changed one starts when `may_start` says so
        (the user's consent, the chat's switch), a removed or changed one stops (a call it runs
        ends as failed)."""
        wanted = {d.name: d for d in defs if not d.disabled}
        for name, entry in list(self._entries.items()):
            if wanted.get(name) != entry.defn:  # it ends on the loop; nobody waits for it
                if entry.task is not None:
                    self._submit(self._stop(entry))
                del self._entries[name]
        for name, d in wanted.items():
            if name not in self._entries:
                self._entries[name] = _Entry(d)
            if self._entries[name].task is None and may_start(d):
                self._start(self._entries[name])

    def restart(self, name: str) -> None:
        """Stop the server's connection and start it again, on the loop: the caller (the
        window) does not wait for a server that is slow to end. It is "starting" from now."""
        entry = self._entries.get(name)
        if entry is None or self._closed:
            return
        gen = self._starting(entry)

        async def again() -> None:
            await self._stop(entry)  # the old connection's last words are not its state now
            self._begin(entry, gen)

        self._submit(again())

    def stop(self, name: str) -> None:
        entry = self._entries.get(name)
        if entry is None or entry.task is None:
            return
        fut = self._submit(self._stop(entry))
        try:
            fut.result(CLOSE_WAIT_S)
        except concurrent.futures.TimeoutError:
            pass

    def states(self) -> list[ServerState]:
        return [e.state for e in self._entries.values()]

    def state(self, name: str) -> ServerState | None:
        entry = self._entries.get(name)
        return entry.state if entry is not None else None

    def tools(self) -> list[ServerTool]:
        """Every ready server's tools, in the servers' order."""
        return [t for e in self._entries.values() if e.state.phase == READY for t in e.state.tools]

    def close(self) -> None:
        """End every server (a stdio server's process group with it) and the loop."""
        if self._closed:
            return
        self._closed = True
        if self._loop is None:
            return
        fut = self._submit(self._stop_all())
        try:
            fut.result(CLOSE_WAIT_S)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(2.0)

    # ------------------------------------------------------------ calls

    def call(self, server: str, tool: str, arguments: dict[str, Any],
             cancel: threading.Event | None = None, timeout_s: float | None = None) -> CallOutcome:
        """Call `tool` on `server` and wait for its result (or the server's timeout, or `cancel`:
        the request is abandoned and the server told). Never raises for what a server does."""
        t0 = time.monotonic()
        entry = self._entries.get(server)
        if entry is None or entry.state.phase != READY or entry.client is None:
            why = entry.state.words() if entry is not None else "it is not among the servers"
            return CallOutcome("failed", f"the server {server} cannot take calls: {why}",
                               seconds=time.monotonic() - t0)
        timeout = timeout_s if timeout_s is not None else entry.defn.timeout_s
        fut = self._submit(self._call(entry, tool, arguments, timeout))
        while True:
            try:
                out: CallOutcome = fut.result(0.1)
                break
            except concurrent.futures.TimeoutError:
                if cancel is not None and cancel.is_set():
                    fut.cancel()  # the task is cancelled: the SDK tells the server
                    out = CallOutcome("cancelled", "the call was stopped by the user")
                    break
            except concurrent.futures.CancelledError:
                out = CallOutcome("cancelled", "the call was stopped")
                break
        out.seconds = time.monotonic() - t0
        return out

    async def _call(self, entry: _Entry, tool: str, arguments: dict[str, Any],
                    timeout: float) -> CallOutcome:
        from mcp import MCPError

        client = entry.client
        name = entry.defn.name
        try:
            with _deadline(timeout + 2.0):  # the SDK's own timeout first; this if it does not
                result = await client.call_tool(tool, arguments, read_timeout_seconds=timeout)
        except TimeoutError:
            return CallOutcome("timeout", f"{name}:{tool} gave no result within {timeout:g} s")
        except MCPError as exc:
            if _timed_out(exc):
                return CallOutcome("timeout", f"{name}:{tool} gave no result within {timeout:g} s")
            if entry.state.phase != READY or _closed(exc):
                return CallOutcome("failed", f"the server {name} ended during the call"
                                   + _tail_words(self._tail(entry)))
            return CallOutcome("failed", f"{name}:{tool} failed: {exc.error.message}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a server's fault is the call's failure, said
            return CallOutcome("failed", f"{name}:{tool} failed: {type(exc).__name__}: {exc}"
                               + _tail_words(self._tail(entry)))
        return self._outcome(result)

    def _outcome(self, result: Any) -> CallOutcome:
        texts: list[str] = []
        pictures: list[Path] = []
        clips: list[Path] = []
        for block in getattr(result, "content", None) or ():
            kind = getattr(block, "type", "")
            if kind == "text":
                texts.append(str(block.text))
            elif kind in ("image", "audio"):
                mime = str(getattr(block, "mime_type", "") or "").lower()
                table = _PICTURE_EXT if kind == "image" else _SOUND_EXT
                saved = self._save(str(block.data), table.get(mime), len(pictures) + len(clips))
                if isinstance(saved, str):
                    texts.append(f"[a {'picture' if kind == 'image' else 'sound'} ({mime}) that "
                                 f"could not be read: {saved}]")
                else:
                    (pictures if kind == "image" else clips).append(saved)
            elif kind == "resource":
                res = block.resource
                text = getattr(res, "text", None)
                texts.append(str(text) if text is not None else
                             f"[a file {getattr(res, 'uri', '')} ({getattr(res, 'mime_type', '') or 'bytes'})]")
            elif kind == "resource_link":
                texts.append(f"[a link: {getattr(block, 'uri', '')}]")
        structured = getattr(result, "structured_content", None)
        if not texts and structured is not None:
            texts.append(json.dumps(structured))
        text = "\n".join(texts)
        chars = len(text)
        if chars > MAX_RESULT_CHARS:
            text = (text[:MAX_RESULT_CHARS]
                    + f"\n[the result was cut here: it had {chars} characters, the first "
                      f"{MAX_RESULT_CHARS} are shown]")
        return CallOutcome("done", text, pictures, clips, is_error=bool(getattr(result, "is_error", False)),
                           chars=chars)

    def _save(self, data: str, ext: str | None, n: int) -> Path | str:
        if ext is None:
            return "its type is not one Ebb reads"
        if n >= MAX_RESULT_FILES:
            return f"a result carries at most {MAX_RESULT_FILES} pictures and clips"
        if len(data) > MAX_FILE_BYTES * 4 // 3 + 4:
            return f"it is larger than {MAX_FILE_BYTES >> 20} MiB"
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            return "its base64 is invalid"
        if not raw:
            return "it is empty"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        path = self.files_dir / f"tool-{hashlib.sha256(raw).hexdigest()[:24]}{ext}"
        if not path.exists():
            tmp = path.with_name(path.name + ".part")
            tmp.write_bytes(raw)
            tmp.replace(path)
        return path

    # ------------------------------------------------------------ on the loop

    def _set(self, entry: _Entry, gen: int | None = None, **changes: Any) -> None:
        """The server's state changes (`gen`: only while that start is the server's latest)."""
        with self._changed:
            if gen is not None and gen != entry.generation:
                return
            entry.state = replace(entry.state, **changes)
            self._changed.notify_all()
        try:
            self.on_state(entry.state)
        except Exception:  # noqa: BLE001 - a listener's fault must not end the connection
            pass

    def _tail(self, entry: _Entry) -> str:
        f = entry.errlog
        if f is None:
            return ""
        try:
            f.flush()
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 8192))
            text = f.read()
        except (OSError, ValueError):
            return ""
        lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
        return "\n".join(lines[-STDERR_TAIL_LINES:])

    def _start(self, entry: _Entry) -> None:
        if self._closed:
            return
        gen = self._starting(entry)

        async def begin() -> None:
            self._begin(entry, gen)

        self._submit(begin()).result()

    def _starting(self, entry: _Entry) -> int:
        """A new start of the server: its number, and its state "starting" from now."""
        with self._changed:
            entry.generation += 1
            gen = entry.generation
        self._set(entry, phase=STARTING, message="starting", tools=(), stderr_tail="", skipped=())
        return gen

    def _begin(self, entry: _Entry, gen: int) -> None:
        """On the loop: the connection's task for start `gen` (unless a later one came)."""
        if gen != entry.generation or self._closed:
            return
        if entry.errlog is not None:  # a failed start's, read by now
            entry.errlog.close()
            entry.errlog = None
        entry.stop = asyncio.Event()
        entry.task = asyncio.ensure_future(self._serve(entry, gen))

    async def _stop(self, entry: _Entry) -> None:
        task = entry.task
        if entry.stop is not None:
            entry.stop.set()
        if task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(task), CLOSE_WAIT_S - 0.5)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - stopping: said as off
                task.cancel()
        entry.task = None

    async def _stop_all(self) -> None:
        await asyncio.gather(*(self._stop(e) for e in self._entries.values()), return_exceptions=True)

    async def _serve(self, entry: _Entry, gen: int) -> None:
        """The server's connection from its start to its stop or failure."""
        import anyio

        d = entry.defn
        lost = anyio.Event()
        if d.stdio and entry.errlog is None:  # kept past the connection: a failure shows its tail
            entry.errlog = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
        # the start's deadline, lifted once it is ready (a scope around the whole connection:
        # the client's task group opens inside it)
        start = anyio.CancelScope(deadline=anyio.current_time() + self.start_timeout_s)
        try:
            with start:
                await self._connected(entry, lost, start, gen)
            if start.cancelled_caught:
                raise TimeoutError
        except asyncio.CancelledError:
            entry.client = None
            self._set(entry, gen, phase=OFF, message="stopped", tools=())
            raise
        except BaseException as exc:  # noqa: BLE001 - any way a server fails is its state
            entry.client = None
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            self._set(entry, gen, phase=FAILED, tools=(), message=_failure_words(exc, self.start_timeout_s),
                      stderr_tail=self._tail(entry))
        else:
            self._set(entry, gen, phase=OFF, message="stopped", tools=())
        finally:
            if entry.errlog is not None and entry.state.phase != FAILED:
                entry.errlog.close()
                entry.errlog = None
            if entry.task is asyncio.current_task() and entry.state.phase == FAILED:
                entry.task = None  # a restart may start it again

    async def _connected(self, entry: _Entry, lost: Any, start: Any, gen: int) -> None:
        """Connect, list the tools, and hold the connection until a stop or the server's end."""
        import math

        from mcp import Client, Implementation

        d = entry.defn
        async with AsyncExitStack() as stack:
            transport = _watched(self._transport(d, entry.errlog), lost)
            client = await stack.enter_async_context(Client(
                transport, client_info=Implementation(name="Ebb", version="0.1"), cache=None))
            listed = await _list_tools(client, d.name)
            start.deadline = math.inf
            entry.client = client
            self._set(entry, gen, phase=READY, tools=listed[0], skipped=listed[1], message="",
                      protocol=str(client.protocol_version or ""))
            stop = entry.stop
            assert stop is not None
            waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(lost.wait())]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            entry.client = None
            if not stop.is_set():
                raise ConnectionError("the server ended")

    def _transport(self, d: ServerDef, errlog: Any) -> Any:
        if d.stdio:
            from mcp import StdioServerParameters

            from engine.tools.stdio import stdio_client

            return stdio_client(StdioServerParameters(
                command=d.command, args=list(d.args), env=dict(d.env) or None, cwd=d.cwd or None,
                encoding_error_handler="replace"), errlog=errlog)
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        http = httpx2.AsyncClient(headers=dict(d.headers) or None,
                                  timeout=httpx2.Timeout(30.0, read=max(300.0, d.timeout_s + 30)))
        return streamable_http_client(d.url, http_client=http, max_sse_event_size=MAX_HTTP_EVENT_BYTES)


@asynccontextmanager
async def _watched(transport: Any, lost: Any) -> AsyncIterator[Any]:
    """The transport's streams, with `lost` set the moment the server's side ends (a stdio
    server that died, an HTTP server gone): the state says so at once."""
    import anyio

    async with transport as (read, write):
        send, recv = anyio.create_memory_object_stream[Any](0)

        async def forward() -> None:
            try:
                async with send:
                    async for item in read:
                        await send.send(item)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
                pass
            finally:
                lost.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(forward)
            try:
                yield recv, write
            finally:
                tg.cancel_scope.cancel()


class _deadline:
    """anyio.fail_after without anyio at import time (raises TimeoutError)."""

    def __init__(self, seconds: float) -> None:
        import anyio

        self._scope = anyio.fail_after(seconds)

    def __enter__(self) -> Any:
        return self._scope.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self._scope.__exit__(*exc)


async def _list_tools(client: Any, server: str) -> tuple[tuple[ServerTool, ...], tuple[str, ...]]:
    """Every page of the server's tools; one whose schema is not an object schema is left out
    (and said), the others are offered."""
    tools: list[ServerTool] = []
    skipped: list[str] = []
    cursor = None
    for _ in range(100):
        page = await client.list_tools(cursor=cursor)
        for t in page.tools:
            schema = getattr(t, "input_schema", None)
            problem = schema_problem(schema)
            if problem:
                skipped.append(f"{t.name}: {problem}")
            else:
                tools.append(ServerTool(server, t.name, t.description or "", dict(schema or {})))
        cursor = page.next_cursor
        if not cursor:
            break
    return tuple(tools), tuple(skipped)


def schema_problem(schema: Any) -> str:
    """Why a tool's input schema cannot be offered ("" when it can): it must be a valid JSON
    schema of an object."""
    if not isinstance(schema, dict):
        return "its input schema is not a JSON object"
    if schema.get("type", "object") != "object":
        return f"its input schema is of type {schema.get('type')!r}, not an object"
    try:
        import jsonschema

        jsonschema.validators.validator_for(schema).check_schema(schema)
    except Exception as exc:  # noqa: BLE001 - SchemaError and kin: the schema is not valid
        return f"its input schema is invalid ({str(getattr(exc, 'message', exc))[:120]})"
    return ""


def _timed_out(exc: Any) -> bool:
    from mcp_types import REQUEST_TIMEOUT

    return getattr(exc, "code", None) == REQUEST_TIMEOUT


def _closed(exc: Any) -> bool:
    from mcp_types import CONNECTION_CLOSED

    return getattr(exc, "code", None) == CONNECTION_CLOSED


def _tail_words(tail: str) -> str:
    return f"; its last words: {tail.splitlines()[-1][:300]}" if tail else ""


def _failure_words(exc: BaseException, start_timeout_s: float) -> str:
    """One sentence for why a server failed, from whatever the SDK or anyio raised (groups of
    them included)."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        subs = getattr(e, "exceptions", None)
        if subs:
            for s in subs:
                walk(s)
        else:
            leaves.append(e)

    walk(exc)
    e = next((x for x in leaves if not isinstance(x, asyncio.CancelledError)), leaves[0] if leaves else exc)
    if isinstance(e, TimeoutError):
        return f"it did not answer within {start_timeout_s:g} s"
    if isinstance(e, FileNotFoundError):
        return f"the program {e.filename or ''} was not found".replace("  ", " ")
    if isinstance(e, PermissionError):
        return f"the program {e.filename or ''} may not be run (permission denied)".replace("  ", " ")
    if isinstance(e, ConnectionError) and str(e) == "the server ended":
        return "the server ended"
    if _closed(e):
        return "the server ended before it answered"
    msg = str(e) or type(e).__name__
    version = re.search(r"[Uu]nsupported protocol version[^:]*: *(\S+)", msg)
    if version:
        from mcp_types.version import KNOWN_PROTOCOL_VERSIONS

        return (f"it speaks MCP {version.group(1)}, which Ebb's MCP client does not know (it "
                f"speaks {KNOWN_PROTOCOL_VERSIONS[0]} to {KNOWN_PROTOCOL_VERSIONS[-1]}): "
                "a newer Ebb, or an older version of the server, will talk")
    if "ConnectError" in type(e).__name__ or "connect" in msg.lower() and "refused" in msg.lower():
        return f"cannot connect: {msg}"
    return f"{type(e).__name__}: {msg}"[:400]
