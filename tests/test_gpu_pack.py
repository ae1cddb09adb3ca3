"""packaging/gpu-pack.py: what travels to a lent GPU machine (no network, 64 MiB a call)."""
from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _gpu_pack():
    spec = importlib.util.spec_from_file_location("gpu_pack", ROOT / "packaging" / "gpu-pack.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_lean_package_keeps_each_library_once_and_the_halves_join_back(tmp_path):
    gp = _gpu_pack()
    wheel = tmp_path / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    members = {
        "llama_cpp/__init__.py": b"from .llama_cpp import *\n",
        "llama_cpp/llama_cpp.py": b"# the binding\n",
        "llama_cpp/server/app.py": b"# not needed\n",
        "llama_cpp/lib/libllama.so": b"L" * 5000,
        "llama_cpp/lib/libllama.so.0": b"L" * 5000,
        "llama_cpp/lib/libllama.so.0.5.0": b"L" * 5000,
        "llama_cpp/lib/libggml-base.so.0": b"B" * 3000,
        "llama_cpp/lib/libggml-base.so.0.25.3": b"B" * 3000,
        "llama_cpp/lib/libggml-cuda.so": bytes(range(256)) * 400,
        "llama_cpp/lib/libggml-cpu-haswell.so": b"H" * 2000,
        "lib/libllama.so": b"L" * 5000,
        "include/llama.h": b"/* header */\n",
        "llama_cpp_python-0.3.36.dist-info/RECORD": b"",
    }
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    lean = tmp_path / "lean.zip"
    assert gp.lean_zip(wheel, lean) == 7
    with zipfile.ZipFile(lean) as zf:
        assert sorted(zf.namelist()) == sorted([
            "llama_cpp/__init__.py", "llama_cpp/llama_cpp.py", "llama_cpp/lib/libllama.so",
            "llama_cpp/lib/libllama.so.0", "llama_cpp/lib/libggml-base.so.0",
            "llama_cpp/lib/libggml-cuda.so", "llama_cpp/lib/libggml-cpu-haswell.so"])
        assert zf.read("llama_cpp/lib/libggml-cuda.so") == members["llama_cpp/lib/libggml-cuda.so"]
    parts = [tmp_path / "a.part1", tmp_path / "b.part2"]
    gp.split(lean, parts)
    assert abs(parts[0].stat().st_size - parts[1].stat().st_size) <= 1
    assert parts[0].read_bytes() + parts[1].read_bytes() == lean.read_bytes()
