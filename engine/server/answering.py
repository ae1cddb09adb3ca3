"""A job answered on a session: the chat (templates with tools, the calls held and streamed,
stop sequences, n choices), the text completion and the embeddings; a request's pictures and
clips as files the session reads (a data URL written once, by its content; a file:// one only
from the allowed folder). Engine thread only.
"""
from __future__ import annotations

import random
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from engine.errors import EbbError
from engine.events import Logprob
from engine.media.audio import AUDIO_SUFFIXES, OTHER_SOUND_SUFFIXES
from engine.server.api.chat import Attachment, ChatRequest
from engine.server.api.common import ApiError, StopWatcher, finish_reason, logprobs_within
from engine.server.api.completions import CompletionRequest
from engine.server.api.embeddings import EmbeddingRequest
from engine.tools.calls import (
    OPENERS,
    ToolsRefused,
    ArgumentStream,
    CallGate,
    read_calls,
    spec,
    template_extra,
    template_format,
    text_grammar,
)
from engine.tools.calls import grammar as tool_grammar
from engine.server.jobs import Answer, Event, Job, Piece

if TYPE_CHECKING:
    from engine.session import Session



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
    # the model's own tool format where its template has one (engine/tools/calls.py), else the universal one
    fmt = template_format(session.model.runtime.template_source) if usable and session.model.runtime else None
    if fmt is not None:
        session.set_system(req.own_system if req.own_system is not None else default_system)
        session.set_tools([spec(t) for t in usable])
        # call ids as the template takes them (Mistral's: 9 letters and digits)
        *before, last = [replace(t, extra=template_extra(fmt, t.extra)) for t in req.messages]
        try:
            grammar = tool_grammar(req.tools, req.tool_choice, fmt) if calls_allowed else text_grammar(fmt)
        except ToolsRefused as exc:
            raise ApiError(400, exc.what, exc.param) from None
    else:
        session.set_system(req.system if req.system is not None else default_system)
        session.set_tools(None)
        before, last, grammar = list(req.history), req.last, req.grammar
        if usable and not calls_allowed:
            grammar = text_grammar(None)
    session.set_history([(t.role, t.text, [attachment_path(job, i) for i in t.attachments], t.extra)
                         for t in before], tag=req.conversation_tag)
    attachments = [attachment_path(job, i) for i in last.attachments]
    said = _names_said([*before, last], job)
    if req.transcribe:  # speech, to a model that hears, and no longer than speech can be
        req = replace(req, max_tokens=_transcript_cap(session, attachments, req.max_tokens, said))
    pending: list[Logprob] = []  # sampled tokens' logprobs not yet sent with text
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
                job.on_event(Piece(text, tuple(pending)))
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

    session, res = turn_with_recovery(session, last.text, attachments, gp, on_text=on_text,
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


# Fast speech is about 3 words (4-5 tokens) a second: a transcript is capped at twice that for
# the clip's length and a little more, so a model that drifts from the speech stops near its end
TRANSCRIPT_TOKENS_PER_S = 8
TRANSCRIPT_EXTRA_TOKENS = 32


def _transcript_cap(session: Session, clips: list[Path], asked: int, said: Callable[[str], str]) -> int:
    """The transcription's token cap from its clip's length; an ApiError (400) for a file with
    no sound (a silent video) or a model that does not hear: nothing is made up."""
    from engine.media import kinds
    from engine.media.audio import clip_info

    [clip] = clips
    try:
        kind = kinds.kind_of(clip)
        if kind == kinds.VIDEO:
            from engine.media import video

            if not video.probe(clip).has_sound:
                raise EbbError(f"{clip.name} is a video with no sound: there is no speech to write down",
                               "send a clip with speech in it")
        seconds = clip_info(clip).seconds
    except EbbError as exc:
        raise ApiError(400, said(str(exc)), "file") from None
    if session.clip_chunk_tokens() <= 0:
        raise ApiError(400, f"a transcription needs a model that hears, and {session.encoder.why_deaf()}",
                       "model")
    cap = int(seconds * TRANSCRIPT_TOKENS_PER_S) + TRANSCRIPT_EXTRA_TOKENS
    return min(asked, cap) if asked > 0 else cap


def _gen_params(req: ChatRequest | CompletionRequest, grammar: str = "",
                on_logprob: Callable[[Logprob], None] | None = None) -> Any:
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
        logprobs=logprobs_within(g.logprobs, text[len(echoed):]), text_offset=len(echoed))


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
        for j, ref in enumerate(t.attachments, 1):
            if ref.data is None:
                continue
            written = f"{ref.key()}{ref.suffix}"
            what = "clip" if ref.suffix.lower() in AUDIO_SUFFIXES + OTHER_SOUND_SUFFIXES else "attachment"
            said = ref.name or (f"the {what} in message {k}" if len(t.attachments) == 1
                                else f"{what} {j} of message {k}")
            names[str(job.image_dir / written)] = names[written] = said

    def say(text: str) -> str:
        for written in sorted(names, key=len, reverse=True):  # whole paths before bare names
            text = text.replace(written, names[written])
        return text
    return say


def attachment_path(job: Job, ref: Attachment) -> Path:
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
