"""The window's settings and the session config built from them (Qt-free).

Saved in the store's settings table; DEFAULTS names every key. DEMO stands for the generated
demo projector (random weights) wherever a projector path is accepted.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import PhaseTuning, SessionConfig, flash_choice
from engine.tune_result import TuneResult
from engine.server.limits import DEFAULT_PORT
from engine.units import parse_size

if TYPE_CHECKING:
    from app.core.store import Store
    from engine.gguf.model_files import ModelFiles
    from engine.llama.sampling import GenParams

DEMO = "demo"
DEMO_LABEL = ("demo projector: generated, not trained — at most it tells a picture's colour "
              "(red, green, blue, yellow, black, white)")
DEMO_AUDIO_LABEL = ("generated audio projector: random weights — it runs the whole audio "
                    "pipeline but does not hear")


# a seed of -1: each reply (each version of it too) draws a new one; 0 and up: fixed, so
# Regenerate gives the same reply
NEW_SEED_EACH_REPLY = -1


@dataclass(frozen=True)
class Settings:
    """Every window setting, typed: saved in the store's settings table one key per field,
    checked on the way in (RULES). Read as `s.ctx`, changed with `dataclasses.replace`."""
    vram_budget: str = ""  # a size ("6GiB"), or "": the accelerator's free memory less a margin
    threads: int = 0  # 0: the physical cores
    ctx: int = 4096
    image_max_tokens: int = 0  # 0: the projector's default
    flash_attn: str | bool = "auto"  # "auto", True or False (engine.config.flash_choice)
    vision: str = "auto"  # auto | resident | swap | cpu
    rpc: list[str] = field(default_factory=list)
    model_folders: list[str] = field(default_factory=list)
    gpu_layers: int = -1  # -1: all that fit
    spread: bool = False
    max_tokens: int = 0  # 0: no cap
    overflow: str = "drop-oldest"
    image_cache: str = "1GiB"
    # the model's memory of chats and their encoded pictures, kept in the data folder's
    # states/ to reopen a chat at once (0: not kept)
    memory_disk: str = "4GiB"
    # each phase at its best (Model → Tune…): the prompt's layers (-1: as generation's) and
    # threads (0: as generation's), and the prompt speeds autotune measured per layer count
    # (JSON keys: the layer count as text), which price a move
    prompt_layers: int = -1
    threads_batch: int = 0
    prompt_speeds: dict[str, float] = field(default_factory=dict)
    # the same for a prompt with images (a batch of the projector's image tokens): -1 as for
    # text prompts
    image_layers: int = -1
    image_speeds: dict[str, float] = field(default_factory=dict)
    # Settings → Local server: the OpenAI-compatible endpoint
    server: bool = False
    server_host: str = "127.0.0.1"
    server_port: int = DEFAULT_PORT
    server_api_key: str = ""
    # requests answered at once (engine/llama/lanes.py): the local server's text requests go on
    # beside the window's reply; 1: one after another (more turns flash attention on: a reload)
    parallel: int = 1
    # a small model of the same vocabulary that guesses the reply's next tokens ("": none)
    draft_model: str = ""
    # a new chat's system prompt and sampling (each chat may have its own: chat_params)
    system_prompt: str = ""
    temperature: float = 0.7
    top_p: float = 0.95
    repeat_penalty: float = 1.0
    seed: int = NEW_SEED_EACH_REPLY
    json_replies: bool = False
    top_k: int = 40
    min_p: float = 0.05
    # Chat settings' own named presets: name -> the chat settings above
    chat_presets: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Model → Get models…: a Hub mirror ("": HF_ENDPOINT, else the Hub) and a token for gated
    # repos ("": HF_TOKEN)
    hub_endpoint: str = ""
    hub_token: str = ""
    hub_images: bool = True  # Get models' "Can see images", as it was left

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# every key with its default (the store's view of Settings)
DEFAULTS: dict[str, Any] = Settings().to_dict()
# RPC servers lost during a step before this process restarted itself (see engine/llama/fatal.py)
LOST_RPC = {e for e in os.environ.get("EBB_LOST_RPC", "").split(",") if e}


def reply_seed(seed: int, temperature: float) -> tuple[int | None, bool]:
    """The seed one reply samples with and whether the chat fixed it: a new draw for each reply
    unless the seed is fixed; None for a greedy reply (temperature 0: nothing is drawn)."""
    if temperature <= 0:
        return None, False
    if seed == NEW_SEED_EACH_REPLY:
        import secrets

        return secrets.randbits(32), False
    return seed, True


def _whole(lo: int, hi: int) -> Any:
    def check(v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"a whole number from {lo} to {hi}")
        return v
    return check


def _between(lo: float, hi: float) -> Any:
    def check(v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            raise ValueError(f"a number from {lo} to {hi}")
        return float(v)
    return check


def _one_of(*choices: str) -> Any:
    def check(v: Any) -> Any:
        if v not in choices:
            raise ValueError("one of " + ", ".join(choices))
        return v
    return check


def _of_type(kind: type, what: str) -> Any:
    def check(v: Any) -> Any:
        if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
            raise ValueError(what)
        return v
    return check


def _flash(v: Any) -> Any:
    """"auto" (on with an accelerator, off on the CPU alone), or on/off as true/false."""
    if v != "auto" and not isinstance(v, bool):
        raise ValueError('"auto", true or false')
    return v


def _size(allow_empty: bool) -> Any:
    def check(v: Any) -> Any:
        if allow_empty and v == "":
            return v
        try:
            n = parse_size(v) if isinstance(v, str) else -1
        except Exception:  # noqa: BLE001 - any unreadable size
            n = -1
        if n < 0 or (allow_empty and n == 0):
            raise ValueError("a size such as 6GiB or 512MiB" + (", or empty" if allow_empty else ""))
        return v
    return check


def _strings(v: Any) -> Any:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError("a list of texts")
    return v


_UNREADABLE = object()
# what each saved setting may be; a value that is not is replaced by its default, with a notice
RULES: dict[str, Any] = {
    "vram_budget": _size(allow_empty=True), "threads": _whole(0, 1024), "ctx": _whole(128, 1 << 21),
    "image_max_tokens": _whole(0, 1 << 16), "flash_attn": _flash,
    "vision": _one_of("auto", "resident", "swap", "cpu"), "rpc": _strings, "model_folders": _strings,
    "gpu_layers": _whole(-1, 100_000), "spread": _of_type(bool, "true or false"),
    "max_tokens": _whole(0, 1 << 21), "overflow": _one_of("drop-oldest", "stop"),
    "image_cache": _size(allow_empty=False), "memory_disk": _size(allow_empty=False),
    "prompt_layers": _whole(-1, 100_000),
    "threads_batch": _whole(0, 1024), "prompt_speeds": _of_type(dict, "a table of speeds"),
    "chat_presets": _of_type(dict, "a table of named chat settings"),
    "image_layers": _whole(-1, 100_000), "image_speeds": _of_type(dict, "a table of speeds"),
    "server": _of_type(bool, "true or false"), "server_host": _of_type(str, "a host name"),
    "server_port": _whole(1, 65535), "parallel": _whole(1, 16),
    "draft_model": _of_type(str, "a file path, or empty"), "server_api_key": _of_type(str, "a text"),
    "system_prompt": _of_type(str, "a text"), "temperature": _between(0.0, 2.0),
    "top_p": _between(0.0, 1.0), "repeat_penalty": _between(0.5, 2.0), "seed": _whole(NEW_SEED_EACH_REPLY, 2**32 - 1),
    "top_k": _whole(0, 100_000), "min_p": _between(0.0, 1.0),
    "json_replies": _of_type(bool, "true or false"),
    "hub_endpoint": _of_type(str, "a URL, or empty"), "hub_token": _of_type(str, "a text"),
    "hub_images": _of_type(bool, "true or false"),
}


@dataclass(frozen=True)
class ChatParams:
    """A chat's system prompt and sampling (Model → Chat settings…), named as in Settings:
    saved per chat under "chat:<id>", the chat's own where it has them, else Settings'."""
    system_prompt: str = ""
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    seed: int = NEW_SEED_EACH_REPLY
    json_replies: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


CHAT_KEYS = tuple(f.name for f in fields(ChatParams))


def chat_params(store: Store, conv_id: int) -> ChatParams:
    """A chat's system prompt and sampling: its own where it has them, else Settings'."""
    base = {k: v for k, v in load_settings(store).to_dict().items() if k in CHAT_KEYS}
    own = store.settings.get(f"chat:{conv_id}", {}) if conv_id else {}
    for k, v in (own.items() if isinstance(own, dict) else ()):
        if k in CHAT_KEYS:
            try:
                base[k] = RULES[k](v)
            except ValueError:
                continue
    return ChatParams(**base)


def default_gen_params(s: Settings) -> GenParams:
    """Sampling for a chat without its own, from the settings."""
    from engine.llama.sampling import GenParams

    return GenParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                     top_k=s.top_k, min_p=s.min_p, repeat_penalty=s.repeat_penalty, seed=s.seed)


def chat_gen_params(store: Store, conv_id: int, base: GenParams) -> GenParams:
    """A reply's sampling (GenParams): `base` (the window's, from Settings), with the chat's
    own on top where it has them (Model → Chat settings…)."""
    own = store.settings.get(f"chat:{conv_id}") if conv_id else None
    if not isinstance(own, dict):
        return base
    p = chat_params(store, conv_id)
    from llama_cpp.llama_grammar import JSON_GBNF

    return replace(base, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                   repeat_penalty=p.repeat_penalty, seed=p.seed,
                   grammar=str(JSON_GBNF) if p.json_replies else "", json_reply=p.json_replies)


def set_chat_params(store: Store, conv_id: int, params: ChatParams) -> None:
    store.settings.set(f"chat:{conv_id}", params.to_dict())


# Chat settings' presets everyone has (the user's own are saved in "chat_presets")
BUILT_IN_PRESETS: dict[str, dict[str, Any]] = {
    "Precise": {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repeat_penalty": 1.05},
    "Balanced": {"temperature": 0.7, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "repeat_penalty": 1.0},
    "Creative": {"temperature": 1.0, "top_p": 0.98, "top_k": 0, "min_p": 0.02, "repeat_penalty": 1.0},
    "Greedy (always the same reply)": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                       "repeat_penalty": 1.0},
}


GREEDY_PRESET = "Greedy (always the same reply)"
# The demo projector is closed-form: it makes a picture read "(a solid red picture)", and the
# 135M demo model names the colour as its most likely word. Sampled at the window's default
# (temperature 0.7, min-p 0.05, new seeds) it named the right colour 18 times in 48 (8 shades,
# 6 colours, 4 seeds: "The colour is purple.", "This is a toy car."); greedy, every time (the
# colour check's 30 shades). So a chat that sends the demo a picture replies greedily, and says so.
DEMO_GREEDY_NOTE = ("This chat now replies greedily (Chat settings: “Greedy”): the demo projector "
                    "is a generated toy that only tells a picture's colour, and the small demo "
                    "model names it as its most likely word; sampled at temperature 0.7 it named "
                    "the right colour 18 times in 48. Chat settings… changes it back.")


def demo_chat_params(store: Store, conv_id: int) -> bool:
    """A chat about to send the demo projector a picture, with no sampling of its own: give it
    the greedy preset (kept as its own, shown in Chat settings). True when it was set now."""
    if not conv_id or isinstance(store.settings.get(f"chat:{conv_id}"), dict):
        return False
    base = chat_params(store, conv_id)
    greedy = {k: v for k, v in BUILT_IN_PRESETS[GREEDY_PRESET].items() if k in CHAT_KEYS}
    set_chat_params(store, conv_id, replace(base, **greedy))
    return True


def checked_settings(store: Store) -> tuple[Settings, list[str]]:
    """Every setting, saved or default; a saved value of the wrong type or out of range falls
    back to its default, and each such one is named in the problems (the window shows them)."""
    out: dict[str, Any] = {}
    problems: list[str] = []
    for key, default in DEFAULTS.items():
        try:
            value = store.settings.get(key, default)
        except ValueError:  # not even JSON
            value = _UNREADABLE
        try:
            out[key] = RULES[key](value) if key in RULES else value
        except ValueError as exc:
            out[key] = default
            shown = "(unreadable)" if value is _UNREADABLE else repr(value)
            problems.append(f"The setting {key} = {shown} is not valid ({exc}): using "
                            f"{default!r} until it is changed in Settings.")
    return Settings(**out), problems


def load_settings(store: Store) -> Settings:
    """Every setting, saved or default (invalid saved values as their defaults)."""
    return checked_settings(store)[0]


def session_config(store: Store, model: str, mmproj: str, ctx: int | None = None,
                   threads: int | None = None,
                   rpc: list[str] | None = None) -> tuple[SessionConfig, list[str]]:
    """A SessionConfig from the saved settings, and the RPC servers to connect: `rpc` first,
    then Settings' list, less any lost ones. (The model is remembered as the last used one only
    once it has loaded: remember_model.)"""
    s = load_settings(store)
    cfg = SessionConfig(
        model_path=Path(model), mmproj_path=Path(mmproj) if mmproj else None,
        n_ctx=ctx or s.ctx, n_threads=threads or s.threads or None,
        vram_budget_bytes=parse_size(s.vram_budget) if s.vram_budget else None,
        vision=s.vision, flash_attn=flash_choice(s.flash_attn),
        image_max_tokens=s.image_max_tokens,
        gpu_layers=s.gpu_layers if s.gpu_layers >= 0 else None,
        spread=s.spread, overflow=s.overflow,
        image_cache_bytes=parse_size(s.image_cache) if s.image_cache else 1 << 30,
        state_dir=states_dir(store), state_disk_bytes=parse_size(s.memory_disk),
        n_threads_batch=s.threads_batch or None, phases=phase_tuning(s), parallel=s.parallel,
        draft_path=Path(s.draft_model).expanduser() if s.draft_model else None)
    servers = list(rpc or []) + [r for r in s.rpc if r not in (rpc or [])]
    return cfg, [r for r in servers if r not in LOST_RPC]


def states_dir(store: Store) -> Path:
    """Where the model's memory of chats is kept: the data folder's states/."""
    return Path(store.folder) / "states"


def readable_model_name(path: str, header_name: str = "") -> str:
    """The name people know a model by: its file's name less the quantisation and extension
    ("SmolLM2-135M-Instruct" for SmolLM2-135M-Instruct.Q4_1.gguf; the header's general.name
    reads "Smollm2 135M 8k Lc100K Mix1 Ep2"); the header's name when the file says nothing."""
    import re

    stem = Path(path).name
    stem = re.sub(r"\.gguf$", "", stem, flags=re.I)
    stem = re.sub(r"[.\-_](?:I?Q\d[\w]*|F16|F32|BF16|MXFP4\w*)$", "", stem, flags=re.I)
    return stem or header_name or Path(path).name


