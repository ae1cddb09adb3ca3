"""The HTTP side of `ebb-engine serve`: OpenAI's /v1 routes on Starlette, served by uvicorn.

Starlette and uvicorn (both from the encode project, widely used, ASGI) rather than a server
written here: HTTP/1.1 parsing, keep-alive, streaming with back-pressure and the client's
disconnect are theirs. FastAPI was not needed: the request checks live in `api/`, where they
are tested without HTTP. Requests are answered by a `Backend` (`ServeWorker`, or the window's
engine worker); replies stream back from its thread through an asyncio queue (`streams.py`).

The routes are a table (`ROUTES`) of module-level handlers, as Starlette's own examples keep
them; what they share (the backend, the key, the limits) is one `ServerState` on the app. A new
route is a handler here and a row in the table.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.llama.rpc_server import is_loopback as is_loopback  # rpc-serve's rule, re-exported
from engine.server.api.chat import (choice, completion, parse_chat_request,
                                    parse_transcription_request)
from engine.server.api.common import ApiError, new_id
from engine.server.api.completions import (legacy_logprobs, parse_completion_request, text_choice,
                                           text_completion)
from engine.server.api.embeddings import embedding_list, parse_embedding_request
from engine.server.guard import Policy, RequestGuard
from engine.server.streams import Waiting, chat_stream, text_stream, to_sse
from engine.server.jobs import Answer, Backend, Done, Event, Failed, Job, Piece
from engine.server.limits import DEFAULT_MAX_BODY, DEFAULT_MAX_WAIT_S

if TYPE_CHECKING:
    import uvicorn

# a route's answer from the backend's: the whole reply (a JSON body, or a Response)
Reply = Callable[[Answer, str, str], Any]
# a route's stream: server-sent events from the job's events
Stream = Callable[[Job, "asyncio.Queue[Event]", str, str, Waiting], AsyncIterator[str]]


@dataclass
class ServerState:
    """What every route shares: who answers, the API key (None: none needed), the body's
    limit, the one folder file:// pictures may come from (None: none), and how long a request
    that does not stream waits in line."""
    worker: Backend
    api_key: str | None = None
    max_body: int = DEFAULT_MAX_BODY
    image_folder: Path | None = None
    max_wait_s: float = DEFAULT_MAX_WAIT_S

    def check_key(self, request: Request) -> None:
        if not self.api_key:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise ApiError(401, "a valid API key is needed: Authorization: Bearer KEY",
                           code="invalid_api_key")

    def model_card(self) -> dict[str, Any]:
        w = self.worker
        created = int(w.model_path.stat().st_mtime) if w.model_path.exists() else 0
        # what the model answers here (not OpenAI's: a client that does not know it ignores it)
        can = ["chat.completions", "completions", "embeddings", "tools", "response_format",
               "logprobs"] + (["vision"] if w.vision else []) + (["audio"] if w.hearing else [])
        return {"id": w.model_id, "object": "model", "created": created, "owned_by": "ebb",
                "capabilities": can}

    def waiting_comment(self, job: Job) -> str:
        """A stream's keep-alive: its place in line while it waits (an SSE comment: clients
        skip it, a person watching the stream sees it)."""
        ahead = self.worker.ahead_of(job)
        return ": waiting\n\n" if ahead is None else f": waiting in line, {ahead} ahead\n\n"


def state_of(request: Request) -> ServerState:
    st: ServerState = request.app.state.ebb
    return st


def error(exc: ApiError) -> Response:
    headers = {"Retry-After": "2"} if exc.status == 503 else None
    if exc.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _check_length(request: Request, max_body: int) -> None:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_body:
        raise ApiError(413, f"the request body is {int(length)} bytes; the most is {max_body}")


async def read_json(request: Request) -> Any:
    """The body as JSON, at most the state's `max_body` bytes."""
    max_body = state_of(request).max_body
    _check_length(request, max_body)
    body = bytearray()
    try:
        async for part in request.stream():
            body += part
            if len(body) > max_body:
                raise ApiError(413, f"the request body is over {max_body} bytes")
    except ClientDisconnect:
        raise ApiError(400, "the client went away while sending") from None
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # not JSON, too deep, a too-long number
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None


async def read_form(request: Request) -> dict[str, Any]:
    """A multipart form (OpenAI's audio endpoints): its fields, a file's as its name and
    bytes; at most `max_body` bytes."""
    _check_length(request, state_of(request).max_body)
    try:
        form = await request.form(max_files=1, max_fields=16)
    except ClientDisconnect:
        raise ApiError(400, "the client went away while sending") from None
    except Exception as exc:  # noqa: BLE001 - the form parser's own words, whatever its kind
        raise ApiError(400, f"the body is not a multipart form: {exc}") from None
    out: dict[str, Any] = {}
    for key, value in form.multi_items():
        if isinstance(value, str):
            out[key] = value
        else:  # an uploaded file
            out[key] = (str(value.filename or ""), await value.read())
    await form.close()
    return out


