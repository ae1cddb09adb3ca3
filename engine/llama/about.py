"""What this build of llama.cpp is: versions, backends and CPU features, for About and bug
reports. Static facts only (no device is asked anything): any thread may call it."""
from __future__ import annotations

from typing import Any


def runtime_info() -> dict[str, Any]:
    import llama_cpp

    from engine.llama import ggml
    from engine.llama.lib import llama

    g = ggml.lib()
    backends = [g.base.ggml_backend_reg_name(g.core.ggml_backend_reg_get(i)).decode()
                for i in range(g.core.ggml_backend_reg_count())]
    system = llama().llama_print_system_info().decode(errors="replace").strip()
    from engine.llama import native

    return {"llama_cpp_python": llama_cpp.__version__, "backends": backends,
            "cpu_backend": cpu_backend_file(), "system_info": system,
            "gpu_backend_modules": gpu_backend_modules(), "notes": backend_notes(),
            "safe_mode": native.safe_mode(), "cpu": native.cpu_name(),
            "cpu_has_amx": native.cpu_has_amx(),
            "cpu_extra_buffer_types": ggml.cpu_extra_buffer_types()}


GPU_MODULES = {"libggml-cuda.so": "CUDA", "libggml-vulkan.so": "Vulkan", "libggml-hip.so": "ROCm",
               "libggml-sycl.so": "SYCL", "libggml-metal.so": "Metal"}


def gpu_backend_modules() -> list[str]:
    """GPU backends this build ships as loadable modules (a portable build: the bundle's, or
    the CUDA wheel's), whether or not they could be loaded."""
    from engine.llama.ggml import lib_dir

    d = lib_dir()
    return [name for f, name in GPU_MODULES.items() if (d / f).exists()]


def backend_notes() -> list[str]:
    """One line per thing a user should know about where llama.cpp will run: a GPU backend
    that is built in but cannot run here (no driver: the CPU runs everything), safe mode."""
    from engine.llama import ggml, native
    from engine.llama.ggml import lib_dir

    g = ggml.lib()
    n_devices: dict[str, int] = {}
    for i in range(g.core.ggml_backend_reg_count()):
        reg = g.core.ggml_backend_reg_get(i)
        g.base.ggml_backend_reg_dev_count.restype = ggml.c_size_t
        g.base.ggml_backend_reg_dev_count.argtypes = [ggml.c_void_p]
        n_devices[g.base.ggml_backend_reg_name(reg).decode()] = int(g.base.ggml_backend_reg_dev_count(reg))
    notes = []
    if native.safe_mode():
        notes.append(f"safe mode ({native.safe_mode_reason()}): llama.cpp runs on the CPU only, "
                     "without extra weight layouts (slower, but the plainest path)")
        return notes
    d = lib_dir()
    for file, name in GPU_MODULES.items():
        if not (d / file).exists() or n_devices.get(name, 0) > 0:
            continue
        why = _module_error(d / file) if name not in n_devices else _no_device_reason(name)
        notes.append(f"this build has {name}, but {why}: llama.cpp runs on the CPU")
    return notes


def _module_error(path: object) -> str:
    """Why ggml could not load a backend module (the loader's message: a missing library)."""
    import ctypes

    try:
        ctypes.CDLL(str(path))
    except OSError as exc:
        text = str(exc)
        if "libcuda.so" in text:
            return f"no NVIDIA driver was found ({text.rsplit(': ', 2)[-2]} is missing)"
        return f"its library could not be loaded ({text})"
    return "ggml did not load it"


def _no_device_reason(name: str) -> str:
    import ctypes

    if name == "CUDA":
        try:
            cuda = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return "no NVIDIA driver was found (libcuda.so.1 is missing)"
        return cuda_no_device_reason(_cuda_version(cuda, "cuDriverGetVersion"),
                                     _cuda_version(_loaded_cudart(), "cudaRuntimeGetVersion"))
    return f"{name} found no device"


def cuda_no_device_reason(driver: int | None, runtime: int | None) -> str:
    """Why a driver is there and CUDA still has no device. Versions as CUDA gives them
    (12040: 12.4). A driver older than the runtime the build uses (CUDA 13 wants driver 580
    or newer) is the common case on a desktop, and the user can fix it."""
    def v(n: int) -> str:
        return f"{n // 1000}.{n % 1000 // 10}"

    if driver is not None and runtime is not None and driver < runtime:
        return (f"the NVIDIA driver supports CUDA {v(driver)}, older than the CUDA {v(runtime)} "
                "this build uses (update the NVIDIA driver)")
    return "the NVIDIA driver reports no usable GPU"


def _cuda_version(lib: object, fn: str) -> int | None:
    import ctypes

    out = ctypes.c_int(0)
    try:
        rc = getattr(lib, fn)(ctypes.byref(out))
    except (AttributeError, OSError):
        return None
    return out.value if rc == 0 and out.value > 0 else None


def _loaded_cudart() -> object:
    """The CUDA runtime ggml's CUDA module loaded (from the process's memory map), or None."""
    import ctypes

    try:
        with open("/proc/self/maps") as fh:
            paths = sorted({line.split()[-1] for line in fh if "/libcudart.so" in line})
    except OSError:
        return None
    for path in paths:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def cpu_backend_file() -> str:
    """The CPU backend's library in use: in a portable build, the per-CPU variant ggml picked
    for this machine (libggml-cpu-haswell.so, ...); in a normal one, libggml-cpu.so, built
    for the machine that compiled it. Read from the process's own memory map."""
    try:
        with open("/proc/self/maps") as fh:
            names = {line.rsplit("/", 1)[-1].strip() for line in fh if "libggml-cpu" in line}
    except OSError:
        return "unknown"
    return ", ".join(sorted(names)) or "built in"
