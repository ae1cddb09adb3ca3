"""/v1/chat/completions: a request checked into a `ChatRequest` (messages, pictures and clips,
sampling, tools, response formats), and the reply's shapes, whole and streamed. Pure."""
from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import time
import urllib.parse
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from engine.events import Logprob

from engine.server.errors import ApiError as ApiError  # where every rule below raises it
from engine.server.sampling import FIELDS as SAMPLING_FIELDS
from engine.server.sampling import Sampling, parse_sampling
from engine.server.api.common import MAX_CHOICES, check_fields, integer, number, stop_sequences, stream_flags


@dataclass(frozen=True)
class Attachment:
    """A picture, a sound clip, a video or a file a message carries: bytes from a data URL, an
    `input_audio`, video or `file` part, or a local file."""
    data: bytes | None = None
    path: Path | None = None
    suffix: str = ".img"  # the file it is written to: a clip's says its format
    name: str = ""  # the client's own name for it (a transcription's upload), if it gave one

    def key(self) -> str:
        return hashlib.sha256(self.data).hexdigest() if self.data is not None else str(self.path)


@dataclass(frozen=True)
class Turn:
    role: str  # "user" or "assistant"; in ChatRequest.messages also "tool"
    text: str
    attachments: tuple[Attachment, ...] = ()
    # in ChatRequest.messages: an assistant's `tool_calls`, a tool's `tool_call_id` and `name`
    extra: dict[str, Any] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ChatRequest:
    system: str | None
    history: tuple[Turn, ...]  # every message before the last
    last: Turn  # the user's message the reply answers
    stream: bool = False
    include_usage: bool = False
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int = 0  # 0: no cap
    stop: tuple[str, ...] = ()
    seed: int | None = None
    user: str = ""
    top_logprobs: int = -1  # -1: no logprobs; else the sampled token's and this many best
    grammar: str = ""  # GBNF the reply must follow (response_format, or the tools' calls)
    json_reply: bool = False  # response_format asks JSON: a capped reply ends in a whole value
    transcribe: bool = False  # /v1/audio/transcriptions: the clip is speech to write down
    tools: tuple[Any, ...] = ()  # engine.tools.calls.Tool
    tool_choice: Any = None  # engine.tools.calls.ToolChoice
    extra: dict[str, Any] = field(default_factory=dict)
    # for a chat template with a tool format of its own (tools.template_format): the client's
    # system text alone, and every message as it came (calls and results unflattened)
    own_system: str | None = None
    messages: tuple[Turn, ...] = ()
    sampling: Sampling = field(default_factory=Sampling)  # llama.cpp's other sampler knobs
    n: int = 1  # choices, generated one after another (seed + i for choice i when seeded)
    # the chat template's own switches (llama-server's chat_template_kwargs), and OpenAI's
    # reasoning_effort, which a template with a thinking switch gets as enable_thinking
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_effort: str | None = None
    # the calls answered since the user's last message (tools.answered_calls): made again,
    # they would loop, so such a reply is taken again as text (engine/server/worker.py)
    answered: frozenset[tuple[str, str]] = frozenset()

    def thinking_kwargs(self, template_source: str) -> dict[str, Any]:
        """What the template is rendered with: the client's kwargs, and enable_thinking from
        reasoning_effort where the template has that switch and the client did not set it."""
        out = dict(self.template_kwargs)
        if (self.reasoning_effort is not None and "enable_thinking" not in out
                and "enable_thinking" in template_source):
            out["enable_thinking"] = self.reasoning_effort not in ("none", "minimal")
        return out

    @functools.cached_property  # asked as the job is queued and again as it is answered
    def conversation_tag(self) -> str:
        """What this conversation's kept states go by: its system text and first message, which
        a client sends again with every turn (a branch of it shares them, and the turn's prefix
        match picks its state). Known before the prompt is rendered: the read of a kept state
        starts from it (Session.read_ahead)."""
        first = (self.history or (self.last,))[0]
        opening = [self.system, first.role, first.text, [i.key() for i in first.attachments]]
        return "api-" + hashlib.sha256(json.dumps(opening).encode()).hexdigest()[:16]

    def callable_tools(self) -> tuple[Any, ...]:
        from engine.tools.calls import offered

        return offered(self.tools, self.tool_choice) if self.tool_choice is not None else ()


