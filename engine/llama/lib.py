"""The llama.cpp binding, imported once: its log routed through ours and the backend initialised.
Every module that calls llama.cpp gets it from `llama()`. Engine thread (any thread may import)."""
from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import threading
from pathlib import Path
from typing import Any

from engine.llama import log as llama_log

_backend_ready = False
_package_lock = threading.Lock()


def llama() -> Any:
    """llama.cpp's C API (llama-cpp-python's ctypes binding), imported once, with logging routed
    and the backend initialised."""
    global _backend_ready
    if not _backend_ready:
        from engine.llama import native

        native.apply_safe_mode_env()  # safe mode hides GPUs before ggml initialises them
    L = binding()
    if not _backend_ready:
        llama_log.install()
        L.llama_backend_init()
        load_backend_modules(Path(L.__file__).parent / "lib")
        _backend_ready = True
    return L


def binding() -> Any:
    """`llama_cpp.llama_cpp`, the ctypes binding, without the rest of the package (#31).

    The package's `__init__` also imports its high-level API (`llama_cpp.llama`: numpy, jinja2,
    diskcache, multiprocessing, ...), 0.1-0.15 s of every start on 2 cores, and Ebb calls
    none of it before the first token. So when nothing has imported the package yet, it goes
    into `sys.modules` unexecuted (its submodules import as usual), and the first of its own
    names anyone asks for (`llama_cpp.Llama`, `__version__`) runs the real `__init__` then."""
    if "llama_cpp" not in sys.modules:
        spec = importlib.util.find_spec("llama_cpp")
        if spec is not None and spec.loader is not None and spec.submodule_search_locations:
            sys.modules["llama_cpp"] = _unexecuted_package(spec)
    import llama_cpp.llama_cpp

    return llama_cpp.llama_cpp


def _unexecuted_package(spec: Any) -> Any:
    pkg = importlib.util.module_from_spec(spec)

    def rest_of_package(name: str) -> Any:  # PEP 562: called only for a name not there yet
        with _package_lock:
            if pkg.__dict__.pop("__getattr__", None) is not None:
                spec.loader.exec_module(pkg)  # `from .llama_cpp import *; from .llama import *`
        return getattr(pkg, name)

    pkg.__getattr__ = rest_of_package  # type: ignore[method-assign]
    return pkg


def load_backend_modules(lib_dir: Path) -> list[str]:
    """A portable build (the desktop bundle's: GGML_BACKEND_DL) ships ggml's backends as
    modules, the CPU backend once per instruction-set level (libggml-cpu-haswell.so, ...).
    Nothing is registered until they are loaded: ggml picks the best CPU variant for this
    machine and loads RPC and any GPU backend. Returns the modules found (none for a normal
    build, whose backends are linked in)."""
    modules = sorted(p.name for p in lib_dir.glob("libggml-*.so") if _is_backend_module(p.name))
    # a module has no versioned twin (libggml-cpu.so.0 is a normal build's linked library)
    dl_cpu = [m for m in modules if m.startswith("libggml-cpu") and not (lib_dir / f"{m}.0").exists()]
    if not dl_cpu:
        return []
    if "libggml-cuda.so" in modules:
        preload_cuda_runtime()
    mode = os.RTLD_GLOBAL if hasattr(os, "RTLD_GLOBAL") else 0
    core = ctypes.CDLL(str(lib_dir / "libggml.so.0"), mode=mode)
    core.ggml_backend_load_all_from_path.restype = None
    core.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
    core.ggml_backend_load_all_from_path(str(lib_dir).encode())
    return modules


def _is_backend_module(name: str) -> bool:
    return name not in ("libggml-base.so",) and name.startswith("libggml-")


CUDA_RUNTIME_LIBS = ("libcudart.so", "libcublasLt.so", "libcublas.so")


def cuda_runtime_dirs() -> list[Path]:
    """Folders that may hold NVIDIA's CUDA runtime and cuBLAS: the pip packages setup installs
    with a CUDA build (site-packages/nvidia/cu*/lib) and a frozen bundle's own folder."""
    import sys

    dirs: list[Path] = []
    for entry in sys.path:
        dirs += sorted(Path(entry).glob("nvidia/cu*/lib")) if entry else []
    frozen = getattr(sys, "_MEIPASS", None)
    if frozen:
        dirs += [Path(frozen), *sorted(Path(frozen).glob("nvidia/cu*/lib"))]
    return [d for d in dirs if d.is_dir()]


def preload_cuda_runtime() -> list[str]:
    """Open the CUDA runtime and cuBLAS globally before ggml loads its CUDA module, which needs
    them by name: a machine without the CUDA toolkit has them only in those folders. Nothing
    found is fine: the module then fails to load and ggml runs on the CPU (the about notes
    say why). Returns what was opened."""
    mode = os.RTLD_GLOBAL if hasattr(os, "RTLD_GLOBAL") else 0
    opened: list[str] = []
    for d in cuda_runtime_dirs():
        for name in CUDA_RUNTIME_LIBS:
            for path in sorted(d.glob(f"{name}.*")):
                try:
                    ctypes.CDLL(str(path), mode=mode)
                    opened.append(str(path))
                except OSError:
                    continue
                break
    return opened
