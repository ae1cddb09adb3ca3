"""The streamed answers of the endpoint: OpenAI's server-sent events for a chat and a text
completion, from the job's events as the worker's thread hands them to the server's loop."""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

from engine.server.api.chat import chunk
from engine.server.api.completions import text_completion
from engine.server.jobs import Done, Event, Job, Piece

KEEPALIVE_S = 1.0  # a waiting stream sends an SSE comment this often (and so sees a client leave)

# what a stream writes while its job waits in line (ServerState.waiting_comment)
Waiting = Callable[[Job], str]


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def job_events(events: asyncio.Queue[Event]) -> AsyncIterator[Event | None]:
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


async def to_sse(parts: AsyncIterator[str], job: Job) -> AsyncIterator[str]:
    """`parts`, then OpenAI's end mark; a client that leaves mid-stream stops the job."""
    finished = False
    try:
        async for part in parts:
            yield part
        yield "data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:  # the client left mid-stream: the worker stops between tokens
            job.cancel.set()


async def chat_stream(job: Job, events: asyncio.Queue[Event], cid: str, model: str,
                      waiting: Waiting) -> AsyncIterator[str]:
    yield sse(chunk(cid, model, {"role": "assistant", "content": ""}))
    started = {0}  # the choices whose role was sent
    streamed_calls: set[int] = set()  # the choices whose calls went out as deltas
    async for ev in job_events(events):
        if ev is None:
            yield waiting(job)
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
                yield sse(chunk(cid, model, {}, c.finish_reason, index=c.index))
            if getattr(job.request, "include_usage", False):  # usage: only when asked, once
                yield sse(chunk(cid, model, {}, use=a.usage, choices=False))
        else:
            yield sse(ev.error.body())


async def text_stream(job: Job, events: asyncio.Queue[Event], cid: str, model: str,
                      waiting: Waiting) -> AsyncIterator[str]:
    async for ev in job_events(events):
        if ev is None:
            yield waiting(job)
        elif isinstance(ev, Piece):
            yield sse(text_completion(cid, model, ev.text, None, None, chunk=True, index=ev.index))
        elif isinstance(ev, Done):
            for c in ev.answer.choices or (ev.answer,):
                yield sse(text_completion(cid, model, "", c.finish_reason, None, chunk=True,
                                          index=c.index))
            if getattr(job.request, "include_usage", False):
                yield sse(text_completion(cid, model, "", None, ev.answer.usage, chunk=True,
                                          choices=False))
        else:
            yield sse(ev.error.body())
