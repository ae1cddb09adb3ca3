"""Shared fixtures: the real SmolLM2 model, generated projectors, a loaded runtime."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# this machine's calibration (ebb-engine calibrate) would change the sessions' choices: tests
# start from none, and the calibration test writes its own
import tempfile  # noqa: E402

os.environ["EBB_CALIBRATION"] = str(Path(tempfile.mkdtemp(prefix="ebb-cal-")) / "calibration.json")
# the first-decode sentinels and safe-mode records (engine/llama/native.py) of the suite's own
# processes stay out of the user's cache
os.environ["EBB_NATIVE_DIR"] = tempfile.mkdtemp(prefix="ebb-native-")

from engine.gguf.models import fetch_default_model  # noqa: E402

# The suite's own cache (the self-test references, tuning results, ...) stays out of the user's
# ~/.cache/ebb; the models folder is the user's (linked), so nothing is fetched twice.
if not os.environ.get("EBB_TEST_KEEP_CACHE"):
    _user_models = fetch_default_model().parent
    _suite_cache = Path(tempfile.mkdtemp(prefix="ebb-cache-"))
    (_suite_cache / "models").symlink_to(_user_models, target_is_directory=True)
    os.environ["EBB_CACHE_DIR"] = str(_suite_cache)

N_THREADS = 2  # ggml spins: never more threads than the CI machine's cores


@pytest.fixture(scope="session")
def model_path() -> Path:
    return fetch_default_model()


@pytest.fixture(scope="session")
def projector_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("projectors")


@pytest.fixture(scope="session")
def tiny_projector(model_path: Path, projector_dir: Path) -> Path:
    from engine.gguf.projector_gen import write_projector

    return write_projector(projector_dir / "tiny.gguf", 576, size="tiny", seed=1)


@pytest.fixture(scope="session")
def text_runtime(model_path: Path):
    from engine.llama.runtime import LoadParams, TextRuntime

    rt = TextRuntime(LoadParams(model_path, n_ctx=2048, n_threads=N_THREADS))
    yield rt
    rt.close()


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `python -m engine ARGS` as a user would; returns the finished process."""
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True,
                          text=True, timeout=timeout)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RpcServer:
    """`ebb-engine rpc-serve` on loopback in its own process: the stand-in accelerator."""

    def __init__(self, *extra: str, host: str = "127.0.0.1", prefix: tuple[str, ...] = (),
                 ready_line: str | None = None) -> None:
        import socket
        import time

        self.port = free_port()
        self.endpoint = f"{host}:{self.port}"
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "engine", "rpc-serve", "--host", host, "--port",
             str(self.port), "--threads", str(N_THREADS), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        if ready_line is not None:  # e.g. after warming its cache
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.output.append(line)
                if ready_line in line:
                    return
            raise RuntimeError("rpc-serve ended early:\n" + "".join(self.output))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection((host, self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("rpc-serve did not start")

    def _status(self, key: str) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    def rss_bytes(self) -> int:
        return self._status("VmRSS")

    def reset_peak(self) -> None:
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")

    def peak_rss_bytes(self) -> int:
        return self._status("VmHWM")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture
def rpc_server():
    server = RpcServer()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def base_projector(projector_dir: Path) -> Path:
    from engine.gguf.projector_gen import write_projector

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
    import gc

    yield
    test_app = sys.modules.get("tests.test_app")
    if test_app is not None:
        test_app.close_open_windows()
        gc.collect()
