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
            "system_info": system}
