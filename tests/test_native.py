"""The native layer must not take the user's process down (#25): no AMX code in what Ebb
builds, setup's smoke test with its fallback to safe mode, and the window's word after a crash.

The crashes here are real: a child process killed by SIGSEGV at its first decode (the
EBB_TEST_NATIVE_CRASH hook in engine/llama/native.py), as a bad build would kill it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "packaging"))
import bootstrap  # noqa: E402

from engine.llama import native  # noqa: E402
from tests.helpers import N_THREADS  # noqa: E402

AMX_SOURCE = """
#include <immintrin.h>
/* ggml-cpu/amx/mmq.cpp compiles its kernels only under this guard */
#if defined(__AMX_INT8__) && defined(__AVX512VNNI__)
void tile_kernel(const void *cfg, const void *a, void *c) {
    _tile_loadconfig(cfg);
    _tile_loadd(0, a, 64);
    _tile_loadd(1, a, 64);
    _tile_dpbssd(2, 0, 1);
    _tile_stored(2, c, 64);
    _tile_release();
}
#endif
int plain(int x) { return x + 1; }
"""


def _compile(tmp_path: Path, name: str, *flags: str) -> Path:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "amx.c"
    src.write_text(AMX_SOURCE)
    out = tmp_path / name
    res = subprocess.run([cc, "-O2", "-shared", "-fPIC", *flags, str(src), "-o", str(out)],
                         capture_output=True, text=True)
    if res.returncode != 0 and "sapphirerapids" in res.stderr:
        pytest.skip("this compiler does not know Sapphire Rapids")
    assert res.returncode == 0, res.stderr
    return out


@pytest.fixture
def objdump():
    if shutil.which("objdump") is None:
        pytest.skip("no objdump")


def test_ebbs_flags_keep_amx_out_of_a_native_build_for_an_amx_cpu(tmp_path, objdump):
    """-march=native on a Sapphire Rapids means -march=sapphirerapids: without Ebb's flags the
    AMX kernel is compiled in (the control), with them (before or after -march, as CMake puts
    them first) it is not."""
    assert bootstrap.no_amx_args(), "this machine's compiler accepts -mno-amx-*"
    with_amx = _compile(tmp_path, "with.so", "-march=sapphirerapids")
    flags_first = _compile(tmp_path, "first.so", *bootstrap.NO_AMX_FLAGS, "-march=sapphirerapids")
    flags_last = _compile(tmp_path, "last.so", "-march=sapphirerapids", *bootstrap.NO_AMX_FLAGS)
    assert bootstrap.amx_instruction_count(with_amx) >= 5
    assert bootstrap.amx_instruction_count(flags_first) == 0
    assert bootstrap.amx_instruction_count(flags_last) == 0
    key, args, _why = bootstrap.detect_backend(user_settings=False)
    assert key.endswith("noamx") and f"-DCMAKE_C_FLAGS={' '.join(bootstrap.NO_AMX_FLAGS)}" in args


def test_the_installed_llama_cpp_has_no_amx_instructions(objdump):
    """Every library of the llama.cpp this suite runs (the developer wheel setup built)."""
    lib = native.lib_dir()
    assert lib is not None
    libs = [p for p in lib.iterdir() if ".so" in p.name and not p.is_symlink()]
    assert any(p.name.startswith("libggml-cpu") for p in libs)
    found = {p.name: bootstrap.amx_instruction_count(p) for p in libs}
    assert not any(found.values()), found


def test_a_wheel_loses_its_amx_cpu_variant_and_keeps_the_rest(tmp_path, objdump):
    """The portable build's CPU variants: the one with AMX code leaves the wheel (and its RECORD
    line); ggml then picks the next best variant on such a CPU."""
    amx = _compile(tmp_path, "amx.so", "-march=sapphirerapids")
    plain = _compile(tmp_path, "plain.so", "-march=x86-64")
    wheel = tmp_path / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    members = {"llama_cpp/lib/libggml-cpu-sapphirerapids.so": amx.read_bytes(),
               "llama_cpp/lib/libggml-cpu-zen4.so": plain.read_bytes(),
               "llama_cpp/lib/libllama.so": plain.read_bytes(),
               "llama_cpp/__init__.py": b"__version__ = '0.3.36'\n"}
    record = "".join(f"{n},sha256=x,1\n" for n in members) + "llama_cpp_python-0.3.36.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr("llama_cpp_python-0.3.36.dist-info/RECORD", record)
    dropped = bootstrap.drop_amx_modules(wheel)
    assert dropped == ["llama_cpp/lib/libggml-cpu-sapphirerapids.so"]
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        new_record = zf.read("llama_cpp_python-0.3.36.dist-info/RECORD").decode()
    assert "llama_cpp/lib/libggml-cpu-sapphirerapids.so" not in names
    assert {"llama_cpp/lib/libggml-cpu-zen4.so", "llama_cpp/lib/libllama.so"} <= names
    assert "sapphirerapids" not in new_record and "libggml-cpu-zen4.so" in new_record
    assert bootstrap.drop_amx_modules(wheel) == []  # nothing left to drop


def test_the_amx_buffer_type_is_never_asked_for(monkeypatch, model_path):
    """The load's decision (pure): a CPU with AMX whose build registers the AMX buffer type
    loads without extra buffer types; without AMX, or with a build that has none, CPU_REPACK
    stays. Then the real thing: this build registers no AMX buffer type, and a real load's
    log names none."""
    from engine.llama import ggml
    from engine.llama import log as llama_log
    from engine.llama.loaded_model import LoadedModel, LoadParams

    assert "AMX" not in ggml.cpu_extra_buffer_types()
    monkeypatch.setattr(native, "cpu_has_amx", lambda: True)
    assert native.use_extra_bufts(True, ["AMX", "CPU_REPACK"]) is False
    assert native.use_extra_bufts(True, ["CPU_REPACK"]) is True
    monkeypatch.setattr(native, "cpu_has_amx", lambda: False)
    assert native.use_extra_bufts(True, ["AMX", "CPU_REPACK"]) is True
    assert native.use_extra_bufts(False, ["CPU_REPACK"]) is False
    # a real load follows the rule: as on an AMX CPU whose build registers the AMX buffer type
    # (this build cannot: it is compiled without AMX), the load asks for no extra buffer type
    monkeypatch.setattr(native, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(ggml, "cpu_extra_buffer_types", lambda: ["AMX", "CPU_REPACK"])
    m = LoadedModel(LoadParams(model_path))
    try:
        assert m.extra_bufts is False
    finally:
        m.close()
    monkeypatch.undo()
    m = LoadedModel(LoadParams(model_path))  # this machine as it is: the rule on its own facts
    try:
        assert m.extra_bufts is native.use_extra_bufts(True, ggml.cpu_extra_buffer_types())
        assert not [line for _lvl, line in llama_log.recent(2000) if "AMX" in line]
    finally:
        m.close()


def test_safe_mode_loads_without_extra_buffers_and_hides_gpus(monkeypatch, model_path):
    from engine.llama.loaded_model import LoadedModel, LoadParams

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(native, "_session_safe_mode", "")
    native.set_safe_mode(True, "a test")
    try:
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
        assert native.safe_mode() and native.safe_mode_reason() == "a test"
        m = LoadedModel(LoadParams(model_path))
        assert m.extra_bufts is False
        m.close()
    finally:
        native.set_safe_mode(False)


def _isolated(monkeypatch, tmp_path: Path, model_path: Path) -> Path:
    """A cache of its own (the default model linked in) and records of its own."""
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / model_path.name).symlink_to(model_path)
    monkeypatch.setenv("EBB_CACHE_DIR", str(cache))
    monkeypatch.setenv("EBB_NATIVE_DIR", str(tmp_path / "native"))
    return cache


def test_setup_smoke_test_passes_and_is_remembered(monkeypatch, tmp_path, model_path, capsys):
    cache = _isolated(monkeypatch, tmp_path, model_path)
    assert bootstrap.smoke_test(Path(sys.executable), "cpu-rpc-noamx/test.whl") == "ok"
    assert "decoded a token on this CPU" in capsys.readouterr().out
    assert bootstrap.smoke_test(Path(sys.executable), "cpu-rpc-noamx/test.whl") == "ok"
    assert capsys.readouterr().out == ""  # remembered for this wheel and CPU: not run again
    assert "cpu-rpc-noamx/test.whl|" in (cache / "native-checks.json").read_text()
    assert not native.safe_mode()


@pytest.mark.slow  # 13 s (a crashing check is run for real): make test-slow, which CI runs
def test_setup_says_a_crash_in_one_line_and_falls_back_to_safe_mode(
        monkeypatch, tmp_path, model_path, capsys):
    cache = _isolated(monkeypatch, tmp_path, model_path)
    monkeypatch.setenv(native.CRASH_TEST_ENV, "1")
    assert bootstrap.smoke_test(Path(sys.executable), "cpu-rpc-noamx/test.whl") == "safe"
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "crashed with SIGSEGV on its first decode" in line
    assert native.cpu_name() in line and "cpu-rpc-noamx" in line and "safe mode" in line
    assert str(cache / "wheels") in line  # what to do for a fresh build
    # the engine now runs in safe mode for this build and CPU, and says so
    assert native.safe_mode()
    assert "SIGSEGV" in native.safe_mode_reason()
    assert not list((tmp_path / "native").glob("decoding-*"))  # setup reported it already
    monkeypatch.delenv(native.CRASH_TEST_ENV)
    res = subprocess.run([sys.executable, "-m", "engine", "chat", "--prompt", "Hi", "--max-tokens",
                          "2", "--threads", str(N_THREADS), "--json"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "ebb-engine: note: safe mode" in res.stderr


def test_a_crash_in_safe_mode_too_stops_setup_with_a_clear_message(monkeypatch, tmp_path, model_path):
    _isolated(monkeypatch, tmp_path, model_path)
    monkeypatch.setenv(native.CRASH_TEST_ENV, "always")  # in safe mode too
    with pytest.raises(SystemExit) as exc:
        bootstrap.smoke_test(Path(sys.executable), "cpu-rpc-noamx/test.whl")
    assert "even in safe mode" in str(exc.value) and "ebb-engine about" in str(exc.value)


def test_the_window_after_a_crash_says_so_and_starts_in_safe_mode(
        monkeypatch, qtbot, tmp_path, model_path):
    """A window whose first reply dies by SIGSEGV; the next start shows what happened, does not
    load the model again by itself, and 'Start in safe mode' gets a reply."""
    from app.main import open_window
    from app.core.settings import session_config
    from app.core.store import Store
    from tests.helpers import track_window, wait_for

    data, records = tmp_path / "data", tmp_path / "native"
    monkeypatch.setenv("EBB_NATIVE_DIR", str(records))
    monkeypatch.setenv("EBB_DATA_DIR", str(data))  # the crash file is the data folder's
    monkeypatch.setattr(native, "_session_safe_mode", "")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    s = Store(data)
    s.settings.set("ctx", 1024)
    s.close()
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", EBB_DATA_DIR=str(data),
               EBB_TEST_SEND="Hello", **{native.CRASH_TEST_ENV: "1"})
    first = subprocess.run([sys.executable, "-m", "app", "--threads", str(N_THREADS)],
                           capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == -11, (first.returncode, first.stderr[-2000:])
    store = Store(data)
    cfg, rpc = session_config(store, "default", "")
    try:
        w = open_window(store, cfg, rpc)
        track_window(w)
        qtbot.addWidget(w)
        w.show()
        from PySide6.QtWidgets import QFrame

        banner = w.findChild(QFrame, "crash-banner")
        assert banner is not None and banner.isVisible()
        text = banner.label.text()
        assert "crashed (Segmentation fault)" in text and model_path.name in text
        assert "safe mode" in text.lower()
        assert w.chat.last_cfg is None and not w.chat.loaded  # nothing loads by itself
        banner.buttons["Start in safe mode"].click()
        assert not banner.isVisible()
        wait_for(lambda: w.chat.loaded)
        assert store.settings.get("safe_mode") is True and native.safe_mode()
        w.composer.edit.setPlainText("Hi")
        w.sending.send()
        wait_for(lambda: not w.chat.busy)
        reply = store.messages(w.conv_id)[-1]
        assert reply.role == "assistant" and reply.text.strip()
        w.grab().save(str(tmp_path / "after-crash.png"))
        w.close()
    finally:
        native.set_safe_mode(False)
        store.close()
    assert native.last_crash() is None  # reported once


def test_the_cli_names_a_crash_once_and_offers_safe_mode(monkeypatch, tmp_path):
    """The command line after a native crash: faulthandler said where it died; the next run
    says what happened and how to run safe; once the same run passes, the crash is forgotten."""
    monkeypatch.setenv("EBB_NATIVE_DIR", str(tmp_path / "native"))
    args = [sys.executable, "-m", "engine", "chat", "--prompt", "Hi", "--max-tokens", "2",
            "--threads", str(N_THREADS)]
    died = subprocess.run(args, capture_output=True, text=True,
                          env={**os.environ, native.CRASH_TEST_ENV: "1"})
    assert died.returncode == -11 and "Fatal Python error: Segmentation fault" in died.stderr
    after = subprocess.run(args, capture_output=True, text=True)
    assert after.returncode == 0, after.stderr
    assert "Last time, llama.cpp" in after.stderr and "--safe-mode" in after.stderr
    again = subprocess.run(args, capture_output=True, text=True)
    assert again.returncode == 0 and "Last time" not in again.stderr


TOO_OLD_DRIVER = """
/* a stand-in NVIDIA driver that reports CUDA 12.4 (drivers before 580 cannot run CUDA 13) */
int cuDriverGetVersion(int *v) { *v = 12040; return 0; }
"""


def test_a_driver_too_old_for_the_cuda_build_is_named_with_both_versions(tmp_path):
    """A CUDA build with a driver that is there but older than its runtime finds no GPU; the note
    says which CUDA each has and what to do, not "no usable GPU". (Checked once end to end on
    the CUDA build with this stand-in as libcuda.so.1: `ebb-engine chat` said it and answered.)"""
    import ctypes

    from engine.llama.about import _cuda_version, cuda_no_device_reason

    assert cuda_no_device_reason(12040, 13000) == (
        "the NVIDIA driver supports CUDA 12.4, older than the CUDA 13.0 this build uses "
        "(update the NVIDIA driver)")
    assert cuda_no_device_reason(13010, 13000) == "the NVIDIA driver reports no usable GPU"
    assert cuda_no_device_reason(12080, None) == "the NVIDIA driver reports no usable GPU"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the stand-in driver")
    (tmp_path / "fake.c").write_text(TOO_OLD_DRIVER)
    lib = tmp_path / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "fake.c")], check=True)
    assert _cuda_version(ctypes.CDLL(str(lib)), "cuDriverGetVersion") == 12040
    assert _cuda_version(ctypes.CDLL(str(lib)), "cuNoSuchFunction") is None
    assert _cuda_version(None, "cudaRuntimeGetVersion") is None
