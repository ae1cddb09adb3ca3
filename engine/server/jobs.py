"""What the HTTP side and whoever answers share: a `Job` (the parsed request, who asked, how
to tell them, a cancel), the events it hears back on the answering thread (`Piece`s while the
reply is written, then `Done` with the `Answer`, or `Failed` with an ApiError), the bounded
queue jobs wait in, and the `Backend` protocol http.py talks to (`ServeWorker`, or the window's
engine worker). Dicts are made only at the JSON edge (http.py).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from engine.events import Logprob, TurnResult
from engine.server.api.chat import ChatRequest
from engine.server.api.common import ApiError, usage
from engine.server.api.completions import CompletionRequest
from engine.server.api.embeddings import EmbeddingRequest

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
    logprobs: tuple[Logprob, ...] | None = None  # the reply's tokens', when asked for
    text_offset: int = 0  # a completion's: where the reply starts in its text (after an echo)
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
    logprobs: tuple[Logprob, ...] | None = None  # its tokens', when asked for
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
    session_only: bool = False  # a lane looked and left it to the session (server/parallel.py)


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

    def take_first(self, fits: Callable[[Job], bool]) -> tuple[int, Job] | None:
        """The oldest live job that `fits`, out of the line, with its place; None when none does."""
        with self._cond:
            self._drop_gone()
            for i, j in enumerate(self._waiting):
                if fits(j):
                    del self._waiting[i]
                    return i, j
            return None

    def put_back(self, place: int, job: Job) -> None:
        """A job taken that could not begin after all goes back to its place in the line."""
        with self._cond:
            self._waiting.insert(min(place, len(self._waiting)), job)
            self._cond.notify()

    @property
    def closing(self) -> bool:
        return self._closing

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
        # jobs answered on lanes beside the session (engine/server/parallel.py), by id
        self.on_lanes: dict[int, Job] = {}
        self.lanes_full = False  # a job waits for the lanes' room: no new try until one ends

    def waiting(self) -> int:
        return len(self.jobs)

    def answering(self) -> bool:
        """Whether something is being answered now (ahead of every job that waits)."""
        return self.busy_with is not None or bool(self.on_lanes)

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
        for left in self.jobs.close():
            left.on_event(Failed(ApiError(503, why)))
        running = [j for j in (self.busy_with, *self.on_lanes.values()) if j is not None]
        for job in running:
            job.cancel.set()


def read_ahead(session: Session | None, job: Job) -> None:
    """Any thread: `job` was queued. A chat's conversation may have a state kept on disk (its
    client came back after a restart, or after others): its read starts now, while the job
    waits and while its prompt is rendered (Session.read_ahead)."""
    if session is not None and isinstance(job.request, ChatRequest):
        session.read_ahead(job.request.conversation_tag)


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
