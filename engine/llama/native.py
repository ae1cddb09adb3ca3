"""Keeping llama.cpp's native code from taking the process down, and saying so when it did.

Three parts, all Qt-free and usable before llama_cpp is imported:

- **What runs where.** `build_id()` names the llama.cpp build that is installed (its libraries'
  names and sizes), `cpu_id()` the processor (model name and instruction-set flags). A record is
  kept per (build, CPU) under the cache folder: `native/<build>-<cpu>.json`.
- **Safe mode**: no extra buffer types (ggml's AMX and CPU_REPACK weight layouts) and no GPU
  backend (CUDA devices hidden), i.e. the plainest CPU path llama.cpp has. On when the record
  says so (setup's smoke test found the default path crashing), when EBB_SAFE_MODE=1, or when
  the window was asked for it after a crash. AMX is off even outside safe mode when this CPU
  has AMX and the build registers ggml's AMX buffer type (a build Ebb did not make): its
  mul_mat segfaults (llama.cpp issue #20824).
- **The first-decode guard.** Before a model's first decode on this build and CPU, a sentinel
  names the model and the process; after the decode it is replaced by an "ok" mark. A sentinel
  whose process is gone means that process died in native code: `last_crash()` finds it, so
  the next start of the window can say what happened and offer safe mode instead of crashing
  again.

Which thread: the guard runs on the thread that decodes (the engine's); the rest on any.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from engine import paths, testhooks
from engine.json_file import read_object

SAFE_MODE_ENV = "EBB_SAFE_MODE"
CRASH_TEST_ENV = testhooks.NATIVE_CRASH
_session_safe_mode = ""  # why safe mode is on for this process ("": off); see set_safe_mode


# ------------------------------------------------------------------ identities

@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo; elsewhere, or without a
    model name, what `platform` says (its `processor()` runs `uname -p`: ~7 ms, so only then)."""
    name, flags = "", set[str]()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not name:
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
                if name and flags and key == "":
                    break
    except OSError:
        pass
    if not name:
        import platform

        name = platform.processor() or platform.machine()
    return name, frozenset(flags)


def cpu_name() -> str:
    return _cpuinfo()[0] or "unknown CPU"


def cpu_has_amx() -> bool:
    return bool({"amx_int8", "amx_tile"} & _cpuinfo()[1])


def cpu_id() -> str:
    name, flags = _cpuinfo()
    return hashlib.sha256(f"{name}|{' '.join(sorted(flags))}".encode()).hexdigest()[:12]


def lib_dir() -> Path | None:
    """llama_cpp/lib of the installed llama-cpp-python, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


def build_id(lib: Path | None = None) -> str:
    """Names and sizes of the llama.cpp libraries: another build (or backend) is another id."""
    lib = lib or lib_dir()
    h = hashlib.sha256()
    if lib is not None and lib.is_dir():
        for p in sorted(lib.iterdir()):
            if p.is_file():
                h.update(f"{p.name}:{p.stat().st_size};".encode())
    return h.hexdigest()[:12]


def record_dir() -> Path:
    """Records and sentinels; EBB_NATIVE_DIR moves them (the tests keep theirs apart)."""
    env = os.environ.get("EBB_NATIVE_DIR")
    return Path(env) if env else paths.cache_dir() / "native"


def record_path() -> Path:
    return record_dir() / f"{build_id()}-{cpu_id()}.json"


def _read(path: Path) -> dict[str, object]:
    return read_object(path)


def _write(path: Path, data: dict[str, object]) -> None:
    """Atomically (a crash mid-write leaves the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def read_record() -> dict[str, object]:
    return _read(record_path())


def write_record(**fields: object) -> None:
    """Merge fields into this build's and CPU's record."""
    path = record_path()
    data = _read(path)
    data.update(fields, build=build_id(), cpu=cpu_name(), when=time.time())
    with contextlib.suppress(OSError):
        _write(path, data)


# ------------------------------------------------------------------ safe mode

def set_safe_mode(on: bool, why: str = "chosen after a crash") -> None:
    """For this process (the window's choice after a crash, setup's check). Call it before
    llama_cpp is imported so GPU backends are hidden too."""
    global _session_safe_mode
    _session_safe_mode = why if on else ""
    if on:
        hide_gpus()


def safe_mode() -> bool:
    if _session_safe_mode or os.environ.get(SAFE_MODE_ENV, "") not in ("", "0"):
        return True
    return bool(read_record().get("safe_mode"))


def safe_mode_reason() -> str:
    if _session_safe_mode:
        return _session_safe_mode
    if os.environ.get(SAFE_MODE_ENV, "") not in ("", "0"):
        return f"{SAFE_MODE_ENV} is set"
    return str(read_record().get("safe_mode_reason") or "setup found the default path crashing")


def hide_gpus() -> None:
    """CPU only: CUDA sees no device (must happen before ggml initialises CUDA)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def apply_safe_mode_env() -> bool:
    """At process start: hide GPUs when safe mode is on. Returns whether it is."""
    on = safe_mode()
    if on:
        hide_gpus()
    return on


def use_extra_bufts(wanted: bool, cpu_bufts: list[str]) -> bool:
    """Whether a model load may use ggml's extra buffer types (CPU_REPACK, AMX), given the CPU
    backend's (`ggml.cpu_extra_buffer_types()`). Never in safe mode; never when this CPU has
    AMX and the build registers ggml's AMX buffer type (Ebb's own builds never do: they are
    compiled without AMX; the load API has no switch for AMX alone, so all are left off)."""
    if not wanted or safe_mode():
        return False
    return not (cpu_has_amx() and "AMX" in cpu_bufts)


# ------------------------------------------------------------------ the first-decode guard

@dataclass(frozen=True)
class Crash:
    """A process that died during a model's first decode."""
    model: str
    build: str
    cpu: str
    pid: int
    when: float
    safe_mode: bool
    signal: str  # e.g. "SIGSEGV", or "" when unknown (the window only knows the process ended)

    def describe(self) -> str:
        how = f"crashed ({self.signal})" if self.signal else "ended without a word"
        mode = " in safe mode" if self.safe_mode else ""
        return (f"Last time, llama.cpp {how} during the first reply of {Path(self.model).name}"
                f"{mode} (llama.cpp build {self.build}, {self.cpu}).")


