"""EngineWorker: the one QObject, on its own QThread, that owns every llama.cpp object.

The window calls its slots only through queued signals; it emits exactly one engine event
object per signal. The streamed reply does not go through signals: each piece is put in
`stream` (a lock and a list: no Qt event per token, nothing that waits on the GUI), which the
window takes from on a timer. `cancel()` and `stream.take()` are what the GUI thread may call
directly.
"""
from __future__ import annotations

import itertools
import threading
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

from PySide6.QtCore import QMetaObject, QObject, Qt, Signal, Slot

from app.core.chat_state import ChatHistory
from app.core.settings import resolve_model
from engine import events
from engine.config import SessionConfig
from engine.conversation import ReplyState
from engine.errors import EbbError
from engine.llama.sampling import GenParams
from engine.session import Session, turn_with_recovery
from engine.server.jobs import Answer, Job



class TextStream:
    """Pieces of reply text from the engine thread, taken in batches by the GUI thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pieces: list[tuple[int, str]] = []

    def put(self, request_id: int, text: str) -> None:
        with self._lock:
            self._pieces.append((request_id, text))

    def take(self) -> list[tuple[int, str]]:
        with self._lock:
            pieces, self._pieces = self._pieces, []
        return pieces


class EngineWorker(QObject):
    engine_event = Signal(object)  # every engine event (not `event`: QObject.event handles QEvents)

    def __init__(self) -> None:
        super().__init__()
        self._session: Session | None = None
        self._loaded_with: tuple[SessionConfig, list[str]] | None = None  # what _session is
        self._cancel = threading.Event()
        self._closing = threading.Event()
        self._tune_cancel = threading.Event()
        self.stream = TextStream()
        # app/mainwindow/serving.py's WindowBackend, while serving (serving.py imports this module)
        self.server_backend: Any = None
        self._lane_ids = itertools.count(1 << 20)  # the lanes' request ids (the session's from 1)
        self._pumping = False  # a queued pump_lanes is due
        # the window's own reply is on its way (set by the GUI thread from Send to its end): the
        # local server counts it ahead of the requests that wait
        self.turn_running = threading.Event()
        # tools (engine/tools): the window's ToolHost, and for the next Send the chat's servers
        # and the tools it always allows (set by the GUI thread before it asks for the turn)
        self.tool_host: Any = None
        self.turn_tools: tuple[tuple[str, ...], set[str], str] | None = None
        self._answers: dict[str, str] = {}  # a call's id -> the user's answer on its card
        self._answered = threading.Condition()
        self._chat_system: str | None = None  # the open chat's system prompt, as the window set it

    @property
    def session(self) -> Session | None:
        """The loaded session, for what any thread may ask of it (Session.read_ahead)."""
        return self._session

    def _lanes(self) -> Any:
        """The loaded runtime's lanes (Settings → requests at once), fed from the local
        server's queue before each batch: a client's text reply goes on beside the window's."""
        rt = self._session.model.runtime if self._session is not None else None
        return rt.lanes if rt is not None else None

    def _feed_lanes(self) -> None:
        from engine.server.parallel import feed_lanes

        backend, lanes, session = self.server_backend, self._lanes(), self._session
        if backend is None or lanes is None or session is None:
            return
        feed_lanes(lanes, backend, session.cfg.system, lambda: next(self._lane_ids),
                   lambda j, a: self._server_answered(backend, j, a), session)
        if lanes.busy and not self._pumping:  # after what runs now (a turn carries them meanwhile)
            self._pumping = True
            QMetaObject.invokeMethod(self, "pump_lanes", Qt.ConnectionType.QueuedConnection)

    @Slot()
    def pump_lanes(self) -> None:
        """One batch of the lanes' work while the window's session is idle, then again behind
        whatever the window asked meanwhile (its sends go first: the lanes ride in its batches)."""
        lanes = self._lanes()
        if lanes is None or not lanes.busy or self._closing.is_set():
            self._pumping = False
            return
        lanes.step()
        QMetaObject.invokeMethod(self, "pump_lanes", Qt.ConnectionType.QueuedConnection)

    def _server_answered(self, backend: Any, j: Job, a: Answer) -> None:  # before the client hears
        backend.served += 1
        for span in a.turn.spans if a.turn is not None else ():
            if span.lane:  # a lane's steps, drawn once it ended (the session's are drawn live)
                self.engine_event.emit(span)
        self.engine_event.emit(events.ServerTurn(
            a.request_id, client=j.client, n_prompt_tokens=a.prompt_tokens,
            n_gen_tokens=a.completion_tokens, finish_reason=a.finish_reason,
            n_images=a.turn.n_images if a.turn else 0,
            strategy=a.turn.strategy if a.turn else "", client_gone=a.client_gone))

    @Slot()
    def serve_next(self) -> None:
        """The local server's oldest waiting request (app/mainwindow/serving.py): on a lane
        when one can answer it, else on the window's session, whose conversation is put back
        afterwards."""
        from engine.server.api.common import ApiError
        from engine.server.answering import answer_job
        from engine.server.jobs import Failed, run_job

        backend = self.server_backend
        if backend is None:
            return
        if self._lanes() is not None:
            self._feed_lanes()  # text requests begin on lanes (pumped through queued calls)
        job = backend.jobs.take(block=False)
        if job is None:  # its client left while it waited
            return
        if self._session is None:
            job.on_event(Failed(ApiError(503, "no model is loaded in the window")))
            return
        session = self._session
        saved = session.save_conversation()

        def answer(j: Job) -> Answer:
            self._session, result = answer_job(session, j, saved.system)
            return result

        def answered(j: Job, a: Answer) -> None:  # before the client hears
            self._server_answered(backend, j, a)

        backend.busy_with = job
        try:
            run_job(job, answer, answered)
        finally:
            backend.busy_with = None
            if self._session is session:
                session.restore_conversation(saved)
            else:  # a remote device went away during it: the window's conversation moves on
                # (its cache holds none of it: nothing to continue from there)
                self._session.restore_conversation(replace(saved, reply=ReplyState.IDLE))
                self._announce(self._session)

    def cancel(self) -> None:
        """Any thread: ask the running generation to stop at the next token (a tool call's
        card that waits for an answer, or a running call, ends too)."""
        self._cancel.set()
        self._tune_cancel.set()
        with self._answered:
            self._answered.notify_all()

    def answer_call(self, call_id: str, decision: str) -> None:
        """GUI thread: the user's answer on a tool call's card (once, always or deny)."""
        with self._answered:
            self._answers[call_id] = decision
            self._answered.notify_all()

    def arm_tune(self) -> None:
        """GUI thread, before asking for a tune: a Stop or Close from now on ends it, even one
        that comes before the tune's job has begun (it cleared the cancel at its start, and a
        dialog closed at once ran every run, a minute and more)."""
        self._tune_cancel.clear()

    def closing(self) -> None:
        """Any thread: the window is going; what runs stops, and nothing loads after it (a tune
        stopped by closing loaded the model again first: the process lived on ~60 s)."""
        self._closing.set()
        self.cancel()

    def _fail(self, request_id: int, exc: BaseException) -> None:
        if not isinstance(exc, EbbError):
            traceback.print_exc()
        msg = str(exc) if isinstance(exc, EbbError) else f"{type(exc).__name__}: {exc}"
        self.engine_event.emit(events.EngineFailed(request_id, message=msg))

    @Slot(object, object)
    def load(self, cfg: SessionConfig, rpc: list[str]) -> None:
        """Load `cfg`; if it cannot be loaded, say why and load the one that was loaded before
        (a bad pair of files must not leave the window with no model)."""
        previous = self._loaded_with
        try:
            self._load(cfg, rpc)
        except Exception as exc:  # keep the window alive; show what happened
            again = previous is not None and previous[0] != cfg
            if not isinstance(exc, EbbError):
                traceback.print_exc()
            reason = str(exc) if isinstance(exc, EbbError) else f"{type(exc).__name__}: {exc}"
            name = Path(str(cfg.model_path)).name
            if cfg.mmproj_path is not None:
                name += f" with {Path(str(cfg.mmproj_path)).name}"
            msg = (f"Could not load {name}: {reason}"
                   + (f". Loading {Path(str(previous[0].model_path)).name} again." if again and previous else ""))
            self.engine_event.emit(events.EngineFailed(0, message=msg))
            if again and previous is not None:
                try:
                    self._load(*previous)
                except Exception as exc2:  # noqa: BLE001 - said; the window stays without a model
                    self._fail(0, exc2)

    def _load(self, cfg: SessionConfig, rpc: list[str]) -> None:
        self.engine_event.emit(events.ModelLoading(0, model_path=str(cfg.model_path)))
        self._close_session()
        self._loaded_with = None
        from engine.llama.devices import connect_rpc

        for endpoint in rpc:
            connect_rpc(endpoint)
        resolved, files = resolve_model(cfg)
        s = Session(replace(resolved, rpc=tuple(rpc)), emit=self.engine_event.emit, files=files)
        self._session = s
        self._loaded_with = (cfg, list(rpc))
        self._announce(s)

    def _announce(self, s: Session) -> None:
        from engine.llama import native
        from engine.llama.about import backend_notes
        from engine.llama.devices import list_devices
        from engine.tools.calls import template_format

        s.model.feed_lanes(self._feed_lanes)  # the local server's text requests, beside
        proj = s.proj_info
        assert s.model.runtime is not None
        self.engine_event.emit(events.ModelLoaded(
            0, model_path=str(s.cfg.model_path), model_name=s.info.name, n_layers=s.info.n_layers,
            n_ctx=s.n_ctx, n_threads=s.n_threads, load_s=s.load_s,
            details=events.LoadDetails(
                mover=s.model.mover_name, mover_note=s.model.mover_note, accelerator=s.model.accel,
                accelerator_endpoint=s.model.accel_endpoint, budget_bytes=s.model.budget_bytes,
                n_layers_on_accel=s.model.placement.n_layers_on_accel,
                layers_by_device=dict(s.model.placement.layers_by_device),
                placement_reason=s.model.placement_reason, memory_note=s.model.memory_note,
                projector=str(s.cfg.mmproj_path) if s.cfg.mmproj_path else "",
                projector_synthetic=bool(proj and proj.synthetic), vision=s.encoder.enabled,
                projector_names_colours=bool(proj and proj.names_colours),
                projector_refused=s.projector_refused, draft_refused=s.model.draft_refused,
                projector_sees=bool(proj is None or proj.sees),
                projector_hears=bool(proj and proj.hears), clip_chunk_tokens=s.clip_chunk_tokens(),
                picture_tokens=s.picture_tokens()[0], picture_side=s.picture_tokens()[1],
                rpc_bytes_sent=s.load_rpc_bytes_sent,
                # a GPU backend built in that cannot run here; safe mode (engine.llama.native)
                backend_notes=tuple(backend_notes()), safe_mode=native.safe_mode(),
                tool_format=template_format(s.model.runtime.template_source) or "",
                requested=((str(self._loaded_with[0].model_path),
                            str(self._loaded_with[0].mmproj_path or ""))
                           if self._loaded_with else None),
                # this session's servers only: one registered earlier may be gone
                devices=tuple(list_devices(s.cfg.rpc)))))

    @Slot(object)
    def set_history(self, history: ChatHistory | list[tuple[Any, ...]]) -> None:
        """The open chat's messages (a list), or a ChatHistory with its system prompt too."""
        if self._session is None:
            return
        turns: list[tuple[Any, ...]]
        tag, superseded = "", None
        if not isinstance(history, ChatHistory):
            turns = history
        else:
            self._session.set_system(history.system)
            self._chat_system = history.system
            turns, tag, superseded = history.turns, history.tag, history.superseded
        # a chat's kept tool calls: each as the model's call and its result (engine/tools/loop.py)
        from engine.tools.calls import template_format
        from engine.tools.loop import history_turns

        runtime = self._session.model.runtime
        self._session.set_history(history_turns(turns, template_format(runtime.template_source)
                                                if runtime is not None else None), tag)
        # the model's memory of the chat back from disk now, while the user reads and types;
        # a Send waits behind it (the same thread), another chat opened stops it
        try:
            self._session.take_up(superseded)
        except EbbError as exc:
            self._fail(0, exc)

    @Slot()
    def persist(self) -> None:
        """Keep the model's memory of the open chat on disk (the window is idle or closes)."""
        if self._session is not None:
            try:
                self._session.persist()
            except Exception:  # a cache: never worth a failure
                pass

    @Slot(str)
    def forget(self, tag: str) -> None:
        """A chat was deleted: its saved states go too."""
        if self._session is not None:
            self._session.forget(tag)

    @Slot(int)
    def set_state_budget(self, budget_bytes: int) -> None:
        if self._session is not None:
            self._session.set_state_budget(budget_bytes)

    @Slot(bool)
    def set_vision(self, enabled: bool) -> None:
        if self._session is None:
            return
        try:
            self._session.set_vision(enabled)
        except EbbError as exc:
            self._fail(0, exc)
            enabled = self._session.encoder.enabled
        self.engine_event.emit(events.VisionChanged(0, enabled=enabled))

    @Slot(int, str, object, object)
    def send(self, request_id: int, text: str, images: list[str], gp: GenParams) -> None:
        if self._session is None:
            self.engine_event.emit(events.EngineFailed(request_id, message="no model is loaded"))
            return
        self._cancel.clear()
        tools, self.turn_tools = self.turn_tools, None
        try:
            if tools is not None and self.tool_host is not None:
                session, res = self._tool_turn(request_id, text, images, gp, *tools)
            else:
                session, res = turn_with_recovery(
                    self._session, text, images, gp, cancel=self._cancel, emit=self.engine_event.emit,
                    on_text=lambda s: self.stream.put(request_id, s))
        except Exception as exc:
            self._fail(request_id, exc)
            return
        if session is not self._session:  # a remote device went away: now on what is left
            self._session = session
            self._announce(session)
        self.engine_event.emit(events.TurnFinished(request_id, result=res))

    def _tool_turn(self, request_id: int, text: str, images: list[str], gp: GenParams,
                   servers: tuple[str, ...], always: set[str], first: str = "") -> tuple[Session, Any]:
        """The turn through the tool loop (engine/tools/loop.py) with the chat's servers' tools:
        each call's card asks the user (events.ToolCallChanged) and this thread waits for the
        answer, or a Stop."""
        from engine.tools.loop import Decision, first_choice, offer, run_tool_turn

        assert self._session is not None
        host = self.tool_host
        offered, _left = offer(host.tools(), lambda t: t.server in servers)
        system = self._chat_system  # the chat's own (the loop adds the tools' description)
        by_fn = {o.fn: o.tool for o in offered}

        def ask(rec: Any) -> Decision:
            with self._answered:
                self._answered.wait_for(lambda: rec.id in self._answers or self._cancel.is_set())
                answer = self._answers.pop(rec.id, Decision.DENY.value)
            return Decision(answer)

        def call(rec: Any, cancel: threading.Event) -> Any:
            tool = by_fn[rec.fn]
            return host.call(tool.server, tool.name, rec.arguments, cancel)

        def told(rec: Any) -> None:
            self.engine_event.emit(events.ToolCallChanged(request_id, call=rec.to_dict()))

        def turn(s: Session, t: str, i: list[Any], g: GenParams, ot: Any, c: Any, role: str,
                 extra: Any) -> tuple[Session, Any]:
            return turn_with_recovery(s, t, i, g, on_text=ot, cancel=c, emit=self.engine_event.emit,
                                      role=role, extra=extra)

        session, tt = run_tool_turn(
            self._session, text, images, gp, offered, ask=ask, call=call, always=always,
            on_text=lambda piece: self.stream.put(request_id, piece), on_call=told,
            cancel=self._cancel, system=system, turn=turn,
            choice=first_choice(first, offered) if first else None)
        res = tt.last
        if tt.message:
            res.notes = [*res.notes, tt.message]
        return session, res

    @Slot(int, object)
    def continue_reply(self, request_id: int, gp: GenParams) -> None:
        """Go on with the last reply (Continue): resumed from the KV cache when it can be."""
        if self._session is None:
            self.engine_event.emit(events.EngineFailed(request_id, message="no model is loaded"))
            return
        self._cancel.clear()
        try:
            res = self._session.continue_reply(gp, on_text=lambda s: self.stream.put(request_id, s),
                                               cancel=self._cancel)
        except Exception as exc:
            self._fail(request_id, exc)
            return
        self.engine_event.emit(events.TurnFinished(request_id, result=res))

    @Slot(object, object)
    def tune(self, cfg: SessionConfig, rpc: list[str]) -> None:
        """Autotune the model's accelerator layers, then load the session again (the tuning
        runs need the device to themselves). Stop (cancel) ends it between two timings; a
        closing window loads nothing after it."""
        from engine.llama.devices import default_budget, pick_accelerator
        from engine.measure.autotune import Cancelled
        from engine.measure.tune_session import tune_for

        # the model as it is now comes back afterwards (not `cfg` anew: a stand-in's budget is
        # set by the window at load), and the runs measure the budget it was loaded with (read
        # after closing, a device that frees late reported almost nothing: 1 run, 0 layers)
        before = self._loaded_with
        session_budget = self._session.model.budget_bytes if self._session is not None else None
        try:
            self._close_session()
            self._loaded_with = None
            resolved, files = resolve_model(cfg)
            cfg = replace(resolved, rpc=tuple(rpc))  # what to measure (threads searched)
            accel = pick_accelerator(cfg.rpc, cfg.accel)
            if accel is None:
                raise EbbError("there is no accelerator to tune for: add an RPC server in Settings "
                               "or use a GPU")
            budget = session_budget or cfg.vram_budget_bytes or default_budget(accel)
            result = tune_for(
                cfg, accel, budget, cancel=self._tune_cancel, files=files,
                on_point=lambda p, top: self.engine_event.emit(events.TunePoint(
                    0, layers=p.layers, prompt_tps=p.prompt_tps, gen_tps=p.gen_tps,
                    prompt_tps_by_threads=p.prompt_tps_by_threads,
                    gen_tps_by_threads=p.gen_tps_by_threads, max_layers=top)),
                on_flash=lambda n: self.engine_event.emit(events.TuneNote(
                    0, text=f"Choosing flash attention: {n} more runs, each with a few thousand "
                            "tokens of history")))
            self.engine_event.emit(events.TuneFinished(0, result=result))
        except Cancelled:
            self.engine_event.emit(events.TuneFinished(0, result=None))
        except Exception as exc:
            self._fail(0, exc)
        if not self._closing.is_set():
            self.load(*(before or (cfg, rpc)))

    @Slot()
    def shutdown(self) -> None:
        self._close_session()

    def _close_session(self) -> None:
        if self._session is not None:
            self.persist()
            self._session.close()
            self._session = None
