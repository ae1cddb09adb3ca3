"""Shared fixtures: the real SmolLM2 model, generated projectors, a loaded runtime."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from engine.models import fetch_default_model  # noqa: E402

N_THREADS = 2  # ggml spins: never more threads than the CI machine's cores


@pytest.fixture(scope="session")
def model_path() -> Path:
    return fetch_default_model()


@pytest.fixture(scope="session")
def projector_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("projectors")


@pytest.fixture(scope="session")
def tiny_projector(model_path: Path, projector_dir: Path) -> Path:
    from engine.projector_gen import write_projector

    return write_projector(projector_dir / "tiny.gguf", 576, size="tiny", seed=1)


@pytest.fixture(scope="session")
def text_runtime(model_path: Path):
    from engine.runtime import LoadParams, TextRuntime

    rt = TextRuntime(LoadParams(model_path, n_ctx=2048, n_threads=N_THREADS))
    yield rt
    rt.close()


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `python -m engine ARGS` as a user would; returns the finished process."""
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True,
                          text=True, timeout=timeout)
