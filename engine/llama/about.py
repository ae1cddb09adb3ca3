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
    return {"llama_cpp_python": llama_cpp.__version__, "backends": backends,
            "cpu_backend": cpu_backend_file(), "system_info": system}


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
