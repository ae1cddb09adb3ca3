"""A session's conversation bookkeeping, in process, on the CPU: saved images, counts, and the
small fixes found while splitting the session into owners."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from engine.config import SessionConfig
from engine.llama.sampling import GenParams
from engine.session import Session
from tests.helpers import N_THREADS

GP = GenParams(max_tokens=4, temperature=0)


@pytest.fixture
def cpu_session(model_path, tiny_projector):
    with Session(SessionConfig(model_path, tiny_projector, n_ctx=1024, n_threads=N_THREADS,
                               vision="cpu", accel="CPU")) as s:
        yield s


def _count_image_opens(monkeypatch) -> list[str]:
    from PIL import Image

    opened: list[str] = []
    real_open = Image.open

    def counting_open(fp, *args, **kwargs):
        opened.append(str(fp))
        return real_open(fp, *args, **kwargs)

    monkeypatch.setattr(Image, "open", counting_open)
    return opened


def test_saved_images_are_hashed_when_reopened_and_decoded_once_when_needed(
        cpu_session, pictures, monkeypatch):
    s = cpu_session
    opened = _count_image_opens(monkeypatch)
    s.set_history([("user", "Look at this.", [pictures["a.png"]]), ("assistant", "Noted.", [])])
    assert opened == []  # reopening a conversation decodes nothing
    first = s.turn("What did I show you?", [], GP)
    assert first.error is None and first.strategy == "cpu"
    assert len(opened) == 1  # the history image, once, when the turn's plan encodes it
    # the message had no image: the history image encoded with it is not the message's
    assert (first.n_images, first.n_images_encoded, first.n_images_cached) == (0, 0, 0)
    second = s.turn("And this one?", [pictures["b.jpg"], pictures["a.png"]], GP)
    assert (second.n_images, second.n_images_encoded, second.n_images_cached) == (2, 1, 1)


def test_a_saved_image_that_can_no_longer_be_read_leaves_the_conversation(
        cpu_session, pictures, tmp_path):
    s = cpu_session
    saved = tmp_path / "saved.png"
    saved.write_bytes(pictures["a.png"].read_bytes())
    s.set_history([("user", "Look at this.", [saved]), ("assistant", "Noted.", [])])
    saved.write_bytes(b"damaged since")
    res = s.turn("What is the capital of France? Answer in one word.", [], GP)
    assert res.error is None and res.text and res.strategy == "none"
    assert s.history[0].image_keys == ()  # its place in the prompt went with it


def test_the_window_cuts_the_context_setting_to_what_the_model_was_trained_for(tmp_path, model_path,
                                                                             monkeypatch):
    """And resolves the model once: the load it is given to asks for no header again (#55)."""
    from app.core.settings import resolve_model
    from engine.gguf import kept_headers
    from engine.synth.model_gen import ModelShape, write_model

    short = write_model(tmp_path / "short.gguf", ModelShape(n_layers=2, n_embd=64, n_ff=128,
                                                            n_head=2, n_head_kv=2,
                                                            n_ctx_train=2048), model_path)
    cfg, files = resolve_model(SessionConfig(short, n_ctx=4096, n_threads=N_THREADS, accel="CPU"))
    assert cfg.n_ctx == 2048 and files.info.n_ctx_train == 2048
    asked: list[Path] = []
    version_of = kept_headers.version_of
    monkeypatch.setattr(kept_headers, "version_of", lambda p: asked.append(p) or version_of(p))
    with Session(cfg, files=files) as s:  # loads, as the window would
        assert s.n_ctx == 2048 and s.info is files.info
    assert asked == []
    assert resolve_model(SessionConfig(short, n_ctx=1024))[0].n_ctx == 1024


def test_bench_run_without_pictures_returns_its_text(shared_rpc_server, model_path, base_projector):
    from engine.llama.devices import connect_rpc
    from engine.measure.swap_bench import _run

    connect_rpc(shared_rpc_server.endpoint)
    cfg = SessionConfig(model_path, base_projector, n_ctx=1024, n_threads=N_THREADS,
                        rpc=(shared_rpc_server.endpoint,))
    out = _run(cfg, "reload", [])
    assert len(out["texts"]) == 1 and out["swaps_s"] == [] and out["bytes_moved"] == 0


def test_nvml_is_initialised_once_and_shut_down_at_exit(monkeypatch):
    from engine.llama import devices

    calls: list[str] = []

    class NVMLError(Exception):
        pass

    class Memory:
        used, total = 3 * 2**30, 8 * 2**30

    fake = types.SimpleNamespace(
        NVMLError=NVMLError,
        nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: 1, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=lambda h: Memory(), nvmlDeviceGetName=lambda h: b"Fake GPU",
        nvmlDeviceGetComputeRunningProcesses=lambda h: [])
    at_exit: list[object] = []
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(devices, "_nvml_state", {})
    monkeypatch.setattr(devices.atexit, "register", lambda fn, *a: at_exit.append((fn, a)))
    first, second = devices.nvml_readings(), devices.nvml_readings()
    assert first == second and first is not None and first[0].name == "Fake GPU"
    assert calls == ["init"] and len(at_exit) == 1
    fn, args = at_exit[0]
    fn(*args)
    assert calls == ["init", "shutdown"]


def test_no_nvml_library_means_not_available(monkeypatch):
    from engine.llama import devices

    class NVMLError(Exception):
        pass

    def no_driver() -> None:
        raise NVMLError("Driver Not Loaded")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(NVMLError=NVMLError,
                                                                     nvmlInit=no_driver))
    monkeypatch.setattr(devices, "_nvml_state", {})
    assert devices.nvml_readings() is None and devices.reported_used_bytes("CUDA0") is None


def test_each_phase_gets_its_threads_from_one_rule():
    from engine.config import SessionConfig, Threads, thread_plan

    m = Path("m.gguf")
    assert thread_plan(SessionConfig(m), 8) == Threads(gen=8, prompt=8, encode=8)
    # autotune chose 1 generation thread and 4 for prompts: the encoder takes the prompt's
    assert thread_plan(SessionConfig(m, n_threads=1, n_threads_batch=4), 8) == Threads(1, 4, 4)
    assert thread_plan(SessionConfig(m, n_threads=2), 8) == Threads(2, 2, 2)