def image_from_url(url: Any, param: str) -> Attachment:
    """A data URL (base64) or a local file:// path. Ebb fetches nothing from the network."""
    if not isinstance(url, str) or not url:
        raise ApiError(400, "'image_url.url' must be a non-empty string", param)
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if head.lower().startswith(("data:audio/", "data:video/")):
            kind = head[5:].split(";", 1)[0]
            raise ApiError(400, f"'image_url' takes pictures, and this data URL is {kind}: send "
                                "a sound clip as an 'input_audio' part ({\"type\": \"input_audio\", "
                                "\"input_audio\": {\"data\": BASE64, \"format\": \"wav\"}})", param)
        if not sep or ";base64" not in head:
            raise ApiError(400, "an image data URL must be base64: data:image/png;base64,...", param)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "the image data URL's base64 is invalid", param) from None
        if not data:
            raise ApiError(400, "the image data URL is empty", param)
        if not _is_picture(data):
            raise ApiError(400, "the image data URL is not a picture Ebb can read (PNG, JPEG, "
                                "WebP, GIF, BMP, ...)", param)
        return Attachment(data=data)
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ApiError(400, f"a file:// URL must name a local file, not host {parsed.netloc!r}", param)
        # whether it may be read, and exists, is the server's to decide (worker.attachment_path)
        return Attachment(path=Path(urllib.parse.unquote(parsed.path)))
    if parsed.scheme in ("http", "https"):
        raise ApiError(400, "Ebb does not fetch images from the network: send the picture as a "
                            "data URL (data:image/png;base64,...) or a local file:// path", param)
    raise ApiError(400, f"unsupported image URL scheme {parsed.scheme or url[:16]!r}: use a data "
                        "URL or a local file:// path", param)


def _is_picture(data: bytes) -> bool:
    """Whether Pillow recognises the bytes as an image format (the header only: nothing is
    decoded here; a damaged picture is found when it is)."""
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)):
            return True
    except Image.DecompressionBombError:  # a picture, refused later with its size
        return True
    except (UnidentifiedImageError, OSError, ValueError):
        return False


def _content(content: Any, role: str, param: str) -> tuple[str, tuple[Attachment, ...]]:
    if isinstance(content, str):
        return content, ()
    if content is None and role == "assistant":
        return "", ()
    if not isinstance(content, list):
        raise ApiError(400, "'content' must be a string or a list of content parts", param)
    texts: list[str] = []
    attachments: list[Attachment] = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise ApiError(400, "a content part must be an object", where)
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ApiError(400, "a text part needs 'text' as a string", where)
            texts.append(part["text"])
        elif kind == "image_url":
            if role != "user":
                raise ApiError(400, f"pictures, sound, videos and files are read from user messages only, not {role}", where)
            spec = part.get("image_url")
            url = spec.get("url") if isinstance(spec, dict) else spec
            attachments.append(image_from_url(url, f"{where}.image_url"))
        elif kind == "input_audio":
            if role != "user":
                raise ApiError(400, f"sound is read from user messages only, not {role}", where)
            attachments.append(_input_audio(part.get("input_audio"), f"{where}.input_audio"))
        elif kind in ("input_video", "video_url"):
            if role != "user":
                raise ApiError(400, f"videos are read from user messages only, not {role}", where)
            attachments.append(_input_video(part.get(kind), f"{where}.{kind}"))
        elif kind == "file":
            if role != "user":
                raise ApiError(400, f"files are read from user messages only, not {role}", where)
            attachments.append(_file_part(part.get("file"), f"{where}.file"))
        else:
            raise ApiError(400, f"unsupported content part type {kind!r} (text, image_url, "
                                "input_audio, input_video and file are)", where)
    return "\n".join(texts), tuple(attachments)


MAX_AUDIO_PART_BYTES = 64 * 1024 * 1024


AUDIO_PART_FORMATS = {"wav": ".wav", "mp3": ".mp3", "flac": ".flac", "ogg": ".ogg", "opus": ".ogg",
                      "m4a": ".m4a", "aac": ".aac", "webm": ".webm"}


