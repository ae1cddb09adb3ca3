"""The HTTP side of `ebb-engine serve`: OpenAI's /v1 routes on Starlette, served by uvicorn.

Starlette and uvicorn (both from the encode project, widely used, ASGI) rather than a server
written here: HTTP/1.1 parsing, keep-alive, streaming with back-pressure and the client's
disconnect are theirs. FastAPI was not needed: the request checks live in `api.py`, where they
are tested without HTTP. Requests are answered by `ServeWorker` (one model, one worker);
replies stream back from its thread through an asyncio queue.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from engine.llama.rpc_server import is_loopback as is_loopback  # rpc-serve's rule, re-exported
from engine.server.guard import Policy, RequestGuard
from engine.server.api.chat import (choice, chunk, completion, parse_chat_request,
                                    parse_transcription_request)
from engine.server.api.common import ApiError, new_id
from engine.server.api.completions import parse_completion_request, text_choice, text_completion
from engine.server.api.embeddings import embedding_list, parse_embedding_request
from engine.server.worker import Answer, Backend, Done, Event, Failed, Job, Piece

DEFAULT_MAX_BODY = 32 << 20  # a request's body (a picture as base64 counts 4/3 of its bytes)
KEEPALIVE_S = 1.0  # a waiting stream sends an SSE comment this often (and so sees a client leave)
# a request that is not streamed waits in line at most this long, then gets a 503 with
# Retry-After (it saw nothing meanwhile; a stream sees its place in line every second instead)
DEFAULT_MAX_WAIT_S = 60.0


def build_app(worker: Backend, api_key: str | None = None,
              max_body: int = DEFAULT_MAX_BODY, cors: tuple[str, ...] = (),
              listen_host: str = "127.0.0.1", allow_hosts: tuple[str, ...] = (),
              image_folder: Path | None = None, max_wait_s: float = DEFAULT_MAX_WAIT_S) -> Any:
    """The routes behind the request guard (guard.py): `cors`, origins whose browser pages may
    call the API (none by default); `listen_host` and `allow_hosts`, the names a request may be
    addressed to; `image_folder`, the one folder whose pictures file:// URLs may name (None:
    file:// images are refused)."""
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    def error(exc: ApiError) -> Response:
        headers = {"Retry-After": "2"} if exc.status == 503 else None
        if exc.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    def check_key(request: Request) -> None:
        if not api_key:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), api_key.encode()):
            raise ApiError(401, "a valid API key is needed: Authorization: Bearer KEY",
                           code="invalid_api_key")

    async def read_json(request: Request) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body:
            raise ApiError(413, f"the request body is {int(length)} bytes; the most is {max_body}")
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

    async def models(request: Request) -> Response:
        try:
            check_key(request)
        except ApiError as exc:
            return error(exc)
        return JSONResponse({"object": "list", "data": [model_card()]})

    def model_card() -> dict[str, Any]:
        created = int(worker.model_path.stat().st_mtime) if worker.model_path.exists() else 0
        # what the model answers here (not OpenAI's: a client that does not know it ignores it)
        can = ["chat.completions", "completions", "embeddings", "tools", "response_format",
               "logprobs"] + (["vision"] if worker.vision else []) \
            + (["audio"] if worker.hearing else [])
        return {"id": worker.model_id, "object": "model", "created": created, "owned_by": "ebb",
                "capabilities": can}

    async def one_model(request: Request) -> Response:
        try:
            check_key(request)
        except ApiError as exc:
            return error(exc)
        name = request.path_params["name"]
        if name != worker.model_id:
            return error(ApiError(404, f"no model {name!r} here: this server serves "
                                       f"{worker.model_id!r}", "model", code="model_not_found"))
        return JSONResponse(model_card())

    async def answer(request: Request, parse: Callable[[Any], Any],
                     reply: Callable[[Answer, str, str], Any],
                     stream: Callable[..., AsyncIterator[str]] | None,
                     read: Callable[[Request], Any] | None = None) -> Response:
        """Check the body, queue the job, and answer: whole, or streamed by `stream`. `read`:
        the body another way than JSON (a form), as `parse` takes it."""
        try:
            check_key(request)
            req = parse(await (read or read_json)(request))
        except ApiError as exc:
            return error(exc)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        client = req.user or (f"{request.client.host}:{request.client.port}"
                              if request.client else "client")
        cancel = threading.Event()

        def on_event(ev: Event) -> None:  # the worker's thread: into this loop
            try:
                loop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:  # the server stopped (its loop is closed): nobody to tell
                cancel.set()

        job = Job(req, client, on_event, cancel=cancel, image_folder=image_folder)
        try:
            worker.submit(job)
        except ApiError as exc:
            return error(exc)
        cid, model = new_id(), worker.model_id
        if stream is not None and getattr(req, "stream", False):
            return StreamingResponse(_sse(stream(job, events, cid, model), job),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        queued = time.monotonic()
        while True:
            try:
                ev = await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel.set()  # nobody to answer: stop between tokens
                    return Response(status_code=499)
                waited = time.monotonic() - queued
                if max_wait_s and waited > max_wait_s:
                    ahead = worker.ahead_of(job)
                    if ahead is not None and worker.withdraw(job):  # not begun: a clear 503
                        return error(ApiError(
                            503, f"the model is busy (the window's reply or other requests): "
                                 f"waited {waited:.0f} s with {ahead} ahead; try again shortly, "
                                 "or stream the request to see its place in line",
                            code="busy"))
                continue
            if isinstance(ev, Done):
                got = reply(ev.answer, cid, model)
                return got if isinstance(got, Response) else JSONResponse(got)
            if isinstance(ev, Failed):
                return error(ev.error)

    async def _events(events: asyncio.Queue[Event]) -> AsyncIterator[Event | None]:
        """The job's events; None now and then while it waits (the stream then writes a
        keep-alive comment: a client that left is noticed there)."""
        while True:
            try:
                ev = await asyncio.wait_for(events.get(), timeout=KEEPALIVE_S)
            except asyncio.TimeoutError:
                yield None
                continue
            yield ev
            if not isinstance(ev, Piece):
                return

    async def _sse(parts: AsyncIterator[str], job: Job) -> AsyncIterator[str]:
        finished = False
        try:
            async for part in parts:
                yield part
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:  # the client left mid-stream: the worker stops between tokens
                job.cancel.set()

    def sse(obj: dict[str, Any]) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def waiting_comment(job: Job) -> str:
        """A stream's keep-alive: its place in line while it waits (an SSE comment: clients
        skip it, a person watching the stream sees it)."""
        ahead = worker.ahead_of(job)
        return ": waiting\n\n" if ahead is None else f": waiting in line, {ahead} ahead\n\n"

    async def chat_stream(job: Job, events: asyncio.Queue[Event], cid: str,
                          model: str) -> AsyncIterator[str]:
        yield sse(chunk(cid, model, {"role": "assistant", "content": ""}))
        started = {0}  # the choices whose role was sent
        streamed_calls: set[int] = set()  # the choices whose calls went out as deltas
        async for ev in _events(events):
            if ev is None:
                yield waiting_comment(job)
            elif isinstance(ev, Piece):
                if ev.index not in started:
                    started.add(ev.index)
                    yield sse(chunk(cid, model, {"role": "assistant", "content": ""}, index=ev.index))
                if ev.tool_calls:  # a call's arguments as the model writes them
                    streamed_calls.add(ev.index)
                    yield sse(chunk(cid, model, {"tool_calls": ev.tool_calls}, index=ev.index))
                else:
                    yield sse(chunk(cid, model, {"content": ev.text}, logprobs=ev.logprobs,
                                    index=ev.index))
            elif isinstance(ev, Done):
                a = ev.answer
                for c in a.choices or (a,):
                    if c.tool_calls and c.index not in streamed_calls:  # whole, at the end
                        yield sse(chunk(cid, model, {"tool_calls": [
                            {"index": i, **t} for i, t in enumerate(c.tool_calls)]}, index=c.index))
                    # usage: only when asked, once
                    yield sse(chunk(cid, model, {}, c.finish_reason, index=c.index))
                if getattr(job.request, "include_usage", False):
                    yield sse(chunk(cid, model, {}, use=a.usage, choices=False))
            else:
                yield sse(ev.error.body())

    async def text_stream(job: Job, events: asyncio.Queue[Event], cid: str,
                          model: str) -> AsyncIterator[str]:
        async for ev in _events(events):
            if ev is None:
                yield waiting_comment(job)
            elif isinstance(ev, Piece):
                yield sse(text_completion(cid, model, ev.text, None, None, chunk=True,
                                          index=ev.index))
            elif isinstance(ev, Done):
                for c in ev.answer.choices or (ev.answer,):
                    yield sse(text_completion(cid, model, "", c.finish_reason, None, chunk=True,
                                              index=c.index))
                if getattr(job.request, "include_usage", False):
                    yield sse(text_completion(cid, model, "", None, ev.answer.usage, chunk=True,
                                              choices=False))
            else:
                yield sse(ev.error.body())

    async def chat(request: Request) -> Response:
        return await answer(request, parse_chat_request, lambda a, cid, model: completion(
            cid, model, a.text, a.finish_reason, a.usage, a.logprobs, a.tool_calls,
            [choice(c.index, c.text, c.finish_reason, c.logprobs, c.tool_calls)
             for c in a.choices[1:]]), chat_stream)

    async def completions(request: Request) -> Response:
        return await answer(request, parse_completion_request, lambda a, cid, model: text_completion(
            cid.replace("chatcmpl-", "cmpl-"), model, a.text, a.finish_reason, a.usage,
            a.legacy_logprobs, more=[text_choice(c.index, c.text, c.finish_reason,
                                                  c.legacy_logprobs) for c in a.choices[1:]]),
            text_stream)

    async def embeddings(request: Request) -> Response:
        return await answer(request, parse_embedding_request, lambda a, cid, model: embedding_list(
            model, a.vectors or [], a.prompt_tokens, a.base64), None)

    async def read_form(request: Request) -> dict[str, Any]:
        """A multipart form (OpenAI's audio endpoints): its fields, a file's as its name and
        bytes; at most `max_body` bytes."""
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body:
            raise ApiError(413, f"the request body is {int(length)} bytes; the most is {max_body}")
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

    async def not_found(request: Request, exc: Exception) -> Response:
        return error(ApiError(404, f"no route {request.method} {request.url.path}: Ebb serves "
                                   "GET /v1/models, POST /v1/chat/completions, /v1/completions, "
                                   "/v1/embeddings and /v1/audio/transcriptions"))

    async def health(request: Request) -> Response:
        """Whether the server is up, for anyone; what it serves and how busy it is, for a
        caller with the key when one is set (a web page or another user learns nothing)."""
        status = ("ok" if worker.ready.is_set() and not worker.load_error
                  else ("error" if worker.load_error else "loading"))
        try:
            check_key(request)
        except ApiError:
            return JSONResponse({"status": status})
        return JSONResponse({"status": status, "model": worker.model_id,
                             "waiting": worker.waiting(), "served": worker.served,
                             "time": time.time()})

    routes = [Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{name:path}", one_model, methods=["GET"]),
              Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/embeddings", embeddings, methods=["POST"]),
              Route("/v1/audio/transcriptions", transcriptions, methods=["POST"]),
              Route("/health", health, methods=["GET"])]
    middleware = []
    if cors:
        from starlette.middleware import Middleware
        from starlette.middleware.cors import CORSMiddleware

        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors),
                                     allow_methods=["GET", "POST", "OPTIONS"],
                                     allow_headers=["Authorization", "Content-Type"]))
    app = Starlette(routes=routes, middleware=middleware)
    app.add_exception_handler(404, not_found)
    app.add_exception_handler(405, lambda req, exc: error(ApiError(
        405, f"{req.method} is not allowed on {req.url.path}")))
    return RequestGuard(app, Policy(listen_host, allow_hosts, cors))


def serve(worker: Backend, host: str, port: int, api_key: str | None = None,
          max_body: int = DEFAULT_MAX_BODY, ready: Any = None, cors: tuple[str, ...] = (),
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
