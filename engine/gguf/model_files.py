"""A model resolved once: its file and parsed header, and its projector's (checked to match).
What a load, a Tune, the planner and the demo projector read instead of the files, so one
request reads each header once and passes the result down."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.gguf.info import (
    ModelInfo,
    ProjectorInfo,
    SoundRefused,
    check_projector_matches,
    model_info,
    projector_info,
    read_gguf,
)


@dataclass(frozen=True)
class ModelFiles:
    model_path: Path
    info: ModelInfo
    mmproj_path: Path | None = None  # the projector given, if any
    proj: ProjectorInfo | None = None  # its header; None when none is given or it is refused
    # why the projector given is not used (sound this llama.cpp cannot encode): the model then
    # runs for text, and the window, the CLI and the endpoint say so
    projector_refused: str = ""

    @classmethod
    def read(cls, model_path: Path, mmproj_path: Path | None = None,
             info: ModelInfo | None = None) -> ModelFiles:
        """The headers of both files (`info`: the model's, when already read). EbbError when
        either is not a readable GGUF, or the projector is for another model."""
        info = info or model_info(read_gguf(model_path))
        if mmproj_path is None:
            return cls(model_path, info)
        try:
            proj = projector_info(read_gguf(mmproj_path))
        except SoundRefused as exc:
            return cls(model_path, info, mmproj_path,
                       projector_refused=f"{exc.what}: sound is off, the model answers text")
        check_projector_matches(info, proj)
        return cls(model_path, info, mmproj_path, proj)

    @classmethod
    def of(cls, model_path: Path, mmproj_path: Path | None, known: ModelFiles | None) -> ModelFiles:
        """`known` when it names these files (a caller read them), else read now."""
        if known is not None and (known.model_path, known.mmproj_path) == (model_path, mmproj_path):
            return known
        return cls.read(model_path, mmproj_path)
