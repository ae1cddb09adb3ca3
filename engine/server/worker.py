"""One model, one worker: the thread that owns the session answers queued requests in order.

The HTTP side (any thread, or the event loop) `submit`s a `Job` and hears back through the
job's `on_event` callback, called on this worker's thread: `Piece`s while the reply is written
(with their tokens' logprobs when they were asked for), then `Done` (the `Answer`) or `Failed`
(an ApiError). A job whose `cancel` is set before its turn is skipped; during its turn the
session stops between tokens. Dicts are made only at the JSON edge (http.py).
"""
from __future__ import annotations

import random
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from engine.config import SessionConfig
from engine.errors import EbbError
from engine.events import TurnResult
from engine.media.audio import AUDIO_SUFFIXES, OTHER_SOUND_SUFFIXES
from engine.server.api.chat import ChatRequest, ImageRef
from engine.server.api.common import ApiError, StopWatcher, finish_reason, logprobs_within, usage
from engine.server.api.completions import CompletionRequest, legacy_logprobs
from engine.server.api.embeddings import EmbeddingRequest
from engine.server.tools import (
    OPENERS,
    ArgumentStream,
    CallGate,
    read_calls,
    spec,
    template_extra,
    template_format,
    text_grammar,
)
from engine.server.tools import grammar as tool_grammar

if TYPE_CHECKING:
    from engine.session import Session

