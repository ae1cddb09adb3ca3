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
import shlex
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


# ggml's AMX path (the "AMX" extra buffer type, ggml-cpu/amx/) segfaults in
# ggml_backend_amx_mul_mat on Sapphire Rapids and later (llama.cpp issue #20824): the first
# decode of a model kills the process. A native build compiles it in wherever -march=native
# enables AMX, so every build Ebb makes turns AMX code generation off (explicit -mno-* flags
# win over -march=native in GCC and Clang, whatever their order); ggml then neither builds
# nor registers the AMX buffer type. The CPU repack (CPU_REPACK: AVX2/AVX-512 layouts) stays.
NO_AMX_FLAGS = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
# Instructions that only AMX code contains: a library with none of them cannot run AMX.
AMX_MNEMONICS = ("ldtilecfg", "sttilecfg", "tileloadd", "tileloaddt1", "tilestored",
                 "tilezero", "tilerelease", "tdpbssd", "tdpbsud", "tdpbusd", "tdpbuud",
                 "tdpbf16ps", "tdpfp16ps")


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def _compiler_accepts(flags: tuple[str, ...]) -> bool:
    """Whether the C compiler knows these flags (GCC and Clang 11+ know the AMX ones; an older
    compiler cannot emit AMX at all, so it needs none of them)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return False
    try:
        res = subprocess.run([cc, *flags, "-E", "-x", "c", os.devnull], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return res.returncode == 0


def no_amx_args() -> list[str]:
    """CMake arguments that keep AMX code out of a native x86 build (none elsewhere)."""
    if not _is_x86() or sys.platform == "win32" or not _compiler_accepts(NO_AMX_FLAGS):
        return []
    flags = " ".join(NO_AMX_FLAGS)
    return [f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"]


# A bundle's llama.cpp runs on any x86-64 CPU of the last decade: no -march=native; ggml's CPU
# backend is built once per instruction-set level as loadable modules and the best one for the
# running CPU is picked at start (ggml_backend_load_all_from_path, engine/llama/ggml.py). The
# modules are installed beside the other libraries (CMAKE_INSTALL_BINDIR), where the engine
# looks for them. The one variant built with AMX (sapphirerapids) is dropped from the wheel
# after the build (drop_amx_modules); ggml then picks zen4 (AVX-512 VBMI/VNNI/BF16) on those CPUs.
PORTABLE_ARGS = ["-DGGML_NATIVE=OFF", "-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON",
                 "-DCMAKE_INSTALL_BINDIR=llama_cpp/lib"]
# The CUDA build: RTX 30 (sm_86), RTX 40 (sm_89), H100/H200 (sm_90), RTX 50 (sm_120, with PTX
# so later cards can JIT it). Always portable (GGML_BACKEND_DL): CUDA is a module that is
# skipped when no NVIDIA driver is present, so the same wheel runs on the CPU there instead of
# failing to import; setup and `make dist` share this one build.
CUDA_ARCHITECTURES = "86-real;89-real;90-real;120"
CUDA_ARGS = ["-DGGML_CUDA=on", "-DGGML_RPC=on", f"-DCMAKE_CUDA_ARCHITECTURES={CUDA_ARCHITECTURES}",
             *PORTABLE_ARGS]
# Bump when the way a key's wheel is built changes, so caches of older builds are not reused.
BUILD_REVISION = "noamx"


def detect_portable_backend() -> tuple[str, list[str], str]:
    """The bundle's build: the machine's backend (CUDA or CPU) with RPC, without native-only code.

    Cached under its own key ("...-portable"), beside the developer build, which keeps its
    native speed."""
    key, args, why = detect_backend(user_settings=False)
    if key.startswith("cuda"):
        return key, args, why
    if key.startswith("metal-rpc"):
        return "metal-rpc-portable", ["-DGGML_METAL=on", "-DGGML_RPC=on", "-DGGML_NATIVE=OFF"], why
    return f"cpu-rpc-portable-{BUILD_REVISION}", ["-DGGML_RPC=on", *PORTABLE_ARGS], why


def detect_backend(user_settings: bool = True) -> tuple[str, list[str], str]:
    """Return (cache key, cmake args, why). User CMAKE_ARGS / GGML_* env vars win (AMX is
    still turned off unless they set the compiler flags themselves)."""
    user_args = shlex.split(os.environ.get("CMAKE_ARGS", "")) if user_settings else []
    user_args += [f"-D{k}={v}" for k, v in sorted(os.environ.items())
                  if user_settings and k.startswith("GGML_") and k != "GGML_NTHREADS"]
    prebuilt = os.environ.get("EBB_LLAMA_WHEEL", "") if user_settings else ""
    if prebuilt:  # a wheel built elsewhere (gpu-check.sh carries the CUDA one to a GPU machine)
        name = Path(prebuilt).name
        kind = "cuda" if "cuda" in prebuilt.lower() else "prebuilt"
        return (f"{kind}-prebuilt-{hashlib.sha256(name.encode()).hexdigest()[:10]}", [],
                f"EBB_LLAMA_WHEEL={prebuilt}")
    if user_args:
        if not any("GGML_RPC" in a for a in user_args):
            user_args.append("-DGGML_RPC=on")
        if not any(a.startswith(("-DCMAKE_C_FLAGS", "-DCMAKE_CXX_FLAGS")) for a in user_args):
            user_args += no_amx_args()
        digest = hashlib.sha256(" ".join(user_args).encode()).hexdigest()[:10]
        return f"custom-{digest}", user_args, "your CMAKE_ARGS/GGML_* settings"
    if sys.platform == "darwin":
        return "metal-rpc", ["-DGGML_METAL=on", "-DGGML_RPC=on"], "macOS"
    why = "no nvcc found"
    if shutil.which("nvcc"):
        if not _nvidia_driver_present():
            why = ("nvcc found but no NVIDIA driver, so a CUDA build could not run here; "
                   "set EBB_BACKEND=cuda to build one anyway")
        elif _nvcc_works():
            return cuda_backend("nvcc works and an NVIDIA driver is present")
        else:
            why = "nvcc found but it cannot compile a test program"
    if os.environ.get("EBB_BACKEND", "").lower() == "cuda":
        return cuda_backend("EBB_BACKEND=cuda")
    return f"cpu-rpc-{BUILD_REVISION}", ["-DGGML_RPC=on", *no_amx_args()], why


def cuda_backend(why: str) -> tuple[str, list[str], str]:
    return f"cuda-rpc-portable-{BUILD_REVISION}", [*CUDA_ARGS, *cublas_args(), *driver_args()], why


def cuda_runtime_packages(backend: str) -> list[str]:
    """NVIDIA's CUDA runtime and cuBLAS from PyPI for a CUDA build (the same major and minor
    as nvcc): the wheel's CUDA module needs them, and a user's machine has the driver but
    seldom the toolkit. The engine opens them before ggml loads CUDA (engine/llama/lib.py)."""
    if not backend.startswith("cuda"):
        return []
    version = _cuda_major()
    return [f"nvidia-cuda-runtime=={version}.*", f"nvidia-cublas=={version}.*"] if version else []


def driver_args() -> list[str]:
    """ggml-cuda links the driver (libcuda) for its virtual-memory pool. A build machine with
    neither a driver nor the toolkit's stub (lib64/stubs/libcuda.so) builds without that pool
    (GGML_CUDA_NO_VMM: the runtime loads the driver when it starts; ggml uses its plain pool)."""
    nvcc = shutil.which("nvcc")
    toolkit = Path(nvcc).resolve().parent.parent if nvcc else None
    if toolkit is not None and (any(toolkit.glob("lib*/stubs/libcuda.so"))
                                or any(toolkit.glob("targets/*/lib/stubs/libcuda.so"))):
        return []
    if _nvidia_driver_present():
        return []
    return ["-DGGML_CUDA_NO_VMM=ON"]


def _cuda_major() -> str:
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    m = re.search(r"release (\d+)\.(\d+)", out)
    return f"{m.group(1)}.{m.group(2)}" if m else ""


def cublas_args() -> list[str]:
    """ggml-cuda links cuBLAS. A CUDA toolkit installed without it (nvcc and the runtime only)
    gets NVIDIA's own cuBLAS wheel from PyPI, matching nvcc's version, unpacked in the cache;
    CMake is pointed at it. Nothing when the toolkit has cuBLAS."""
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return []
    toolkit = Path(nvcc).resolve().parent.parent
    if any(toolkit.glob("lib*/libcublas.so*")) or any(toolkit.glob("targets/*/lib/libcublas.so*")):
        return []
    version = _cuda_major()
    if not version:
        return []
    major = version.split(".")[0]
    root = cache_root() / "cuda-extra" / f"cublas-{version}"
    lib, inc = root / "nvidia" / f"cu{major}" / "lib", root / "nvidia" / f"cu{major}" / "include"
    if not any(lib.glob("libcublas.so*")):
        say(f"the CUDA toolkit has no cuBLAS: fetching NVIDIA's cuBLAS {version} wheel into {root}")
        with tempfile.TemporaryDirectory() as tmp:
            run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp,
                 f"nvidia-cublas=={version}.*"])
            import zipfile

            for whl in Path(tmp).glob("*.whl"):
                zipfile.ZipFile(whl).extractall(root)
    libs = {name: next(lib.glob(f"{name}.so*"), None) for name in ("libcublas", "libcublasLt")}
    if not all(libs.values()):
        return []
    return [f"-DCUDA_cublas_LIBRARY={libs['libcublas']}", f"-DCUDA_cublasLt_LIBRARY={libs['libcublasLt']}",
            f"-DCMAKE_CUDA_FLAGS=-I{inc}", f"-DCMAKE_CXX_FLAGS=-I{inc}"]


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


def source_tree() -> Path:
    """llama-cpp-python's sdist, unpacked once at a fixed path in the cache: a build directory
    kept between runs (build_wheel) must see the same source path every time."""
    import tarfile

    root = cache_root() / "src"
    tree = root / f"llama_cpp_python-{LLAMA_CPP_VERSION}"
    if (tree / "pyproject.toml").is_file():
        return tree
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ebb-sdist-", dir=root) as tmp:
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-cache-dir",
             "--no-binary", ":all:", "-d", tmp, f"llama-cpp-python=={LLAMA_CPP_VERSION}"])
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            raise SystemExit(f"[ebb setup] pip did not fetch llama-cpp-python {LLAMA_CPP_VERSION}'s source")
        with tarfile.open(sdists[0]) as tf:
            tf.extractall(Path(tmp) / "x")  # noqa: S202 (PyPI's sdist of a pinned version)
        unpacked = next((Path(tmp) / "x").iterdir())
        unpacked.rename(tree)
    return tree


def build_dir(backend: str) -> Path:
    """Where a backend's CMake build lives while it is unfinished: a build cut off (a closed
    terminal, a session's end; CUDA's takes hours on 2 cores) goes on from there next time."""
    return cache_root() / "build" / wheel_dir(backend).name


def build_wheel(backend: str, cmake_args: list[str], out_dir: Path) -> Path:
    """Build llama-cpp-python from its sdist, showing progress; return the wheel path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "build.log"
    env = dict(os.environ, CMAKE_ARGS=shlex.join(cmake_args))
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    tmp_out = Path(tempfile.mkdtemp(prefix="ebb-wheel-"))
    build = build_dir(backend)
    resumed = (build / "CMakeCache.txt").is_file()
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-v",
           f"--config-settings=build-dir={build}", "-w", str(tmp_out), str(source_tree())]
    say(f"building llama-cpp-python {LLAMA_CPP_VERSION} ({backend}: {' '.join(cmake_args)}); "
        f"this takes several minutes once{', going on from the last unfinished build' if resumed else ''}, "
        f"log: {log_path}")
    started = time.monotonic()
    tty = sys.stdout.isatty()
    last_decile = -1
    step_re = re.compile(r"\[\s*(\d+)/(\d+)\]")
    with open(log_path, "a" if resumed else "w") as log:
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
    dropped = drop_amx_modules(wheels[0])
    final = out_dir / wheels[0].name
    shutil.move(str(wheels[0]), final)
    shutil.rmtree(tmp_out, ignore_errors=True)
    shutil.rmtree(build, ignore_errors=True)  # the wheel is cached now; its build is gigabytes
    (out_dir / "build-info.json").write_text(json.dumps(
        {"cmake_args": cmake_args, "build_s": round(time.monotonic() - started, 1),
         "dropped_amx": dropped}, indent=1))
    say(f"built in {time.monotonic() - started:.0f}s, cached at {final}")
    return final


