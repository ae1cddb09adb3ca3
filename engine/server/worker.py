"""One model, one worker (`ServeWorker`, `ebb-engine serve`'s engine): the thread that owns the
session answers queued requests in order (answering.py), as jobs (jobs.py).

The HTTP side (any thread, or the event loop) `submit`s a `Job` and hears back through the
job's `on_event` callback, called on this worker's thread: `Piece`s while the reply is written
(with their tokens' logprobs when they were asked for), then `Done` (the `Answer`) or `Failed`
(an ApiError). A job whose `cancel` is set before its turn is skipped; during its turn the
session stops between tokens. Dicts are made only at the JSON edge (http.py).
"""
from __future__ import annotations

import itertools
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from engine.config import SessionConfig
from engine.errors import EbbError
from engine.server.answering import answer_job
from engine.server.api.common import ApiError
from engine.server.jobs import Answer, Failed, Job, QueuedBackend, read_ahead, run_job
from engine.server.parallel import feed_lanes

if TYPE_CHECKING:
    from engine.llama.lanes import Lanes
    from engine.session import Session



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
        self._lane_ids = itertools.count(1 << 20)  # lanes' request ids (the session's count from 1)
        self._thread = threading.Thread(target=self._run, name="ebb-serve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ any thread

    def submit(self, job: Job) -> int:
        if self.load_error is not None:
            raise ApiError(503, f"the model did not load: {self.load_error}")
        job.image_dir = self.image_dir
        place = self.jobs.submit(job)
        read_ahead(self.session, job)
        return place

    def close(self, timeout: float = 30.0) -> None:
        self.stop_all("the server is shutting down")  # the thread ends after the current jobs
        self._thread.join(timeout)

    # ------------------------------------------------------------ the worker's thread

    def _run(self) -> None:
        from engine.session import Session

        try:
            self.session = Session(self.cfg)
            if self.session.projector_refused:  # text only: said where the server is watched
                print(f"ebb-engine: note: {self.session.projector_refused}", file=sys.stderr,
                      flush=True)
            if self.session.model.draft_refused:
                print(f"ebb-engine: note: {self.session.model.draft_refused}", file=sys.stderr, flush=True)
            lanes = self._lanes()
            if lanes is not None:
                print(f"ebb-engine: answering up to {len(lanes.lanes) + 1} requests at once (text "
                      f"replies beside the first; {lanes.pool} KV cells for them)", file=sys.stderr,
                      flush=True)
        except EbbError as exc:
            self.load_error = str(exc)
        except Exception as exc:  # noqa: BLE001 - said to every client, not a crash
            self.load_error = f"{type(exc).__name__}: {exc}"
        finally:
            self.ready.set()
        while True:
            lanes = self._lanes()
            if lanes is not None and lanes.busy:  # the session is free: it takes the next job,
                job = self.jobs.take(block=False)  # and the lanes go on in its batches
                if job is None:
                    lanes.step()
                    continue
            else:
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

    def _lanes(self) -> Lanes | None:
        """The loaded runtime's lanes (a reload makes new ones), fed from this queue."""
        if self.session is None:
            return None
        if self.session.model.lane_feed is None:  # a new session (a remote device went away)
            self.session.model.feed_lanes(self._feed)
        rt = self.session.model.runtime
        return rt.lanes if rt is not None else None

    def _feed(self) -> None:
        """Before each batch: waiting jobs a lane can answer begin on the free lanes."""
        lanes = self._lanes()
        if lanes is not None:
            feed_lanes(lanes, self, self.cfg.system, lambda: next(self._lane_ids), self._answered,
                       self.session)

    def _answered(self, job: Job, result: Answer) -> None:
        self.served += 1
        if self.on_turn is not None:
            self.on_turn(job, result)

    def _answer(self, job: Job) -> Answer:
        assert self.session is not None  # loaded before the first job is taken
        self.session, result = answer_job(self.session, job, self.cfg.system)
        return result
