"""Shared fixtures: the real SmolLM2 model, generated projectors, a loaded runtime."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# As the window does (app/main.py, pyqtgraph's GarbageCollector): no automatic cyclic collection,
# which runs on whichever thread allocates. The suite died with SIGSEGV (its crash file: the GUI
# thread in QListWidget.clear() with the GIL let go, the engine thread allocating in kind_of):
# a collection there can free Qt wrappers made on the GUI thread while Qt deletes their items.
# Each test's end collects on this, the GUI, thread (close_windows below).
import gc  # noqa: E402

gc.disable()
# this machine's calibration (ebb-engine calibrate) would change the sessions' choices: tests
# start from none, and the calibration test writes its own
import tempfile  # noqa: E402

os.environ["EBB_CALIBRATION"] = str(Path(tempfile.mkdtemp(prefix="ebb-cal-")) / "calibration.json")
# the first-decode sentinels and safe-mode records (engine/llama/native.py) of the suite's own
# processes stay out of the user's cache
os.environ["EBB_NATIVE_DIR"] = tempfile.mkdtemp(prefix="ebb-native-")
# what the engine keeps in the data folder (conversation states) stays out of the user's
os.environ.setdefault("EBB_DATA_DIR", tempfile.mkdtemp(prefix="ebb-data-"))

from engine.models.default import fetch_default_model  # noqa: E402
from tests.helpers import N_THREADS, RpcServer, close_open_windows, fresh_store  # noqa: E402

# The suite's own cache (the self-test references, tuning results, ...) stays out of the user's
# ~/.cache/ebb; the models folder is the user's (linked), so nothing is fetched twice.
if not os.environ.get("EBB_TEST_KEEP_CACHE"):
    _user_models = fetch_default_model().parent
    _suite_cache = Path(tempfile.mkdtemp(prefix="ebb-cache-"))
    (_suite_cache / "models").symlink_to(_user_models, target_is_directory=True)
    os.environ["EBB_CACHE_DIR"] = str(_suite_cache)

@pytest.fixture(scope="session")
def model_path() -> Path:
    return fetch_default_model()


@pytest.fixture(scope="session")
def projector_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("projectors")


@pytest.fixture(scope="session")
def tiny_projector(model_path: Path, projector_dir: Path) -> Path:
    from engine.synth.projector_gen import write_projector

    return write_projector(projector_dir / "tiny.gguf", 576, size="tiny", seed=1)


@pytest.fixture(scope="session")
def text_runtime(model_path: Path):
    from engine.llama.loaded_model import LoadParams
    from engine.llama.runtime import TextRuntime

    rt = TextRuntime(LoadParams(model_path, n_ctx=2048, n_threads=N_THREADS))
    yield rt
    rt.close()


@pytest.fixture
def rpc_server():
    server = RpcServer()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def colour_projector(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's colour projector for the small model: it names a picture's colour."""
    from engine.synth.projector_gen import write_colour_projector

    return write_colour_projector(tmp_path_factory.mktemp("colour") / "colour.gguf", model_path)


@pytest.fixture(scope="session")
def base_projector(projector_dir: Path) -> Path:
    from engine.synth.projector_gen import write_projector

    return write_projector(projector_dir / "base.gguf", 576, size="base", seed=0)


@pytest.fixture(scope="session")
def pictures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import numpy as np
    from PIL import Image

    d = tmp_path_factory.mktemp("pictures")
    out = {}
    for i, (name, shape) in enumerate((("a.png", (200, 300, 3)), ("b.jpg", (300, 200, 3)))):
        arr = (np.random.default_rng(i).random(shape) * 255).astype(np.uint8)
        Image.fromarray(arr).save(d / name)
        out[name] = d / name
    return out


@pytest.fixture(scope="session")
def shared_rpc_server():
    """One RPC server for in-process users: a device registered in this process stays
    registered, so its server must outlive every test."""
    server = RpcServer()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def close_windows():
    """Close every window a test opened, pass or fail, then collect what they leave on this
    (the GUI) thread. pytest-qt keeps only weak references: a window collected while its engine
    thread runs would abort the process, and one left to the cyclic collector could be freed on
    another test's engine thread, destroying Qt widgets off the GUI thread (a deadlock seen in
    CI)."""
    yield
    if "PySide6.QtWidgets" in sys.modules:
        close_open_windows()
        gc.collect()
    else:
        gc.collect(1)  # the young generations: automatic collection is off


@pytest.fixture
def store(tmp_path):
    """A fresh data folder's store with a small context and the suite's thread count."""
    s = fresh_store(tmp_path)
    yield s
    s.close()