def amx_instruction_count(lib: Path) -> int | None:
    """How many AMX tile instructions `objdump -d` finds in a shared library (None: no objdump)."""
    objdump = shutil.which("objdump")
    if not objdump:
        return None
    proc = subprocess.Popen([objdump, "-d", "--no-show-raw-insn", str(lib)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, errors="replace")
    assert proc.stdout is not None
    pattern = re.compile(r"\s(" + "|".join(AMX_MNEMONICS) + r")\b")
    n = sum(1 for line in proc.stdout if pattern.search(line))
    proc.wait()
    return n


def drop_amx_modules(wheel: Path) -> list[str]:
    """Rewrite the wheel without the ggml CPU-variant modules that contain AMX code (the
    portable build's sapphirerapids); a library that is not a loadable variant and still has AMX
    code is reported. Returns the dropped members. Without objdump the variant is dropped by
    name."""
    import zipfile

    with zipfile.ZipFile(wheel) as zf, tempfile.TemporaryDirectory() as tmp:
        libs = [n for n in zf.namelist() if "/lib/" in n and ".so" in n.rsplit("/", 1)[-1]]
        dropped, kept_amx = [], []
        for name in libs:
            base = name.rsplit("/", 1)[-1]
            path = Path(zf.extract(name, tmp))
            n_amx = amx_instruction_count(path)
            if n_amx is None:
                n_amx = 1 if base.startswith("libggml-cpu-sapphirerapids") else 0
            if n_amx and base.startswith("libggml-cpu-"):
                dropped.append(name)
            elif n_amx:
                kept_amx.append(base)
        if kept_amx:
            say(f"warning: {', '.join(kept_amx)} contain AMX code (your compiler flags?); the "
                "engine turns the AMX buffer type off at load on CPUs that have AMX")
        if not dropped:
            return []
        rewritten = wheel.with_suffix(".tmp")
        with zipfile.ZipFile(rewritten, "w", zipfile.ZIP_DEFLATED) as out:
            for item in zf.infolist():
                if item.filename in dropped:
                    continue
                data = zf.read(item)
                if item.filename.endswith(".dist-info/RECORD"):
                    data = "".join(line for line in data.decode().splitlines(keepends=True)
                                   if line.split(",", 1)[0] not in dropped).encode()
                out.writestr(item, data)
    rewritten.replace(wheel)
    say(f"dropped {len(dropped)} CPU variant(s) with AMX code: "
        + ", ".join(n.rsplit("/", 1)[-1] for n in dropped))
    return dropped


def cached_wheel(backend: str, cmake_args: list[str]) -> Path:
    if "-prebuilt-" in backend:
        wheel = Path(os.environ["EBB_LLAMA_WHEEL"])
        if not wheel.is_file():
            raise SystemExit(f"[ebb setup] EBB_LLAMA_WHEEL names no file: {wheel}")
        say(f"using the prebuilt llama-cpp-python wheel {wheel}")
        return wheel
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


# ---------------------------------------------------------------- the smoke test

def cpu_signature() -> tuple[str, str]:
    """(model name, short hash of model name and flags): the same CPU gives the same hash."""
    name, flags = platform.processor() or platform.machine(), ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
            if flags and name:
                break
    return name, hashlib.sha256(f"{name}|{flags}".encode()).hexdigest()[:12]


def _signal_name(rc: int) -> str:
    import signal

    n = -rc if rc < 0 else rc - 128
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def _run_check(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    """Run the engine's check; a child that crashed leaves a sentinel for the window's next
    start (engine/llama/native.py): setup has said what happened, so it is removed here."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    out, err = proc.communicate()
    if proc.returncode != 0:
        native = Path(os.environ.get("EBB_NATIVE_DIR") or cache_root() / "native")
        for left in (native / f"decoding-{proc.pid}.json",):
            with contextlib.suppress(OSError):
                left.unlink()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def smoke_test(py: Path, build: str, extra: list[str] | None = None) -> str:
    """A real one-token decode of the default model in a child process. A crash (any signal) is
    said in one line, and Ebb is set to safe mode (CPU only, no extra weight layouts: kept in
    the engine's record for this build and CPU) when that runs. Returns "ok" or "safe"; exits
    when even safe mode crashes. Remembered per (wheel, CPU) in the cache."""
    cpu, cpu_hash = cpu_signature()
    checks_path = cache_root() / "native-checks.json"
    with contextlib.suppress(OSError, ValueError):
        checks = json.loads(checks_path.read_text())
    checks = checks if isinstance(locals().get("checks"), dict) else {}
    key = f"{build}|{cpu_hash}"
    if checks.get(key, {}).get("result") in ("ok", "safe"):
        return str(checks[key]["result"])
    cmd = [str(py), "-m", "engine", "native-check", *(extra or [])]
    res = _run_check(cmd)
    result = "ok"
    if res.returncode != 0:
        if not (res.returncode < 0 or res.returncode > 128):  # an error, not a crash: Ebb's bug
            print(res.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"[ebb setup] the smoke test failed (exit {res.returncode}): "
                             f"{' '.join(cmd)}")
        sig = _signal_name(res.returncode)
        why = f"{sig} on the first decode with the default settings during setup"
        say(f"llama.cpp ({build}) crashed with {sig} on its first decode on this CPU ({cpu}): "
            "Ebb will run in safe mode (CPU only, no extra weight layouts), slower but safe; "
            f"to try a fresh build: rm -r {wheel_dir(build.split('/')[0])} and make setup")
        safe = _run_check([*cmd, "--safe", "--remember", why])
        if safe.returncode != 0:
            print(safe.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"[ebb setup] llama.cpp ({build}) crashes on this CPU ({cpu}) even in "
                             f"safe mode ({_signal_name(safe.returncode)}): please report it with "
                             "the output of `ebb-engine about`")
        result = "safe"
    else:
        say(f"smoke test: the default model decoded a token on this CPU ({cpu})")
    checks[key] = {"result": result, "cpu": cpu, "when": time.time()}
    with contextlib.suppress(OSError):
        checks_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = checks_path.with_name(f".{checks_path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(checks, indent=1))
        os.replace(tmp, checks_path)
    return result


# what `make test` uses beside the venv: (the program, its apt package, what is skipped without it)
TEST_TOOLS = (("chromium", "chromium", "the endpoint's browser test"),
              ("pulseaudio", "pulseaudio", "recording from a virtual microphone"),
              ("ffmpeg", "ffmpeg", "llama.cpp's own video helper beside Ebb's frames"))


def ensure_test_tools() -> None:
    """`make test` opens a hostile page in headless Chromium against the local endpoint
    (tests/test_server.py), records from a PulseAudio sine source standing in for a
    microphone (tests/test_audio.py) and runs llama.cpp's video helper, which needs an ffmpeg
    binary, beside Ebb's frames (tests/test_media.py; Ebb itself needs none): install them
    where we can (root with apt), else say how; without one, its test is skipped."""
    missing = [t for t in TEST_TOOLS if not shutil.which(t[0])]
    if not missing:
        return
    if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        say(f"installing {', '.join(t[1] for t in missing)} for the tests (once)")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", "install", "-y", "-q", *(t[1] for t in missing)], env=env,
                       stdout=subprocess.DEVNULL)
    for program, package, what in TEST_TOOLS:
        if not shutil.which(program):
            say(f"{program} is not installed: {what} will be skipped (sudo apt-get install {package})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-model", action="store_true", help="do not fetch the default model")
    ap.add_argument("--test-tools", action="store_true",
                    help="only install what `make test` uses beside the venv (chromium, pulseaudio)")
    args = ap.parse_args(argv)
    if args.test_tools:
        ensure_test_tools()
        return 0
    if sys.version_info < (3, 10):
        raise SystemExit("[ebb setup] Python 3.10 or newer is needed")
    backend, cmake_args, why = detect_backend()
    fp = fingerprint(backend)
    py = venv_python()
    up_to_date = py.exists() and STAMP.exists() and json.loads(STAMP.read_text()).get("fingerprint") == fp
    stamp = json.loads(STAMP.read_text()) if up_to_date else {}
    if not up_to_date:
        if not py.exists():
            say(f"creating {VENV}")
            run([sys.executable, "-m", "venv", str(VENV)])
        say(f"llama.cpp backend: {backend} ({why})")
        wheel = cached_wheel(backend, cmake_args)
        run([str(py), "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", str(wheel)])
        say("installing Ebb and its dependencies")
        run([str(py), "-m", "pip", "install", "-q", str(wheel), "-e", f"{ROOT}[test]",
             *cuda_runtime_packages(backend)])
        ensure_xcb_libraries()
        stamp["wheel"] = wheel.name
    if not args.no_model:
        run([str(py), "-m", "engine", "fetch-model"], cwd=ROOT)
        if not stamp.get("native_check"):
            stamp["native_check"] = smoke_test(py, f"{backend}/{stamp.get('wheel', 'installed')}")
            up_to_date = False
    if not up_to_date:
        stamp.update({"fingerprint": fp, "backend": backend, "python": platform.python_version()})
        STAMP.write_text(json.dumps(stamp))
        say("ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