def _input_audio(spec: Any, where: str) -> Attachment:
    """OpenAI's `input_audio` part: {"data": base64, "format": "wav" | "mp3"} (and flac, and a
    phone's or browser's ogg, opus, m4a, aac, webm)."""
    from engine.media.audio import AV_CONTAINER_KINDS, sniff

    names = ", ".join(AUDIO_PART_FORMATS)
    if not isinstance(spec, dict) or not isinstance(spec.get("data"), str):
        raise ApiError(400, "an input_audio part needs {\"data\": base64, \"format\": \"wav\" or "
                            "\"mp3\"}", where)
    fmt = spec.get("format")
    if fmt not in AUDIO_PART_FORMATS:
        raise ApiError(400, f"input_audio format {fmt!r} is not one Ebb decodes ({names} are)",
                       f"{where}.format")
    if len(spec["data"]) > MAX_AUDIO_PART_BYTES * 4 // 3 + 4:
        raise ApiError(413, f"a clip is at most {MAX_AUDIO_PART_BYTES // (1024 * 1024)} MiB", where)
    try:
        data = base64.b64decode(spec["data"], validate=True)
    except ValueError:
        raise ApiError(400, "input_audio data is not valid base64", f"{where}.data") from None
    kind = sniff(data[:12])
    if kind is None:
        raise ApiError(400, f"input_audio data is not a sound clip Ebb decodes ({names})",
                       f"{where}.data")
    if kind in AV_CONTAINER_KINDS:  # a container that may hold a video: the part says it is sound
        return Attachment(data=data, suffix=AUDIO_PART_FORMATS[fmt])
    return Attachment(data=data, suffix=f".{kind.lower()}")


TRANSCRIBE = "Transcribe this audio word for word. Answer with the words alone."
SNIFFED_FORMATS = {"WAV": "wav", "MP3": "mp3", "FLAC": "flac", "Ogg": "ogg", "M4A": "m4a",
                   "MP4": "m4a", "AAC": "aac", "WebM": "webm"}


def parse_transcription_request(form: dict[str, Any]) -> ChatRequest:
    """OpenAI's /v1/audio/transcriptions form (`file`, and `model`, `prompt`, `language`,
    `temperature`, `response_format` json or text) as the chat turn that answers it: the clip
    with an instruction to write it down."""
    upload = form.get("file")
    if not isinstance(upload, tuple):
        raise ApiError(400, "a transcription needs the clip as the form's 'file'", "file")
    name, data = upload
    if form.get("response_format", "json") not in ("json", "text"):
        raise ApiError(400, f"response_format {form.get('response_format')!r}: Ebb answers json or "
                            "text", "response_format")
    from engine.media.audio import sniff

    fmt = SNIFFED_FORMATS.get(sniff(bytes(data[:12])) or "", Path(str(name)).suffix.lstrip(".").lower())
    try:
        temperature = float(form.get("temperature") or 0)
    except ValueError:
        raise ApiError(400, "'temperature' must be a number", "temperature") from None
    words = TRANSCRIBE
    if form.get("language"):
        words += f" The speech is in {form['language']}."
    if form.get("prompt"):
        words += f" Earlier words, for context: {form['prompt']}"
    body = {"model": form.get("model", ""), "temperature": temperature,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": words},
                {"type": "input_audio", "input_audio": {
                    "data": base64.b64encode(bytes(data)).decode(), "format": fmt}}]}]}
    try:
        req = parse_chat_request(body)
    except ApiError as exc:
        raise ApiError(exc.status, exc.message.replace("input_audio ", "the file's "), "file") from None
    if name:  # what is said of the clip names the client's file, not the copy written of it
        last = replace(req.last, attachments=tuple(replace(i, name=str(name)) for i in req.last.attachments))
        req = replace(req, last=last)
    return replace(req, transcribe=True)


MAX_MEDIA_PART_BYTES = 256 * 1024 * 1024  # a video or a document sent inline
VIDEO_FORMATS = {"mp4": ".mp4", "mov": ".mov", "mkv": ".mkv", "webm": ".webm", "avi": ".avi",
                 "gif": ".gif", "m4v": ".m4v"}