def remember_model(store: Store, model: str, mmproj: str) -> None:
    """The model and projector the next start opens: called once they have loaded."""
    store.settings.set("model", model)
    store.settings.set("mmproj", mmproj)


def phase_tuning(s: Settings) -> PhaseTuning | None:
    """The per-phase choice from the settings: only when the two phases' layer counts differ
    and autotune measured prompts at both (a move is priced from those measurements)."""
    gen, prompt, image = s.gpu_layers, s.prompt_layers, s.image_layers
    speeds = {int(k): float(v) for k, v in s.prompt_speeds.items()}
    images = {int(k): float(v) for k, v in s.image_speeds.items()}
    if image < 0 or gen not in images or image not in images:
        image = -1
    text = prompt >= 0 and gen != prompt and gen in speeds and prompt in speeds
    if gen < 0 or not (text or (image >= 0 and image != gen)):
        return None
    if not text:  # images alone move: text prompts stay at generation's placement
        prompt = gen
    return PhaseTuning(gen, prompt, s.threads, s.threads_batch,
                       speeds.get(gen, 1.0), speeds.get(prompt, 1.0), image,
                       images.get(gen, 0.0), images.get(image, 0.0))


def phase_settings(result: TuneResult) -> dict[str, Any]:
    """The settings that use autotune's result: each phase's layers and threads, and the prompt
    speeds it measured (at the prompt's best thread count) for pricing a move."""
    image = result.best_image_layers
    return {"gpu_layers": result.best_gen_layers, "prompt_layers": result.best_prompt_layers,
            "threads": result.best_gen_threads, "threads_batch": result.best_prompt_threads,
            "prompt_speeds": {str(k): v for k, v in result.prompt_speeds().items()},
            "image_layers": image if image is not None else -1,
            "image_speeds": {str(k): v for k, v in result.prompt_speeds("image").items()},
            # flash attention as measured on this device, when Tune chose it
            **({"flash_attn": result.flash_attn.on} if result.flash_attn else {})}


