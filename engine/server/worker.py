"""One model, one worker: the thread that owns the session answers queued requests in order.

The HTTP side (any thread, or the event loop) `submit`s a `Job` and hears back through the
job's `on_event` callback, called on this worker's thread: ("text", piece) while the reply is
written, then ("done", result) or ("error", ApiError). A job whose `cancel` is set before its
turn is skipped; during its turn the session stops between tokens.
"""
from __future__ import annotations

import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from engine.config import SessionConfig
from engine.errors import EbbError
from engine.server.api import ApiError, ChatRequest, ImageRef, StopWatcher, finish_reason, usage

Event = tuple[Any, ...]


@dataclass
class Job:
    request: ChatRequest
    client: str  # who asked: "127.0.0.1:53422", or the request's `user`
    on_event: Callable[[Event], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.monotonic)


class ServeWorker:
    """Loads the model on its own thread, then answers jobs one at a time, oldest first."""

    def __init__(self, cfg: SessionConfig, image_dir: Path, max_queue: int = 8,
                 on_turn: Callable[[Job, dict[str, Any]], None] | None = None) -> None:
        self.cfg = cfg
        self.image_dir = image_dir
        self.max_queue = max_queue
        self.on_turn = on_turn  # after each answered job (a log line, a panel)
        self._waiting: deque[Job] = deque()  # oldest first; a job whose client left is dropped
        self._cond = threading.Condition()
        self._closing = False
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.session: Any = None
        self.model_id = cfg.model_path.stem
        self.busy_with: Job | None = None
        self.served = 0
        self._thread = threading.Thread(target=self._run, name="ebb-serve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ any thread

    def submit(self, job: Job) -> int:
        """Queue a job; its place in the queue (0: next). ApiError(503) when the queue is full."""
        if self.load_error is not None:
            raise ApiError(503, f"the model did not load: {self.load_error}")
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
        """Under the lock: a waiting job whose client left gives up its place at once."""
        if any(j.cancel.is_set() for j in self._waiting):
            self._waiting = deque(j for j in self._waiting if not j.cancel.is_set())

    def waiting(self) -> int:
        with self._cond:
            self._drop_gone()
            return len(self._waiting)

    def close(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._closing = True
            left, self._waiting = list(self._waiting), deque()
            self._cond.notify()
        for job in left:  # the waiting jobs are told; the thread ends after the current one
            job.on_event(("error", ApiError(503, "the server is shutting down")))
        if self.busy_with is not None:
            self.busy_with.cancel.set()
        self._thread.join(timeout)

    def _next(self) -> Job | None:
        with self._cond:
            while True:
                self._drop_gone()
                if self._waiting:
                    return self._waiting.popleft()
                if self._closing:
                    return None
                self._cond.wait()

    # ------------------------------------------------------------ the worker's thread

    def _run(self) -> None:
        from engine.session import Session

        try:
            self.session = Session(self.cfg)
        except EbbError as exc:
            self.load_error = str(exc)
        except Exception as exc:  # noqa: BLE001 - said to every client, not a crash
            self.load_error = f"{type(exc).__name__}: {exc}"
        finally:
            self.ready.set()
        while True:
            job = self._next()
            if job is None:
                break
            if self.load_error is not None:
                job.on_event(("error", ApiError(503, f"the model did not load: {self.load_error}")))
                continue
            self.busy_with = job
            try:
                self._answer(job)
            except ApiError as exc:
                job.on_event(("error", exc))
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the server
                job.on_event(("error", ApiError(500, f"{type(exc).__name__}: {exc}")))
            finally:
                self.busy_with = None
        if self.session is not None:
            self.session.close()

    def _image_path(self, ref: ImageRef) -> Path:
        if ref.path is not None:
            return ref.path
        assert ref.data is not None
        path = self.image_dir / f"{ref.key()}.img"  # by content: sent again, encoded once
        if not path.exists():
            self.image_dir.mkdir(parents=True, exist_ok=True)
            part = path.with_suffix(f".{threading.get_ident()}.part")
            part.write_bytes(ref.data)
            part.replace(path)
        return path

    def _answer(self, job: Job) -> None:
        from engine.llama.runtime import GenParams
        from engine.session import turn_with_recovery

        req = job.request
        session = self.session
        session.cfg = replace(session.cfg, system=req.system if req.system is not None
                              else self.cfg.system)
        session.set_history([(t.role, t.text, [self._image_path(i) for i in t.images])
                             for t in req.history])
        images = [self._image_path(i) for i in req.last.images]
        defaults = GenParams()
        gp = GenParams(max_tokens=req.max_tokens,
                       temperature=defaults.temperature if req.temperature is None else req.temperature,
                       top_p=defaults.top_p if req.top_p is None else req.top_p,
                       seed=req.seed % 2**32 if req.seed is not None else random.getrandbits(32))
        watcher = StopWatcher(req.stop)
        shown: list[str] = []

        def on_text(piece: str) -> None:
            out = watcher.feed(piece)
            if out:
                shown.append(out)
                job.on_event(("text", out))
            if watcher.hit:
                job.cancel.set()  # the stop sequence ends the reply, between tokens

        self.session, res = turn_with_recovery(session, req.last.text, images, gp,
                                               on_text=on_text, cancel=job.cancel)
        tail = watcher.flush()
        if tail:
            shown.append(tail)
            job.on_event(("text", tail))
        if res.error is not None:
            raise ApiError(400, res.error)
        out = res.to_dict()
        self.served += 1
        result = {"text": "".join(shown),
                  "finish_reason": finish_reason(str(out.get("stop_reason", "")), watcher.hit),
                  "usage": usage(int(out.get("n_prompt_tokens", 0)), int(out.get("n_gen_tokens", 0))),
                  "stats": out, "client_gone": job.cancel.is_set() and not watcher.hit}
        if self.on_turn is not None:
            self.on_turn(job, result)
        job.on_event(("done", result))