def _base64_part(text: Any, where: str, what: str) -> bytes:
    """A part's base64 (or a data URL's), decoded; refused past MAX_MEDIA_PART_BYTES."""
    if not isinstance(text, str) or not text:
        raise ApiError(400, f"{what} needs its data as base64", where)
    if text.startswith("data:"):
        head, sep, text = text.partition(",")
        if not sep or ";base64" not in head:
            raise ApiError(400, f"{what}'s data URL must be base64", where)
    if len(text) > MAX_MEDIA_PART_BYTES * 4 // 3 + 4:
        raise ApiError(413, f"{what} is at most {MAX_MEDIA_PART_BYTES // (1024 * 1024)} MiB", where)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{what}'s base64 is invalid", where) from None
    if not data:
        raise ApiError(400, f"{what} is empty", where)
    return data


def _input_video(spec: Any, where: str) -> Attachment:
    """llama-server's `input_video` part ({"data": base64, "format": "mp4"}, or {"url": ...}),
    or `video_url` ({"url": "data:video/mp4;base64,..." or "file://..."})."""
    if isinstance(spec, str):
        spec = {"url": spec}
    if not isinstance(spec, dict):
        raise ApiError(400, "a video part needs {\"data\": base64, \"format\": \"mp4\"} or "
                            "{\"url\": ...}", where)
    url = spec.get("url")
    if isinstance(url, str) and url.startswith("file:"):
        parsed = urllib.parse.urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ApiError(400, f"a file:// URL must name a local file, not host {parsed.netloc!r}", where)
        return Attachment(path=Path(urllib.parse.unquote(parsed.path)))
    if isinstance(url, str) and url.startswith(("http:", "https:")):
        raise ApiError(400, "Ebb does not fetch videos from the network: send the data, or a local "
                            "file:// path", where)
    fmt = str(spec.get("format") or "")
    if not fmt and isinstance(url, str) and url.startswith("data:video/"):
        fmt = url[len("data:video/"):].split(";")[0].replace("quicktime", "mov").replace("x-matroska", "mkv")
    data = _base64_part(spec.get("data") or url, where, "a video")
    from engine.media.kinds import VIDEO, kind_of_bytes

    if kind_of_bytes(data) != VIDEO:
        raise ApiError(400, "the video's data is not a video Ebb reads (MP4, MOV, MKV, WebM, AVI, "
                            "animated GIF)", where)
    return Attachment(data=data, suffix=VIDEO_FORMATS.get(fmt.lower(), ".mp4"))


def _file_part(spec: Any, where: str) -> Attachment:
    """OpenAI's `file` part: {"filename": "report.pdf", "file_data": "data:application/pdf;
    base64,..."}: a PDF, or a text file (by its name)."""
    from engine.media.kinds import PDF, TEXT_SUFFIXES, kind_of_bytes

    if not isinstance(spec, dict):
        raise ApiError(400, "a file part needs {\"filename\": ..., \"file_data\": base64}", where)
    if spec.get("file_id") and not spec.get("file_data"):
        raise ApiError(400, "Ebb has no Files API: send the file inline as 'file_data'", where)
    name = str(spec.get("filename") or "document")
    data = _base64_part(spec.get("file_data"), where, "a file")
    suffix = Path(name).suffix.lower()
    if kind_of_bytes(data) == PDF:
        return Attachment(data=data, suffix=".pdf")
    if suffix in TEXT_SUFFIXES:
        return Attachment(data=data, suffix=suffix)
    raise ApiError(400, f"{name!r} is not a PDF or a text file (by its name: .txt, .md, .csv, "
                        "code, ...)", where)


MAX_TOP_LOGPROBS = 20  # as OpenAI's
# What a chat request may carry. Ebb answers these:
HANDLED = frozenset({"messages", "model", "n", "stream", "stream_options", "stop", "max_tokens",
                     "max_completion_tokens", "seed", "user", "temperature", "top_p",
                     "response_format", "logprobs", "top_logprobs", "tools", "tool_choice",
                     "parallel_tool_calls", "reasoning_effort", "chat_template_kwargs"}) | SAMPLING_FIELDS
# Accepted at the value that asks for nothing (what OpenAI's clients send by default); any
# other value is refused by name rather than silently ignored.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "functions": ([],), "function_call": ("none", "auto"), "modalities": (["text"],),
}