def resolve_model(cfg: SessionConfig) -> tuple[SessionConfig, ModelFiles]:
    """Worker thread: fetch the default model and make the demo projector if asked (slow the
    first time, so never on the GUI thread); a context longer than the model was trained for
    is cut to the model's (the setting is one number for every model). With the configuration,
    the files' headers, read once: the load or Tune that follows is given them."""
    from engine.gguf.info import model_info, read_gguf
    from engine.gguf.model_files import ModelFiles
    from engine.models.default import existing_file, resolve_model_path
    from engine.synth.demo import default_projector_path

    model = resolve_model_path(str(cfg.model_path))
    info = model_info(read_gguf(model))
    proj = cfg.mmproj_path
    if proj is not None:
        proj = (default_projector_path(model, info=info) if str(proj) == DEMO
                else existing_file(str(proj), "projector"))
    n_ctx = cfg.n_ctx if cfg.n_ctx is None else info.fit_context(cfg.n_ctx)
    return replace(cfg, model_path=model, mmproj_path=proj, n_ctx=n_ctx), ModelFiles.read(model, proj, info)


# what a loaded session does not depend on: changed, they need no reload
NO_RELOAD = {"max_tokens", "server", "server_host", "server_port", "server_api_key", "model_folders",
             "system_prompt", "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed",
             "json_replies",
             "hub_endpoint", "hub_token", "hub_images", "memory_disk"}


def reload_changes(before: Settings, after: Settings) -> str:
    """The settings that changed and need the model loaded again ("ctx 4096 → 8192, ..."), or
    "" when none does."""
    b, a = before.to_dict(), after.to_dict()
    out = [f"{k} {b[k]!r} → {a[k]!r}".replace("'", "")
           for k in a if k not in NO_RELOAD and b[k] != a[k]]
    return ", ".join(out)