async def answer(request: Request, parse: Callable[[Any], Any], reply: Reply,
                 stream: Stream | None,
                 read: Callable[[Request], Awaitable[Any]] = read_json) -> Response:
    """Check the body, queue the job, and answer: whole, or streamed by `stream`. `read`:
    the body another way than JSON (a form), as `parse` takes it."""
    st = state_of(request)
    try:
        st.check_key(request)
        req = parse(await read(request))
    except ApiError as exc:
        return error(exc)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()
    client = req.user or (f"{request.client.host}:{request.client.port}"
                          if request.client else "client")
    cancel = threading.Event()

    job = Job(req, client, Relay(loop, events, cancel).on_event, cancel=cancel, image_folder=st.image_folder)
    try:
        st.worker.submit(job)
    except ApiError as exc:
        return error(exc)
    cid, model = new_id(), st.worker.model_id
    if stream is not None and getattr(req, "stream", False):
        return StreamingResponse(to_sse(stream(job, events, cid, model, st.waiting_comment), job),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _whole(request, st, job, events, lambda a: reply(a, cid, model))


RELAY_TICK_S = 0.04  # a reply's pieces reach the server's loop at most this often (the first at once)


class Relay:
    """A job's events from the worker's thread into the server's loop, the pieces gathered: a
    wake-up of the loop per token took a core from llama.cpp's threads each time (on 2 cores,
    one client's tokens/s fell by a quarter or more); at most one per `RELAY_TICK_S` now, the
    first piece and the end at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop, events: asyncio.Queue[Event],
                 cancel: threading.Event) -> None:
        self.loop, self.events, self.cancel = loop, events, cancel
        self.lock = threading.Lock()
        self.held: list[Event] = []
        self.last = 0.0  # when the loop was last handed events

    def on_event(self, ev: Event) -> None:  # the worker's thread
        with self.lock:
            wake = not self.held  # a hand-over is already due otherwise
            self.held.append(ev)
        now = time.monotonic()
        try:
            if not isinstance(ev, Piece) or (wake and now - self.last >= RELAY_TICK_S):
                self.loop.call_soon_threadsafe(self._hand)
            elif wake:
                self.loop.call_soon_threadsafe(self.loop.call_later, RELAY_TICK_S - (now - self.last),
                                               self._hand)
        except RuntimeError:  # the server stopped (its loop is closed): nobody to tell
            self.cancel.set()

    def _hand(self) -> None:  # the loop's thread
        with self.lock:
            held, self.held = self.held, []
            self.last = time.monotonic()
        for ev in held:
            self.events.put_nowait(ev)


async def _whole(request: Request, st: ServerState, job: Job, events: asyncio.Queue[Event],
                 reply: Callable[[Answer], Any]) -> Response:
    """A reply not streamed: waits for the job's end, seeing a client that leaves, and gives
    up with a 503 if it waited in line longer than `max_wait_s` without starting."""
    queued = time.monotonic()
    while True:
        try:
            ev = await asyncio.wait_for(events.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel.set()  # nobody to answer: stop between tokens
                return Response(status_code=499)
            waited = time.monotonic() - queued
            if st.max_wait_s and waited > st.max_wait_s:
                ahead = st.worker.ahead_of(job)
                if ahead is not None and st.worker.withdraw(job):  # not begun: a clear 503
                    return error(ApiError(
                        503, f"the model is busy (the window's reply or other requests): "
                             f"waited {waited:.0f} s with {ahead} ahead; try again shortly, "
                             "or stream the request to see its place in line",
                        code="busy"))
            continue
        if isinstance(ev, Done):
            got = reply(ev.answer)
            return got if isinstance(got, Response) else JSONResponse(got)
        if isinstance(ev, Failed):
            return error(ev.error)


# ---------------------------------------------------------------- the routes


async def models(request: Request) -> Response:
    try:
        state_of(request).check_key(request)
    except ApiError as exc:
        return error(exc)
    return JSONResponse({"object": "list", "data": [state_of(request).model_card()]})


async def one_model(request: Request) -> Response:
    st = state_of(request)
    try:
        st.check_key(request)
    except ApiError as exc:
        return error(exc)
    name, served = request.path_params["name"], st.worker.model_id
    if name != served:
        return error(ApiError(404, f"no model {name!r} here: this server serves {served!r}",
                              "model", code="model_not_found"))
    return JSONResponse(st.model_card())


def _chat_reply(a: Answer, cid: str, model: str) -> Any:
    return completion(cid, model, a.text, a.finish_reason, a.usage, a.logprobs, a.tool_calls,
                      [choice(c.index, c.text, c.finish_reason, c.logprobs, c.tool_calls)
                       for c in a.choices[1:]])


def _text_reply(a: Answer, cid: str, model: str) -> Any:
    return text_completion(cid.replace("chatcmpl-", "cmpl-"), model, a.text, a.finish_reason,
                           a.usage, legacy_logprobs(a.logprobs, a.text_offset),
                           more=[text_choice(c.index, c.text, c.finish_reason,
                                             legacy_logprobs(c.logprobs, c.text_offset))
                                 for c in a.choices[1:]])


async def chat(request: Request) -> Response:
    return await answer(request, parse_chat_request, _chat_reply, chat_stream)


async def completions(request: Request) -> Response:
    return await answer(request, parse_completion_request, _text_reply, text_stream)


async def embeddings(request: Request) -> Response:
    return await answer(request, parse_embedding_request, lambda a, cid, model: embedding_list(
        model, a.vectors or [], a.prompt_tokens, a.base64), None)


async def transcriptions(request: Request) -> Response:
    """OpenAI's (and llama-server's) speech to text, for a model that hears: the clip and
    an instruction to write it down, as a chat turn."""
    wanted = {"format": "json"}

    def parse(form: dict[str, Any]) -> Any:
        wanted["format"] = str(form.get("response_format") or "json")
        return parse_transcription_request(form)

    def text_or_json(a: Answer, cid: str, model: str) -> Any:
        return PlainTextResponse(a.text) if wanted["format"] == "text" else {"text": a.text}

    return await answer(request, parse, text_or_json, None, read_form)


async def health(request: Request) -> Response:
    """Whether the server is up, for anyone; what it serves and how busy it is, for a
    caller with the key when one is set (a web page or another user learns nothing)."""
    st = state_of(request)
    w = st.worker
    status = "ok" if w.ready.is_set() and not w.load_error else ("error" if w.load_error else "loading")
    try:
        st.check_key(request)
    except ApiError:
        return JSONResponse({"status": status})
    return JSONResponse({"status": status, "model": w.model_id, "waiting": w.waiting(),
                         "served": w.served, "time": time.time()})


ROUTES: tuple[tuple[str, Callable[[Request], Awaitable[Response]], str], ...] = (
    ("/v1/models", models, "GET"),
    ("/v1/models/{name:path}", one_model, "GET"),
    ("/v1/chat/completions", chat, "POST"),
    ("/v1/completions", completions, "POST"),
    ("/v1/embeddings", embeddings, "POST"),
    ("/v1/audio/transcriptions", transcriptions, "POST"),
    ("/health", health, "GET"),
)


async def not_found(request: Request, exc: Exception) -> Response:
    served = ", ".join(f"{method} {path.replace('{name:path}', 'NAME')}"
                       for path, _, method in ROUTES if path.startswith("/v1"))
    return error(ApiError(404, f"no route {request.method} {request.url.path}: Ebb serves {served}"))


async def not_allowed(request: Request, exc: Exception) -> Response:
    return error(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))


def build_app(worker: Backend, api_key: str | None = None,
              max_body: int = DEFAULT_MAX_BODY, cors: tuple[str, ...] = (),
              listen_host: str = "127.0.0.1", allow_hosts: tuple[str, ...] = (),
              image_folder: Path | None = None, max_wait_s: float = DEFAULT_MAX_WAIT_S) -> Any:
    """The routes behind the request guard (guard.py): `cors`, origins whose browser pages may
    call the API (none by default); `listen_host` and `allow_hosts`, the names a request may be
    addressed to; `image_folder`, the one folder whose pictures file:// URLs may name (None:
    file:// images are refused)."""
    middleware = []
    if cors:
        from starlette.middleware import Middleware
        from starlette.middleware.cors import CORSMiddleware

        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors),
                                     allow_methods=["GET", "POST", "OPTIONS"],
                                     allow_headers=["Authorization", "Content-Type"]))
    app = Starlette(routes=[Route(path, handler, methods=[method]) for path, handler, method in ROUTES],
                    middleware=middleware, exception_handlers={404: not_found, 405: not_allowed})
    app.state.ebb = ServerState(worker, api_key, max_body, image_folder, max_wait_s)
    return RequestGuard(app, Policy(listen_host, allow_hosts, cors))