def parse_chat_request(body: Any) -> ChatRequest:
    """Check a /v1/chat/completions body; ApiError(400) says what is wrong and where."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_fields(body, HANDLED, NEUTRAL)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    from engine.tools import calls as tl

    try:
        tools = tl.parse_tools(body.get("tools"))
        choice = tl.parse_tool_choice(body.get("tool_choice"), tools)
    except tl.ToolsRefused as exc:
        raise ApiError(400, exc.what, exc.param) from None
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    # off unless asked for, as llama-server: a small model offered several calls makes several
    choice = replace(choice, parallel=bool(parallel))
    system: list[str] = []
    turns: list[Turn] = []  # calls and results flattened into text (the universal format)
    native: list[Turn] = []  # as they came, for a template that knows tools
    called: dict[str, str] = {}  # a call's id: its function's name
    for i, msg in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ApiError(400, "a message must be an object", param)
        role = msg.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(400, f"unsupported role {role!r} (system, developer, user, assistant "
                                "and tool are)", f"{param}.role")
        text, attachments = _content(msg.get("content"), str(role), f"{param}.content")
        if role in ("system", "developer"):
            system.append(text)
        elif role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in called:
                raise ApiError(400, "a tool message needs the 'tool_call_id' of an earlier "
                                    "assistant tool call", f"{param}.tool_call_id")
            native.append(Turn("tool", text, (), {"tool_call_id": call_id, "name": called[call_id]}))
            result = tl.result_text(called[call_id], text)
            if turns and turns[-1].role == "user":  # results of one turn's calls: one message
                turns[-1] = Turn("user", turns[-1].text + "\n\n" + result, turns[-1].attachments)
            else:
                turns.append(Turn("user", result))
        else:
            calls = msg.get("tool_calls") if role == "assistant" else None
            if calls is not None:
                made = _calls(calls, called, param)
                native.append(Turn("assistant", text, (), {"tool_calls": [c.for_template() for c in made]}))
                text = "\n".join(filter(None, [text] + [tl.call_text(c.name, c.arguments) for c in made]))
            else:
                native.append(Turn(str(role), text, attachments))
            if role == "user" and turns and turns[-1].role == "user":  # after tool results
                turns[-1] = Turn("user", turns[-1].text + "\n\n" + text,
                                 turns[-1].attachments + attachments)
            else:
                turns.append(Turn(str(role), text, attachments))
    if not turns or turns[-1].role != "user":
        raise ApiError(400, "the last message must be the user's or a tool's", "messages")
    own_system = "\n\n".join(system) if system else None
    if tl.offered(tools, choice):
        system.append(tl.system_text(tools, choice))
    n = integer(body, "n", 1) or 1
    if n > MAX_CHOICES:
        raise ApiError(400, f"'n' is at most {MAX_CHOICES}: each choice is generated in turn", "n")
    stream, include_usage = stream_flags(body)
    stops = stop_sequences(body)
    max_tokens = integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = integer(body, "max_tokens", 1)
    seed = integer(body, "seed", -(2**63))
    user = body.get("user", "")
    grammar = response_grammar(body.get("response_format"))
    json_reply = bool(grammar)  # json_object or json_schema
    sampling = parse_sampling(body)
    if sampling.grammar:
        if grammar or tl.offered(tools, choice):
            raise ApiError(400, "'grammar' cannot be followed beside 'response_format' or "
                                "'tools': ask for one of them", "grammar")
        grammar = sampling.grammar
    if tl.offered(tools, choice):
        if grammar:
            raise ApiError(400, "Ebb cannot follow 'response_format' and offer 'tools' in one "
                                "request: ask for one of them", "response_format")
        try:
            grammar = tl.grammar(tools, choice)
        except tl.ToolsRefused as exc:
            raise ApiError(400, exc.what, exc.param) from None
    top_logprobs = -1
    if body.get("logprobs") is not None and not isinstance(body.get("logprobs"), bool):
        raise ApiError(400, "'logprobs' must be true or false", "logprobs")
    if body.get("logprobs"):
        top_logprobs = integer(body, "top_logprobs", 0) or 0
        if top_logprobs > MAX_TOP_LOGPROBS:
            raise ApiError(400, f"'top_logprobs' is at most {MAX_TOP_LOGPROBS}", "top_logprobs")
    elif body.get("top_logprobs"):
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return ChatRequest(
        system="\n\n".join(system) if system else None, history=tuple(turns[:-1]),
        last=turns[-1], stream=stream, include_usage=include_usage,
        temperature=number(body, "temperature", 0.0, 2.0), top_p=number(body, "top_p", 0.0, 1.0),
        max_tokens=max_tokens or 0, stop=stops, seed=seed,
        user=user if isinstance(user, str) else "", grammar=grammar, top_logprobs=top_logprobs,
        json_reply=json_reply, tools=tools, tool_choice=choice, own_system=own_system, messages=tuple(native),
        sampling=sampling, n=n, template_kwargs=_template_kwargs(body.get("chat_template_kwargs")),
        reasoning_effort=_reasoning_effort(body.get("reasoning_effort")),
        answered=tl.answered_calls(native))


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
_RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "bos_token", "eos_token",
                                      "add_generation_prompt", "raise_exception", "tool_choice",
                                      "functions", "function_call", "strftime_now"})


def _reasoning_effort(value: Any) -> str | None:
    if value is None:
        return None
    if value not in REASONING_EFFORTS:
        raise ApiError(400, f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}",
                       "reasoning_effort")
    return str(value)


def _template_kwargs(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ApiError(400, "'chat_template_kwargs' must be an object of names to values",
                       "chat_template_kwargs")
    taken = sorted(set(value) & _RESERVED_TEMPLATE_NAMES)
    if taken:
        raise ApiError(400, f"'chat_template_kwargs' cannot set {', '.join(taken)}: Ebb sets them",
                       "chat_template_kwargs")
    return dict(value)


def _calls(calls: Any, called: dict[str, str], param: str) -> list[Any]:
    """An assistant's tool calls (engine.tools.calls.ToolCall); `called` learns their ids."""
    from engine.tools.calls import ToolCall

    if not isinstance(calls, list):
        raise ApiError(400, "'tool_calls' must be a list", f"{param}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        where = f"{param}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(call.get("id"), str):
            raise ApiError(400, "a tool call needs 'id' and 'function': {name, arguments}", where)
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            raise ApiError(400, "a tool call's 'arguments' must be a JSON string", where)
        called[call["id"]] = fn["name"]
        out.append(ToolCall(call["id"], fn["name"], args))
    return out


def response_grammar(fmt: Any) -> str:
    """The grammar a `response_format` asks for: none for text, any JSON object for
    json_object, the schema's shape for json_schema (llama-cpp-python's converter)."""
    if fmt is None:
        return ""
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "'response_format.type' must be text, json_object or json_schema",
                       "response_format")
    from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

    if fmt["type"] == "text":
        return ""
    if fmt["type"] == "json_object" and fmt.get("schema") is None:
        return str(JSON_GBNF)
    if fmt["type"] == "json_object":  # llama-server's form: {"type": "json_object", "schema": {...}}
        schema = fmt["schema"]
    else:
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ApiError(400, "the response_format's schema must be a JSON schema object",
                       "response_format")
    try:
        return str(json_schema_to_gbnf(json.dumps(schema)))
    except Exception as exc:  # noqa: BLE001 - the converter raises many kinds
        raise ApiError(400, f"the JSON schema cannot be followed: {exc}", "response_format") from None


def completion(cid: str, model: str, text: str, finish: str, use: dict[str, Any],
               logprobs: Sequence[Logprob] | None = None,
               tool_calls: list[dict[str, Any]] | None = None,
               more: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A chat completion; `more`: further choices, as `choice()` makes them."""
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice(0, text, finish, logprobs, tool_calls), *(more or [])],
            "usage": use}


def _logprobs(entries: Sequence[Logprob] | None) -> dict[str, Any] | None:
    return {"content": [e.to_dict() for e in entries]} if entries is not None else None


def choice(index: int, text: str, finish: str, logprobs: Sequence[Logprob] | None = None,
           tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message = {"role": "assistant", "content": None, "tool_calls": tool_calls}
    return {"index": index, "message": message, "finish_reason": finish,
            "logprobs": _logprobs(logprobs)}


def chunk(cid: str, model: str, delta: dict[str, Any], finish: str | None = None,
          use: dict[str, Any] | None = None, choices: bool = True,
          logprobs: Sequence[Logprob] | None = None, index: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
        "choices": [{"index": index, "delta": delta, "finish_reason": finish,
                     "logprobs": _logprobs(logprobs)}]
        if choices else []}
    if use is not None:
        out["usage"] = use
    return out
