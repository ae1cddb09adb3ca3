"""The llama.cpp binding, imported once: its log routed through ours and the backend initialised.
Every module that calls llama.cpp gets it from `llama()`. Engine thread (any thread may import)."""
from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import sys
import threading
from pathlib import Path
from typing import Any

from engine.llama import log as llama_log
from engine.llama.binding import binding

_backend_ready = False


def flash_attn_type(on: bool) -> int:
    """llama.cpp's llama_flash_attn_type for a context or an mtmd context: 1 enabled, 0
    disabled (its -1, auto, is never asked: Ebb decides, engine/config.py flash_attn_for)."""
    return 1 if on else 0


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


def import_meanwhile(names: tuple[str, ...]) -> None:
    """Import `names` on a helper thread, now: called just before a long llama.cpp call that
    lets go of the GIL (a model's load), for modules needed only after it. Whoever imports
    one of them first waits for it (Python's import lock); an import that fails here fails
    again, and says so, where the module is used."""
    missing = [n for n in names if n not in sys.modules]
    if not missing:
        return

    def run() -> None:
        with contextlib.suppress(Exception):
            for name in missing:
                importlib.import_module(name)

    threading.Thread(target=run, name="ebb-import-meanwhile", daemon=True).start()
