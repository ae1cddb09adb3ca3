#!/usr/bin/env python3
"""One-command setup for Ebb: venv, llama-cpp-python (cached wheel), deps, Qt libs, model.

Run by `make run` / `make test` with the system Python (stdlib only). Idempotent: when
everything is in place it finishes in about a second.

The llama-cpp-python wheel is built once per (version, backend, Python, platform) and kept
in a cache folder outside the repository, so a new clone on the same machine installs it in
seconds. pip's own wheel cache ignores CMAKE_ARGS, so it is not relied on.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Iterator

LLAMA_CPP_VERSION = "0.3.36"
ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
STAMP = VENV / ".ebb-setup.json"

# Debian/Ubuntu package -> shared library Qt's xcb platform plugin needs.
XCB_PACKAGES = {
    "libxcb-icccm4": "libxcb-icccm.so.4",
    "libxcb-keysyms1": "libxcb-keysyms.so.1",
    "libxcb-cursor0": "libxcb-cursor.so.0",
    "libxcb-image0": "libxcb-image.so.0",
    "libxcb-render-util0": "libxcb-render-util.so.0",
    "libxcb-xkb1": "libxcb-xkb.so.1",
    "libxkbcommon-x11-0": "libxkbcommon-x11.so.0",
    "libxcb-shape0": "libxcb-shape.so.0",
    "libxcb-randr0": "libxcb-randr.so.0",
}


def say(msg: str) -> None:
    print(f"[ebb setup] {msg}", flush=True)


def cache_root() -> Path:
    """Same folder as platformdirs.user_cache_dir('ebb') (the engine keeps models there)."""
    if os.environ.get("EBB_CACHE_DIR"):
        return Path(os.environ["EBB_CACHE_DIR"])
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "ebb"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ebb"


# ---------------------------------------------------------------- backend detection

def _nvcc_works() -> bool:
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cu"
        src.write_text("__global__ void k(){}\nint main(){k<<<1,1>>>();return 0;}\n")
        try:
            res = subprocess.run([nvcc, str(src), "-o", str(Path(tmp) / "probe")],
                                 capture_output=True, timeout=180)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return res.returncode == 0


def _nvidia_driver_present() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            if subprocess.run([smi, "-L"], capture_output=True, timeout=30).returncode == 0:
                return True
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except OSError:
        return False
    return "libcuda.so.1" in out


# A bundle's llama.cpp runs on any x86-64 CPU of the last decade: no -march=native; ggml's CPU
# backend is built once per instruction-set level as loadable modules and the best one for the
# running CPU is picked at start (ggml_backend_load_all_from_path, engine/llama/ggml.py). The
# modules are installed beside the other libraries (CMAKE_INSTALL_BINDIR), where the engine
# looks for them.
PORTABLE_ARGS = ["-DGGML_NATIVE=OFF", "-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON",
                 "-DCMAKE_INSTALL_BINDIR=llama_cpp/lib"]


def detect_portable_backend() -> tuple[str, list[str], str]:
    """The bundle's build: the machine's backend (CUDA or CPU) with RPC, without native-only code.

    Cached under its own key ("...-portable"), beside the developer build, which keeps its
    native speed."""
    key, args, why = detect_backend(user_settings=False)
    if key == "metal-rpc":
        return "metal-rpc-portable", [*args, "-DGGML_NATIVE=OFF"], why
    return f"{key}-portable", [*args, *PORTABLE_ARGS], why


def detect_backend(user_settings: bool = True) -> tuple[str, list[str], str]:
    """Return (cache key, cmake args, why). User CMAKE_ARGS / GGML_* env vars win."""
    user_args = os.environ.get("CMAKE_ARGS", "").split() if user_settings else []
    user_args += [f"-D{k}={v}" for k, v in sorted(os.environ.items())
                  if user_settings and k.startswith("GGML_") and k != "GGML_NTHREADS"]
    if user_args:
        if not any("GGML_RPC" in a for a in user_args):
            user_args.append("-DGGML_RPC=on")
        digest = hashlib.sha256(" ".join(user_args).encode()).hexdigest()[:10]
        return f"custom-{digest}", user_args, "your CMAKE_ARGS/GGML_* settings"
    if sys.platform == "darwin":
        return "metal-rpc", ["-DGGML_METAL=on", "-DGGML_RPC=on"], "macOS"
    why = "no nvcc found"
    if shutil.which("nvcc"):
        if not _nvidia_driver_present():
            why = ("nvcc found but no NVIDIA driver, so a CUDA build could not run here; "
                   "set CMAKE_ARGS=-DGGML_CUDA=on to force one")
        elif _nvcc_works():
            return "cuda-rpc", ["-DGGML_CUDA=on", "-DGGML_RPC=on"], "nvcc works and an NVIDIA driver is present"
        else:
            why = "nvcc found but it cannot compile a test program"
    return "cpu-rpc", ["-DGGML_RPC=on"], why


# ---------------------------------------------------------------- llama-cpp-python wheel

def wheel_dir(backend: str) -> Path:
    py_tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    return cache_root() / "wheels" / f"llama-cpp-python-{LLAMA_CPP_VERSION}-{backend}-{py_tag}-{plat}"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        try:
            import fcntl
            fcntl.flock(fh, fcntl.LOCK_EX)
        except ImportError:  # Windows: no concurrent-build protection
            pass
        yield


def _progress_line(done: int, total: int, started: float) -> str:
    width = 30
    filled = int(width * done / max(total, 1))
    elapsed = int(time.monotonic() - started)
    return (f"building llama.cpp [{'#' * filled}{'.' * (width - filled)}] "
            f"{done}/{total} steps, {elapsed // 60}m{elapsed % 60:02d}s")


def build_wheel(backend: str, cmake_args: list[str], out_dir: Path) -> Path:
    """Build llama-cpp-python from its sdist, showing progress; return the wheel path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "build.log"
    env = dict(os.environ, CMAKE_ARGS=" ".join(cmake_args))
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    tmp_out = Path(tempfile.mkdtemp(prefix="ebb-wheel-"))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-v", "--no-binary", "llama-cpp-python",
           "-w", str(tmp_out), f"llama-cpp-python=={LLAMA_CPP_VERSION}"]
    say(f"building llama-cpp-python {LLAMA_CPP_VERSION} ({backend}: {' '.join(cmake_args)}); "
        f"this takes several minutes once, log: {log_path}")
    started = time.monotonic()
    tty = sys.stdout.isatty()
    last_decile = -1
    step_re = re.compile(r"\[\s*(\d+)/(\d+)\]")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            m = step_re.search(line)
            if not m:
                continue
            done, total = int(m.group(1)), int(m.group(2))
            if tty:
                print("\r" + _progress_line(done, total, started), end="", flush=True)
            elif done * 10 // total > last_decile:
                last_decile = done * 10 // total
                say(_progress_line(done, total, started))
        rc = proc.wait()
    if tty:
        print()
    wheels = list(tmp_out.glob("llama_cpp_python-*.whl"))
    if rc != 0 or not wheels:
        tail = log_path.read_text(errors="replace").splitlines()[-30:]
        print("\n".join(tail), file=sys.stderr)
        raise SystemExit(f"[ebb setup] llama-cpp-python build failed (exit {rc}); full log: {log_path}")
    final = out_dir / wheels[0].name
    shutil.move(str(wheels[0]), final)
    shutil.rmtree(tmp_out, ignore_errors=True)
    (out_dir / "build-info.json").write_text(json.dumps(
        {"cmake_args": cmake_args, "build_s": round(time.monotonic() - started, 1)}, indent=1))
    say(f"built in {time.monotonic() - started:.0f}s, cached at {final}")
    return final