def serve(worker: Backend, host: str, port: int, api_key: str | None = None,
          max_body: int = DEFAULT_MAX_BODY, ready: Callable[[uvicorn.Server], None] | None = None,
          cors: tuple[str, ...] = (),
          allow_hosts: tuple[str, ...] = (), image_folder: Path | None = None,
          max_wait_s: float = DEFAULT_MAX_WAIT_S) -> None:
    """Run until interrupted (uvicorn handles Ctrl-C and SIGTERM)."""
    import uvicorn

    app = build_app(worker, api_key, max_body, cors, host, allow_hosts, image_folder, max_wait_s)
    config = uvicorn.Config(app, host=host, port=port,
                            log_level="warning", timeout_graceful_shutdown=5, access_log=False)
    server = uvicorn.Server(config)
    if ready is not None:
        ready(server)
    server.run()


class ServerThread:
    """The HTTP server on a background thread (the window's Local server). The socket is bound
    here, so a port in use is a clear EbbError at once rather than a log line later."""

    def __init__(self, worker: Backend, host: str, port: int, api_key: str | None = None,
                 max_body: int = DEFAULT_MAX_BODY) -> None:
        import socket
        import threading

        import uvicorn

        from engine.errors import EbbError

        self.host, self.port = host, port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise EbbError(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                           "pick another port in Settings → Local server") from None
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(build_app(worker, api_key, max_body, listen_host=host),
                                log_level="warning",
                                timeout_graceful_shutdown=2, access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="ebb-http", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except SystemExit:  # uvicorn exits on a fatal start-up error; the window stays
            pass

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()
