"""Vision-language families: which projector (mmproj) belongs with which language model.

Pure data from llama.cpp's mtmd (tools/mtmd/clip-impl.h, mtmd.cpp): the `clip.projector_type`
names, and the language-model architectures each projector family is made for. A pair from
different families decodes images at the wrong positions or with the wrong wrappers, so Ebb
refuses it before loading anything.
"""
from __future__ import annotations

# the families Ebb's generators offer and test (engine/synth/projector_gen.py, model_gen.py).
# projector_gen can also write "pixtral", but it is left out: after llama.cpp runs that
# projector's graph, the process (or the RPC server) that ran it gives empty replies from then
# on, not every time: an open memory fault, see docs/media.md, "Known problem"
GENERATED = ("mlp", "gemma3", "idefics3", "qwen2.5vl", "internvl")

# clip.projector_type -> family name shown to people
PROJECTOR_FAMILY: dict[str, str] = {
    "mlp": "llava", "mlp_norm": "llava", "ldp": "llava", "ldpv2": "llava",
    "resampler": "minicpm-v", "minicpmv4_6": "minicpm-v",
    "qwen2vl_merger": "qwen2-vl", "qwen2.5vl_merger": "qwen2.5-vl", "qwen3vl_merger": "qwen3-vl",
    "gemma3": "gemma3", "gemma3nv": "gemma3n", "gemma4v": "gemma4", "gemma4uv": "gemma4",
    "idefics3": "idefics3", "pixtral": "pixtral", "lightonocr": "pixtral",
    "internvl": "internvl", "llama4": "llama4", "lfm2": "lfm2-vl", "kimivl": "kimi-vl",
    "glm4v": "glm4v", "cogvlm": "cogvlm", "phi4": "phi4-mm",
    # audio encoders (whisper-like), and the omni projectors with both encoders
    "ultravox": "ultravox", "qwen2a": "qwen2-audio", "voxtral": "voxtral", "qwen3a": "qwen3-omni",
    "qwen2.5o": "qwen2.5-omni", "qwen3vl_merger+qwen3a": "qwen3-omni",
}

# the audio families Ebb's generator writes and tests (engine/synth/projector_gen.py); the
# omni one ("qwen2.5o") has a vision encoder too
GENERATED_AUDIO = ("ultravox", "qwen2a", "qwen2.5o")

# family -> language-model architectures it is made for (None: any, e.g. LLaVA's MLP adapter
# was trained onto many models)
FAMILY_ARCHS: dict[str, frozenset[str] | None] = {
    "llava": None,
    "minicpm-v": frozenset({"qwen2", "qwen3", "llama", "minicpm"}),
    "qwen2-vl": frozenset({"qwen2vl"}),
    "qwen2.5-vl": frozenset({"qwen2vl"}),
    "qwen3-vl": frozenset({"qwen3vl", "qwen3vlmoe"}),
    "gemma3": frozenset({"gemma3"}),
    "gemma3n": frozenset({"gemma3n"}),
    "gemma4": frozenset({"gemma4"}),
    "idefics3": frozenset({"llama"}),
    "pixtral": frozenset({"llama", "mistral3"}),
    "internvl": frozenset({"qwen2", "qwen3", "qwen3moe", "llama", "internlm2", "gpt-oss"}),
    "llama4": frozenset({"llama4"}),
    "lfm2-vl": frozenset({"lfm2"}),
    "kimi-vl": frozenset({"deepseek2"}),
    "glm4v": frozenset({"glm4", "glm4moe"}),
    "cogvlm": frozenset({"cogvlm"}),
    "phi4-mm": frozenset({"phi3"}),
    "ultravox": None,  # trained onto Llama 3.x, Gemma 3 and Qwen 3 models alike
    "qwen2-audio": frozenset({"qwen2"}),
    "voxtral": frozenset({"llama"}),
    "qwen2.5-omni": frozenset({"qwen2vl"}),
    "qwen3-omni": frozenset({"qwen3moe", "qwen3vlmoe"}),
}

# language-model architectures whose positions are M-RoPE: only a projector of a family made
# for them lays its images out in those positions
MROPE_ARCHS = frozenset({"qwen2vl", "qwen3vl", "qwen3vlmoe", "glm4v", "paddleocr"})


def projector_family(projector_type: str) -> str:
    return PROJECTOR_FAMILY.get(projector_type, projector_type or "unknown")


def pairing_problem(model_arch: str, projector_type: str) -> str | None:
    """Why a language model of `model_arch` cannot take this projector, or None."""
    family = projector_family(projector_type)
    archs = FAMILY_ARCHS.get(family)
    if archs is not None and model_arch not in archs:
        return (f"a {family} projector belongs to a {' or '.join(sorted(archs))} language model, "
                f"not a {model_arch} one")
    if archs is None and model_arch in MROPE_ARCHS:
        return (f"a {model_arch} language model places images with M-RoPE positions; a {family} "
                "projector does not")
    return None
