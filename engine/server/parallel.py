"""Jobs answered on lanes (engine/llama/lanes.py) beside the session's sequence: a chat or a
completion whose reply is text, with pictures and sound clips in its messages where the model
runs on the CPU (encoded on the CPU as the lane starts: `Session.lane_prompt`). Whatever needs
the session (videos, documents, an accelerator's swap, tools, logprobs, a JSON reply closed at
its cap, several choices, a conversation longer than a lane's room) waits for it as before. The
prompt is the one the session would write: the same template, system prompt and switches.
Engine thread only.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

from engine.errors import EbbError
from engine.events import Span, TurnResult
from engine.llama.lanes import MIN_REPLY, LaneRequest, LaneResult
from engine.server.api.chat import ChatRequest
from engine.server.api.common import ApiError, StopWatcher, finish_reason
from engine.server.api.completions import CompletionRequest
from engine.server.jobs import Answer, Done, Failed, Job, Piece, QueuedBackend

if TYPE_CHECKING:
    from engine.llama.lanes import Lanes
    from engine.llama.runtime import TextRuntime
    from engine.session.session import LanePrompt, Session


def lane_fits(job: Job) -> bool:
    """Whether a lane can answer `job` (text and attachments in, text out, nothing the session
    alone does; whether a lane takes its attachments is `Session.lane_prompt`'s to say)."""
    req = job.request
    if isinstance(req, CompletionRequest):
        return len(req.all_prompts) == 1 and req.top_logprobs < 0
    if not isinstance(req, ChatRequest):
        return False
    turns = (*req.history, req.last, *req.messages)
    return (req.n == 1 and not req.transcribe and not req.tools and req.top_logprobs < 0
            and not req.json_reply and not any(t.extra for t in turns) and req.last.role == "user")


def _with_pictures(session: Session | None, job: Job, req: ChatRequest, default_system: str | None,
                   request_id: int) -> LanePrompt | None:
    """The request's prompt with its attachments for a lane, or None: the session's to answer."""
    from engine.server.answering import attachment_path

    if session is None:
        return None
    try:
        turns = [(t.role, t.text, [attachment_path(job, a) for a in t.attachments])
                 for t in (*req.history, req.last)]
        system = req.system if req.system is not None else default_system
        rt = session.model.runtime
        return session.lane_prompt(turns, system, req.thinking_kwargs(rt.template_source if rt else ""),
                                   request_id)
    except (ApiError, EbbError):
        return None  # the session's turn says what is wrong with it


def _prompt(rt: TextRuntime, req: ChatRequest | CompletionRequest, default_system: str | None) -> list[int]:
    if isinstance(req, CompletionRequest):
        p = req.prompt
        return rt.tokenize(p, add_special=True) if isinstance(p, str) else list(p)
    system = req.system if req.system is not None else default_system
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": t.role, "content": t.text} for t in (*req.history, req.last)]
    text, added_special = rt.format_chat(messages, None, req.thinking_kwargs(rt.template_source))
    return rt.tokenize(text, add_special=not added_special)


STARTED, WAIT, NEVER = "started", "wait", "never"


def start_on_lane(lanes: Lanes, job: Job, default_system: str | None, request_id: int,
                  over: Callable[[Job, Answer | None], None], session: Session | None = None) -> str:
    """Begin answering `job` on a free lane: STARTED; WAIT when the lanes' room is not there
    now; NEVER when it is the session's to answer after all (a conversation that needs
    fitting, a prompt the session refuses with its own words). The client hears `Piece`s,
    then `Done` or `Failed`; `over` runs just before (with the answer, or None)."""
    req = job.request
    assert isinstance(req, (ChatRequest, CompletionRequest))
    rt = lanes.rt
    pictures = None
    if isinstance(req, ChatRequest) and any(t.attachments for t in (*req.history, req.last)):
        pictures = _with_pictures(session, job, req, default_system, request_id)
        if pictures is None:
            return NEVER
        tokens: list[Any] = pictures.keys
    else:
        try:
            tokens = _prompt(rt, req, default_system)
        except EbbError:
            return NEVER  # said by the session's own path, as for any request
    started = False
    try:  # a request that does not start frees its pictures' chunks (one that does: when it ends)
        if _never(lanes, req, tokens):
            return NEVER
        started = _start(lanes, job, req, tokens, pictures, rt, request_id, over)
        return STARTED if started else WAIT
    finally:
        if pictures is not None and not started:
            pictures.close()


def _start(lanes: Lanes, job: Job, req: ChatRequest | CompletionRequest, tokens: list[Any],
           pictures: LanePrompt | None, rt: TextRuntime, request_id: int,
           over: Callable[[Job, Answer | None], None]) -> bool:
    """The request on a free lane, its answer told to the client as it comes; False: no room now."""
    from engine.server.answering import _gen_params

    gp = _gen_params(req, req.grammar if isinstance(req, ChatRequest) else req.sampling.grammar)
    watcher = StopWatcher(req.stop)
    shown: list[str] = []

    def on_text(piece: str) -> None:
        text = watcher.feed(piece)
        if text:
            shown.append(text)
            job.on_event(Piece(text))
        if watcher.hit:
            job.cancel.set()  # the stop sequence ends it before its next step

    def on_end(res: LaneResult) -> None:
        if res.error is not None:  # refused before it began (its grammar), or cut (the model went)
            over(job, None)
            began = res.stats.stop_reason is not None
            job.on_event(Failed(ApiError(503, f"the reply was cut: {res.error}") if began
                                else ApiError(400, res.error)))
            return
        rest = watcher.flush()
        if rest:
            shown.append(rest)
            job.on_event(Piece(rest))
        g = res.stats
        device = "CPU" if not rt.params.devices else rt.params.devices[0]
        encoded = [replace(s, lane=res.seq) for s in pictures.spans] if pictures is not None else []
        turn = TurnResult(request_id, text="".join(shown), gen=g,
                          n_images=pictures.n_images if pictures is not None else 0,
                          strategy=pictures.strategy if pictures is not None else "none",
                          spans=[*encoded,  # its lane in the panel
            Span(request_id, name="prefill", start_s=res.started, end_s=res.first, device=device,
                 detail=f"{g.n_prompt_tokens_evaluated} of {g.n_prompt_tokens} tokens", lane=res.seq),
            Span(request_id, name="decode", start_s=res.first, end_s=res.ended, device=device,
                 detail=f"{g.n_gen_tokens} tokens", lane=res.seq)])
        answer = Answer(request_id, finish_reason(str(g.stop_reason or ""), watcher.hit),
                        g.n_prompt_tokens, g.n_gen_tokens, "".join(shown), turn,
                        job.cancel.is_set() and not watcher.hit)
        over(job, answer)
        job.on_event(Done(answer))

    return lanes.start(LaneRequest(tokens, gp, on_text, on_end, job.cancel,
                                   items=pictures.items if pictures is not None else None,
                                   close=pictures.close if pictures is not None else None))


def _never(lanes: Lanes, req: ChatRequest | CompletionRequest, tokens: list[Any]) -> bool:
    """Whether the request is the session's after all: an empty prompt, bad ids, an echo, a
    conversation longer than a lane's share (the session fits it) or than the pool."""
    rt = lanes.rt
    if not tokens or any(isinstance(t, int) and (t >= rt.info.n_vocab or t < 0) for t in tokens) \
            or len(tokens) + MIN_REPLY > lanes.pool // len(lanes.lanes):
        return True
    if isinstance(req, CompletionRequest) and req.echo:
        return True
    return bool((req.max_tokens and len(tokens) + req.max_tokens > lanes.pool) or not lanes.busy
                and len(tokens) + (req.max_tokens or MIN_REPLY) > lanes.room())


def feed_lanes(lanes: Lanes, backend: QueuedBackend, default_system: str | None,
               request_ids: Callable[[], int], answered: Callable[[Job, Answer], None],
               session: Session | None = None) -> None:
    """Before each batch (Lanes.feed), on the engine thread: the oldest waiting jobs a lane can
    answer begin on the free lanes. One that finds no room waits, and no other is tried until a
    lane ends; one that is the session's after all keeps its place for it."""
    def over(job: Job, result: Answer | None) -> None:
        backend.on_lanes.pop(id(job), None)
        backend.lanes_full = False
        if result is not None:
            answered(job, result)

    while lanes.free_lane() and not backend.lanes_full and not backend.jobs.closing:
        taken = backend.jobs.take_first(lambda j: not j.session_only and lane_fits(j))
        if taken is None:
            return
        place, job = taken
        backend.on_lanes[id(job)] = job
        how = start_on_lane(lanes, job, default_system, request_ids(), over, session)
        if how != STARTED:
            backend.on_lanes.pop(id(job), None)
            job.session_only = how == NEVER
            backend.lanes_full = not job.session_only
            backend.jobs.put_back(place, job)