def _sentinel_path(pid: int) -> Path:
    return record_dir() / f"decoding-{pid}.json"


def _ok_key(model: Path, safe: bool) -> str:
    try:
        st = model.stat()
        ident = f"{model.resolve()}:{st.st_size}"
    except OSError:
        ident = str(model)
    return hashlib.sha256(f"{ident}|{safe}".encode()).hexdigest()[:12]


@contextlib.contextmanager
def first_decode(model: Path) -> Iterator[None]:
    """Wrap a model's first decode: leave a sentinel while it runs, mark it ok after. A model
    whose first decode already passed on this build and CPU (in this mode) writes nothing."""
    safe = safe_mode()
    key = _ok_key(model, safe)
    ok = read_record().get("ok")
    if isinstance(ok, list) and key in ok:
        yield
        return
    sentinel: Path | None = _sentinel_path(os.getpid())
    try:
        _write(sentinel, {"model": str(model), "build": build_id(), "cpu": cpu_name(),  # type: ignore[arg-type]
                          "pid": os.getpid(), "when": time.time(), "safe_mode": safe})
    except OSError:  # a read-only cache: decode unguarded
        sentinel = None
    testhooks.crash_at_first_decode(safe)  # test hook: a real native-style death
    try:
        yield
    finally:
        if sentinel is not None:
            with contextlib.suppress(OSError):
                sentinel.unlink()
    ok_now = read_record().get("ok")
    done = [k for k in ok_now if isinstance(k, str)][-200:] if isinstance(ok_now, list) else []
    write_record(ok=[*done, key])
    _forget_crashes(model, safe)  # the same decode in the same mode ran now: not a lasting fault


def _forget_crashes(model: Path, safe: bool) -> None:
    folder = record_dir()
    for path in folder.glob("decoding-*.json") if folder.is_dir() else []:
        data = _read(path)
        pid = int(str(data.get("pid", 0) or 0))
        if (pid and pid != os.getpid() and not _alive(pid) and str(data.get("model")) == str(model)
                and bool(data.get("safe_mode")) == safe):
            with contextlib.suppress(OSError):
                path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fault_signal(pid: int) -> str:
    from engine import crashlog

    return crashlog.fault_of(pid)


def peek_crash() -> Crash | None:
    """The newest crash left by a process that is gone, without forgetting it (the window
    reports it and then forgets it)."""
    folder = record_dir()
    found = []
    for path in folder.glob("decoding-*.json") if folder.is_dir() else []:
        data = _read(path)
        pid = int(str(data.get("pid", 0) or 0))
        if pid and pid != os.getpid() and not _alive(pid):
            found.append(Crash(str(data.get("model", "")), str(data.get("build", "")),
                               str(data.get("cpu", "")), pid, float(str(data.get("when", 0.0) or 0.0)),
                               bool(data.get("safe_mode")), ""))
    return max(found, key=lambda c: c.when) if found else None


def last_crash() -> Crash | None:
    """The newest sentinel left by a process that is gone (and forget it: it is reported once)."""
    folder = record_dir()
    found: list[Crash] = []
    for path in folder.glob("decoding-*.json") if folder.is_dir() else []:
        data = _read(path)
        pid = int(str(data.get("pid", 0) or 0))
        if not pid or pid == os.getpid() or _alive(pid):
            continue
        found.append(Crash(str(data.get("model", "")), str(data.get("build", "")),
                           str(data.get("cpu", "")), pid, float(str(data.get("when", 0.0) or 0.0)),
                           bool(data.get("safe_mode")), _fault_signal(pid)))
        with contextlib.suppress(OSError):
            path.unlink()
    return max(found, key=lambda c: c.when) if found else None