@dataclass(frozen=True)
class Answer:
    """What a job's request got: a chat reply, a completion, or embeddings."""
    request_id: int
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int = 0
    text: str = ""
    turn: TurnResult | None = None  # what the engine's turn did (none for embeddings)
    client_gone: bool = False  # the client left before the reply ended
    logprobs: list[dict[str, Any]] | None = None  # chat's shape; a completion's: legacy_logprobs
    legacy_logprobs: dict[str, Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    vectors: list[list[float]] | None = None  # embeddings
    base64: bool = False
    index: int = 0  # which choice (n > 1, or one of several prompts)
    choices: tuple["Answer", ...] = ()  # with several: every choice; the fields above are totals

    @property
    def usage(self) -> dict[str, Any]:
        cached = (self.prompt_tokens - self.turn.gen.n_prompt_tokens_evaluated
                  if self.turn is not None and self.turn.gen.stop_reason is not None and not self.choices
                  else None)
        return usage(self.prompt_tokens, self.completion_tokens, cached)


@dataclass(frozen=True)
class Piece:
    text: str
    logprobs: list[dict[str, Any]] | None = None  # its tokens', when asked for
    index: int = 0  # the choice it belongs to
    tool_calls: list[dict[str, Any]] | None = None  # a call's start or more of its arguments


@dataclass(frozen=True)
class Done:
    answer: Answer


@dataclass(frozen=True)
class Failed:
    error: ApiError


Event = Piece | Done | Failed


@dataclass
class Job:
    request: ChatRequest | CompletionRequest | EmbeddingRequest
    client: str  # who asked: "127.0.0.1:53422", or the request's `user`
    on_event: Callable[[Event], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.monotonic)
    image_dir: Path = field(default_factory=lambda: Path("."))  # where its data URLs are written
    image_folder: Path | None = None  # the one folder file:// images may come from (None: none)


class Backend(Protocol):
    """What the HTTP side needs of whoever answers: `ServeWorker` (ebb-engine serve) or the
    window's engine worker (app/mainwindow/serving.py)."""
    model_id: str
    model_path: Path
    ready: threading.Event
    load_error: str | None
    served: int
    vision: bool  # the model's projector takes pictures: messages may carry images
    hearing: bool  # ... sound: messages may carry input_audio

    def submit(self, job: Job) -> int: ...

    def waiting(self) -> int: ...

    def ahead_of(self, job: Job) -> int | None: ...

    def withdraw(self, job: Job) -> bool: ...


class JobQueue:
    """Jobs waiting in arrival order, at most `max_queue`; a job whose client left gives up
    its place at once. Any thread."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closing = False

    def submit(self, job: Job) -> int:
        """Its place (0: next). ApiError(503) when full or closing."""
        with self._cond:
            if self._closing:
                raise ApiError(503, "the server is shutting down")
            self._drop_gone()
            if len(self._waiting) >= self.max_queue:
                raise ApiError(503, f"the server is busy ({self.max_queue} requests waiting): "
                                    "try again shortly", code="queue_full")
            self._waiting.append(job)
            self._cond.notify()
            return len(self._waiting) - 1

    def _drop_gone(self) -> None:
        if any(j.cancel.is_set() for j in self._waiting):
            self._waiting = deque(j for j in self._waiting if not j.cancel.is_set())

    def __len__(self) -> int:
        with self._cond:
            self._drop_gone()
            return len(self._waiting)

    def position(self, job: Job) -> int | None:
        """How many wait ahead of `job` (0: next); None once it has begun (or left)."""
        with self._cond:
            for i, j in enumerate(self._waiting):
                if j is job:
                    return i
            return None

    def withdraw(self, job: Job) -> bool:
        """Take `job` out of the line if it has not begun: True when it was still waiting."""
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                return True
            return False

    def take(self, block: bool = True) -> Job | None:
        """The oldest live job; None when closed (or, not blocking, when none waits)."""
        with self._cond:
            while True:
                self._drop_gone()
                if self._waiting:
                    return self._waiting.popleft()
                if self._closing or not block:
                    return None
                self._cond.wait()

    def close(self) -> list[Job]:
        """No more jobs; returns those that were waiting (to be told)."""
        with self._cond:
            self._closing = True
            left, self._waiting = list(self._waiting), deque()
            self._cond.notify_all()
        return left


class QueuedBackend:
    """What both backends share: their jobs wait in one `JobQueue`, and the job being answered
    (`busy_with`, set by the answering thread) stops between tokens when told to."""

    def __init__(self, max_queue: int) -> None:
        self.jobs = JobQueue(max_queue)
        self.busy_with: Job | None = None

    def waiting(self) -> int:
        return len(self.jobs)

    def answering(self) -> bool:
        """Whether something is being answered now (ahead of every job that waits)."""
        return self.busy_with is not None

    def ahead_of(self, job: Job) -> int | None:
        """How many go before `job`: those that wait before it and what is being answered now
        (None once it has begun, or left)."""
        place = self.jobs.position(job)
        return None if place is None else place + int(self.answering())

    def withdraw(self, job: Job) -> bool:
        return self.jobs.withdraw(job)

    def stop_all(self, why: str) -> None:
        """No more jobs: those waiting are told `why` (a 503); the one running stops between
        tokens."""
        for job in self.jobs.close():
            job.on_event(Failed(ApiError(503, why)))
        running = self.busy_with
        if running is not None:
            running.cancel.set()


def answer_job(session: Session, job: Job, default_system: str | None) -> tuple[Session, Answer]:
    """Answer one request on `session` (on the thread that owns it). Returns the session to
    use from now on (another when a remote device went away) and the result. The session's
    conversation becomes the request's. Several choices (n, or several prompts) are answered
    one after another, each with its own stop: a stop sequence ends that choice alone."""
    req = job.request
    if isinstance(req, EmbeddingRequest):
        return session, _embeddings(session, job, req)
    if isinstance(req, CompletionRequest):
        prompts = req.all_prompts
        if len(prompts) == 1:
            return _completion(session, job, req)
        return _choices(session, job, [replace(req, prompt=p, prompts=()) for p in prompts],
                        lambda s, j, r: _completion(s, j, r), shared_prompt=False)
    if req.n == 1:
        return _chat(session, job, req, default_system)
    seeded = [replace(req, n=1, seed=None if req.seed is None else req.seed + i) for i in range(req.n)]
    return _choices(session, job, seeded, lambda s, j, r: _chat(s, j, r, default_system),
                    shared_prompt=True)


def _choices(session: Session, job: Job, requests: list[Any],
             answer: Callable[[Session, Job, Any], tuple[Session, Answer]],
             shared_prompt: bool) -> tuple[Session, Answer]:
    """One answer per request, in turn, as the choices of one reply."""
    answers: list[Answer] = []
    for i, sub in enumerate(requests):
        own = threading.Event()

        def on_event(ev: Event, i: int = i, own: threading.Event = own) -> None:
            if job.cancel.is_set():  # the client left: this choice stops between tokens too
                own.set()
            job.on_event(replace(ev, index=i) if isinstance(ev, Piece) else ev)

        session, a = answer(session, replace(job, request=sub, on_event=on_event, cancel=own), sub)
        answers.append(replace(a, index=i))
        if job.cancel.is_set():
            break
    first = answers[0]
    prompt = first.prompt_tokens if shared_prompt else sum(a.prompt_tokens for a in answers)
    return session, replace(first, prompt_tokens=prompt,
                            completion_tokens=sum(a.completion_tokens for a in answers),
                            client_gone=any(a.client_gone for a in answers),
                            choices=tuple(answers))


def _chat(session: Session, job: Job, req: ChatRequest, default_system: str | None,
          calls_allowed: bool = True) -> tuple[Session, Answer]:
    """One reply. With tools, a reply that only makes again calls whose results the model has
    just been given (req.answered) is a loop that would not end with a small model: it is taken
    again as text (`calls_allowed` False: the same prompt, a grammar that admits no call)."""
    from engine.session import turn_with_recovery

    usable = req.callable_tools()
    runtime = session.model.runtime
    session.set_template_kwargs(req.thinking_kwargs(runtime.template_source if runtime else ""))
    # the model's own tool format where its template has one (tools.py), else the universal one
    fmt = template_format(session.model.runtime.template_source) if usable and session.model.runtime else None
    if fmt is not None:
        session.set_system(req.own_system if req.own_system is not None else default_system)
        session.set_tools([spec(t) for t in usable])
        # call ids as the template takes them (Mistral's: 9 letters and digits)
        *before, last = [replace(t, extra=template_extra(fmt, t.extra)) for t in req.messages]
        grammar = tool_grammar(req.tools, req.tool_choice, fmt) if calls_allowed else text_grammar(fmt)
    else:
        session.set_system(req.system if req.system is not None else default_system)
        session.set_tools(None)
        before, last, grammar = list(req.history), req.last, req.grammar
        if usable and not calls_allowed:
            grammar = text_grammar(None)
    session.set_history([(t.role, t.text, [image_path(job, i) for i in t.images], t.extra)
                         for t in before])
    images = [image_path(job, i) for i in last.images]
    said = _names_said([*before, last], job)
    pending: list[dict[str, Any]] = []  # sampled tokens' logprobs not yet sent with text
    gp = _gen_params(req, grammar, pending.append if req.top_logprobs >= 0 else None)
    if req.json_reply and grammar == req.grammar:  # response_format's JSON, not a tool grammar
        gp = replace(gp, json_reply=True)
    watcher = StopWatcher(req.stop)
    gate = CallGate(bool(usable) and calls_allowed, OPENERS.get(fmt or "", "{"))  # a call is held
    streamer = ArgumentStream(fmt)  # ... and streamed as tool_calls deltas instead
    # with results just given, a call may be a repeat: it is streamed whole once it is known new
    may_repeat = bool(req.answered) and req.tool_choice is not None and req.tool_choice.mode == "auto"
    shown: list[str] = []

    def show(text: str) -> None:
        if text:
            shown.append(text)
            if req.top_logprobs >= 0:  # a stream sends them with the text they make
                job.on_event(Piece(text, list(pending)))
                pending.clear()
            else:
                job.on_event(Piece(text))

    def on_text(piece: str) -> None:
        show(gate.feed(watcher.feed(piece)))
        if gate.holding and gate.held and not may_repeat:
            deltas = streamer.deltas(gate.held)
            if deltas:
                job.on_event(Piece("", tool_calls=deltas))
        if watcher.hit:
            job.cancel.set()  # the stop sequence ends the reply, between tokens

    session, res = turn_with_recovery(session, last.text, images, gp, on_text=on_text,
                                      cancel=job.cancel, role=last.role, extra=last.extra)
    held = gate.flush() + watcher.flush()
    calls = read_calls(held, req.tools, req.tool_choice, fmt) if gate.active else []
    if calls and may_repeat and all(c.key() in req.answered for c in calls) and res.error is None:
        return _chat(session, job, req, default_system, calls_allowed=False)
    if len(calls) == len(streamer.ids):  # the ids the stream gave them
        calls = [replace(c, id=i) for c, i in zip(calls, streamer.ids)]
    if not calls and streamer.ids:  # a call cut short: streamed as one already, kept as text
        shown.append(held)
    elif not calls:
        show(held)
    if res.error is not None:
        raise ApiError(400, said(res.error))
    g = res.gen
    result = Answer(
        res.request_id, "tool_calls" if calls else finish_reason(str(g.stop_reason or ""), watcher.hit),
        g.n_prompt_tokens, g.n_gen_tokens, "".join(shown), res, job.cancel.is_set() and not watcher.hit,
        logprobs=logprobs_within(g.logprobs, "".join(shown) or held),
        tool_calls=[c.to_openai() for c in calls] or None)
    return session, result


def _gen_params(req: ChatRequest | CompletionRequest, grammar: str = "",
                on_logprob: Callable[[dict[str, Any]], None] | None = None) -> Any:
    from engine.llama.sampling import GenParams

    defaults = GenParams()
    return GenParams(max_tokens=req.max_tokens,
                     temperature=defaults.temperature if req.temperature is None else req.temperature,
                     top_p=defaults.top_p if req.top_p is None else req.top_p,
                     seed=req.seed % 2**32 if req.seed is not None else random.getrandbits(32),
                     grammar=grammar, top_logprobs=req.top_logprobs, on_logprob=on_logprob,
                     **req.sampling.gen_overrides())


def _completion(session: Session, job: Job, req: CompletionRequest) -> tuple[Session, Answer]:
    """/v1/completions: the prompt as it is, on the session's model (its conversation stays)."""
    from engine.session import turn_with_recovery

    watcher = StopWatcher(req.stop)
    shown: list[str] = []

    def show(text: str) -> None:
        if text:
            shown.append(text)
            job.on_event(Piece(text))

    def on_text(piece: str) -> None:
        show(watcher.feed(piece))
        if watcher.hit:
            job.cancel.set()

    if req.echo:
        runtime = session.model.runtime
        assert runtime is not None
        show(req.prompt if isinstance(req.prompt, str) else runtime.detokenize(req.prompt))
    echoed = "".join(shown)
    session, res = turn_with_recovery(session, req.prompt, (), _gen_params(req, req.sampling.grammar),
                                      on_text=on_text,
                                      cancel=job.cancel, raw=True)
    show(watcher.flush())
    if res.error is not None:
        raise ApiError(400, res.error)
    g, text = res.gen, "".join(shown)
    return session, Answer(
        res.request_id, finish_reason(str(g.stop_reason or ""), watcher.hit),
        g.n_prompt_tokens, g.n_gen_tokens, text, res, job.cancel.is_set() and not watcher.hit,
        legacy_logprobs=legacy_logprobs(logprobs_within(g.logprobs, text[len(echoed):]), len(echoed)))


def _embeddings(session: Session, job: Job, req: EmbeddingRequest) -> Answer:
    try:
        vectors, n_tokens = session.embed(req.inputs)
    except EbbError as exc:
        raise ApiError(400, str(exc), "input") from None
    if req.dimensions is not None and vectors and req.dimensions != len(vectors[0]):
        raise ApiError(400, f"this model's embeddings have {len(vectors[0])} dimensions; Ebb "
                            "does not shorten them", "dimensions")
    return Answer(session.request_id, "stop", n_tokens, vectors=vectors, base64=req.base64)


def _names_said(turns: list[Any], job: Job) -> Callable[[str], str]:
    """An error about a picture or clip a request sent inline names the file written of it
    (its sha256): said to the client, it names the client's file, or its place in the request."""
    names: dict[str, str] = {}
    for k, t in enumerate(turns, 1):
        for j, ref in enumerate(t.images, 1):
            if ref.data is None:
                continue
            written = f"{ref.key()}{ref.suffix}"
            what = "clip" if ref.suffix.lower() in AUDIO_SUFFIXES + OTHER_SOUND_SUFFIXES else "attachment"
            said = ref.name or (f"the {what} in message {k}" if len(t.images) == 1
                                else f"{what} {j} of message {k}")
            names[str(job.image_dir / written)] = names[written] = said

    def say(text: str) -> str:
        for written in sorted(names, key=len, reverse=True):  # whole paths before bare names
            text = text.replace(written, names[written])
        return text
    return say


def image_path(job: Job, ref: ImageRef) -> Path:
    """A request's picture as a file the session can read: data URLs are written once, named
    by their content (sent again, the encoder's cache knows them); a file:// picture only from
    inside the server's image folder. A refused path gets one message whatever the reason, so
    a client learns nothing of what exists on this machine."""
    if ref.path is not None:
        return _allowed_file(ref.path, job.image_folder)
    assert ref.data is not None
    path = job.image_dir / f"{ref.key()}{ref.suffix}"
    if not path.exists():
        job.image_dir.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(f".{threading.get_ident()}.part")
        part.write_bytes(ref.data)
        part.replace(path)
    return path


def _allowed_file(path: Path, folder: Path | None) -> Path:
    if folder is None:
        raise ApiError(400, "this server takes no file:// images: send the picture as a data URL "
                            "(data:image/png;base64,...), or start it with --allow-files FOLDER",
                       "messages", code="file_images_off")
    from engine.media import kinds, video
    from engine.media.images import load_image

    try:
        real, root = path.resolve(), folder.resolve()
        usable = real.is_relative_to(root) and real.is_file()
        if usable:  # inside the folder too, what is wrong with it stays unsaid (#52): a
            if kinds.kind_of(real) == kinds.VIDEO:  # message naming its size or the decoder's
                video.probe(real)                   # words told too much
            else:
                load_image(real)
    except (OSError, RuntimeError, ValueError, EbbError):
        usable = False
    if not usable:
        raise ApiError(400, "a file:// image or video must be one inside the folder this server "
                            "allows (--allow-files)", "messages", code="file_image_refused")
    return real


def run_job(job: Job, answer: Callable[[Job], Answer],
            answered: Callable[[Job, Answer], None] | None = None) -> Answer | None:
    """Answer a job, telling its client the result or what went wrong. `answered` runs
    before the client hears (its log line is written by the time the reply arrives)."""
    try:
        result = answer(job)
    except ApiError as exc:
        job.on_event(Failed(exc))
        return None
    except Exception as exc:  # noqa: BLE001 - one bad request must not stop the server
        job.on_event(Failed(ApiError(500, f"{type(exc).__name__}: {exc}")))
        return None
    if answered is not None:
        answered(job, result)
    job.on_event(Done(result))
    return result


class ServeWorker(QueuedBackend):
    """`ebb-engine serve`'s engine: loads the model on its own thread, then answers jobs one
    at a time, oldest first."""

    def __init__(self, cfg: SessionConfig, image_dir: Path, max_queue: int = 8,
                 on_turn: Callable[[Job, Answer], None] | None = None) -> None:
        super().__init__(max_queue)
        self.cfg = cfg
        self.image_dir = image_dir
        self.on_turn = on_turn  # after each answered job (a log line)
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.session: Session | None = None
        self.model_id = cfg.model_path.stem
        self.model_path = cfg.model_path
        self.vision = self.hearing = False  # messages may carry pictures / clips
        if cfg.mmproj_path is not None:
            from engine.gguf.info import projector_info, read_gguf

            try:  # the header says which: a damaged one says so when the model loads, and a
                # projector refused for sound leaves a model that answers text (said at start)
                proj = projector_info(read_gguf(cfg.mmproj_path))
                self.vision, self.hearing = proj.sees, proj.hears
            except EbbError:
                pass
        self.served = 0
        self._thread = threading.Thread(target=self._run, name="ebb-serve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ any thread

    def submit(self, job: Job) -> int:
        if self.load_error is not None:
            raise ApiError(503, f"the model did not load: {self.load_error}")
        job.image_dir = self.image_dir
        return self.jobs.submit(job)

    def close(self, timeout: float = 30.0) -> None:
        self.stop_all("the server is shutting down")  # the thread ends after the current job
        self._thread.join(timeout)

    # ------------------------------------------------------------ the worker's thread

    def _run(self) -> None:
        from engine.session import Session

        try:
            self.session = Session(self.cfg)
            if self.session.projector_refused:  # text only: said where the server is watched
                print(f"ebb-engine: note: {self.session.projector_refused}", file=sys.stderr,
                      flush=True)
        except EbbError as exc:
            self.load_error = str(exc)
        except Exception as exc:  # noqa: BLE001 - said to every client, not a crash
            self.load_error = f"{type(exc).__name__}: {exc}"
        finally:
            self.ready.set()
        while True:
            job = self.jobs.take()
            if job is None:
                break
            if self.load_error is not None:
                job.on_event(Failed(ApiError(503, f"the model did not load: {self.load_error}")))
                continue
            self.busy_with = job
            try:
                run_job(job, self._answer, self._answered)
            finally:
                self.busy_with = None
        if self.session is not None:
            try:  # the last client's conversation, for when it comes back after a restart
                self.session.persist()
            except EbbError:
                pass
            self.session.close()

    def _answered(self, job: Job, result: Answer) -> None:
        self.served += 1
        if self.on_turn is not None:
            self.on_turn(job, result)

    def _answer(self, job: Job) -> Answer:
        assert self.session is not None  # loaded before the first job is taken
        self.session, result = answer_job(self.session, job, self.cfg.system)
        return result