def cached_wheel(backend: str, cmake_args: list[str]) -> Path:
    out_dir = wheel_dir(backend)
    with file_lock(out_dir.parent / f".{out_dir.name}.lock"):
        found = sorted(out_dir.glob("llama_cpp_python-*.whl"))
        if found:
            say(f"using cached llama-cpp-python wheel {found[0]}")
            return found[0]
        return build_wheel(backend, cmake_args, out_dir)


# ---------------------------------------------------------------- Qt system libraries

def missing_xcb_packages() -> list[str]:
    if not sys.platform.startswith("linux"):
        return []
    try:
        known = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except OSError:
        return []
    return [pkg for pkg, lib in XCB_PACKAGES.items() if lib not in known]


def ensure_xcb_libraries() -> None:
    missing = missing_xcb_packages()
    if not missing:
        return
    cmd = ["apt-get", "install", "-y", "-q", *missing]
    if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        say(f"installing Qt's xcb libraries for a real window: {' '.join(missing)}")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        ok = subprocess.run(["apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL).returncode == 0
        ok = ok and subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL).returncode == 0
        if ok and not missing_xcb_packages():
            return
    say("Qt needs these system libraries to open a window (tests run without them):\n"
        f"    sudo apt-get install {' '.join(missing)}")


# ---------------------------------------------------------------- main

def run(cmd: list[str], **kw: object) -> None:
    res = subprocess.run(cmd, **kw)  # type: ignore[call-overload]
    if res.returncode != 0:
        raise SystemExit(f"[ebb setup] command failed ({res.returncode}): {' '.join(cmd)}")


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def fingerprint(backend: str) -> str:
    h = hashlib.sha256()
    for f in (ROOT / "pyproject.toml", Path(__file__)):
        h.update(f.read_bytes())
    h.update(backend.encode())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-model", action="store_true", help="do not fetch the default model")
    args = ap.parse_args(argv)
    if sys.version_info < (3, 10):
        raise SystemExit("[ebb setup] Python 3.10 or newer is needed")
    backend, cmake_args, why = detect_backend()
    fp = fingerprint(backend)
    py = venv_python()
    up_to_date = py.exists() and STAMP.exists() and json.loads(STAMP.read_text()).get("fingerprint") == fp
    if not up_to_date:
        if not py.exists():
            say(f"creating {VENV}")
            run([sys.executable, "-m", "venv", str(VENV)])
        say(f"llama.cpp backend: {backend} ({why})")
        wheel = cached_wheel(backend, cmake_args)
        run([str(py), "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", str(wheel)])
        say("installing Ebb and its dependencies")
        run([str(py), "-m", "pip", "install", "-q", str(wheel), "-e", f"{ROOT}[test]"])
        ensure_xcb_libraries()
    if not args.no_model:
        run([str(py), "-m", "engine", "fetch-model"], cwd=ROOT)
    if not up_to_date:
        STAMP.write_text(json.dumps({"fingerprint": fp, "backend": backend,
                                     "python": platform.python_version()}))
        say("ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
