"""Jobs answered on lanes (engine/llama/lanes.py) beside the session's sequence: a chat or a
completion that is text in and text out. Whatever needs the session (pictures, clips, tools,
logprobs, a JSON reply closed at its cap, several choices, a conversation longer than a lane's
room) waits for it as before. The prompt is the one the session would write: the same template,
system prompt and switches. Engine thread only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

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


def lane_fits(job: Job) -> bool:
    """Whether a lane can answer `job` (text in, text out, nothing the session alone does)."""
    req = job.request
    if isinstance(req, CompletionRequest):
        return len(req.all_prompts) == 1 and req.top_logprobs < 0
    if not isinstance(req, ChatRequest):
        return False
    turns = (*req.history, req.last, *req.messages)
    return (req.n == 1 and not req.transcribe and not req.tools and req.top_logprobs < 0
            and not req.json_reply and not any(t.attachments for t in turns)
            and not any(t.extra for t in turns) and req.last.role == "user")


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
                  over: Callable[[Job, Answer | None], None]) -> str:
    """Begin answering `job` on a free lane: STARTED; WAIT when the lanes' room is not there
    now; NEVER when it is the session's to answer after all (a conversation that needs
    fitting, a prompt the session refuses with its own words). The client hears `Piece`s,
    then `Done` or `Failed`; `over` runs just before (with the answer, or None)."""
    from engine.server.answering import _gen_params

    req = job.request
    assert isinstance(req, (ChatRequest, CompletionRequest))
    rt = lanes.rt
    try:
        tokens = _prompt(rt, req, default_system)
    except EbbError:
        return NEVER  # said by the session's own path, as for any request
    if not tokens or any(t >= rt.info.n_vocab or t < 0 for t in tokens) \
            or len(tokens) + MIN_REPLY > lanes.pool // len(lanes.lanes):
        return NEVER  # empty, bad ids, or a conversation that needs fitting: the session's
    if isinstance(req, CompletionRequest) and req.echo:
        return NEVER
    if (req.max_tokens and len(tokens) + req.max_tokens > lanes.pool) or not lanes.busy and \
            len(tokens) + (req.max_tokens or MIN_REPLY) > lanes.room():
        return NEVER  # a lane's share would never hold it
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
        turn = TurnResult(request_id, text="".join(shown), gen=g, spans=[  # its lane in the panel
            Span(request_id, name="prefill", start_s=res.started, end_s=res.first, device=device,
                 detail=f"{g.n_prompt_tokens_evaluated} of {g.n_prompt_tokens} tokens", lane=res.seq),
            Span(request_id, name="decode", start_s=res.first, end_s=res.ended, device=device,
                 detail=f"{g.n_gen_tokens} tokens", lane=res.seq)])
        answer = Answer(request_id, finish_reason(str(g.stop_reason or ""), watcher.hit),
                        g.n_prompt_tokens, g.n_gen_tokens, "".join(shown), turn,
                        job.cancel.is_set() and not watcher.hit)
        over(job, answer)
        job.on_event(Done(answer))

    return STARTED if lanes.start(LaneRequest(tokens, gp, on_text, on_end, job.cancel)) else WAIT


def feed_lanes(lanes: Lanes, backend: QueuedBackend, default_system: str | None,
               request_ids: Callable[[], int], answered: Callable[[Job, Answer], None]) -> None:
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
        how = start_on_lane(lanes, job, default_system, request_ids(), over)
        if how != STARTED:
            backend.on_lanes.pop(id(job), None)
            job.session_only = how == NEVER
            backend.lanes_full = not job.session_only
            backend.jobs.put_back(place, job)
