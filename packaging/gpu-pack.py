#!/usr/bin/env python3
"""Pack what `packaging/gpu-check.sh --offline` needs on a lent GPU machine, which reaches no
network and takes at most 64 MiB of files per call: two folders, `.gpu/a` and `.gpu/b`, each
carried by one call (docs/media.md, "A GPU check on a machine with no network", says how).

- The CUDA build of llama-cpp-python (the wheel setup caches, ~120 MB) as a lean zip of its
  `llama_cpp` package: its libraries once each (a wheel holds two or three copies), no headers;
  about 100 MB, split in two halves.
- The pure-Python wheels Ebb's engine needs that the GPU machine's image lacks (gguf,
  platformdirs, and diskcache for llama_cpp's own API); the image has numpy, pillow, jinja2, nvidia-ml-py and NVIDIA's CUDA 13 runtime.
- A tokenizer-only GGUF from the default model: gpu_check.py generates its models with that
  tokenizer, and the 98 MB model itself would not fit.

Run with the project's venv: `.venv/bin/python packaging/gpu-pack.py [WHEEL]`.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# a library's extra names: libllama.so.0.5.0 beside libllama.so and libllama.so.0
_FULLY_VERSIONED = re.compile(r"\.so\.\d+\.\d+\.\d+$")
LEAN_ZIP = "llama_cpp-lean.zip"
CALL_LIMIT = 64 * 2**20


def say(msg: str) -> None:
    print(f"[ebb gpu-pack] {msg}", flush=True)


def cached_cuda_wheel() -> Path:
    found = sorted(Path.home().glob(
        ".cache/ebb/wheels/llama-cpp-python-*-cuda-rpc-portable-*/llama_cpp_python-*.whl"))
    if not found:
        raise SystemExit("[ebb gpu-pack] no CUDA wheel cached: build it with "
                         "`EBB_BACKEND=cuda make setup` (hours on 2 cores), or pass WHEEL")
    return found[-1]


def lean_zip(wheel: Path, out: Path) -> int:
    """The wheel's `llama_cpp/` package without its headers and second library names."""
    n = 0
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            name = info.filename
            if not name.startswith("llama_cpp/") or name.startswith("llama_cpp/server/"):
                continue
            if name.startswith("llama_cpp/lib/") and _FULLY_VERSIONED.search(name):
                continue
            dst.writestr(info, src.read(info))
            n += 1
    return n


def split(path: Path, parts: list[Path]) -> None:
    size = path.stat().st_size
    step = -(-size // len(parts))
    with open(path, "rb") as fh:
        for part in parts:
            part.write_bytes(fh.read(step))


def pure_wheels(dest: Path) -> list[Path]:
    names = [f"{n}=={importlib.metadata.version(n)}" for n in ("gguf", "platformdirs", "diskcache")]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary",
                    ":all:", "-d", str(dest), *names], check=True)
    return sorted(dest.glob("*.whl"))


def tokenizer_gguf(out: Path) -> None:
    from gguf import GGUFWriter

    from engine.synth.model_gen import _copy_tokenizer
    from engine.models.default import fetch_default_model

    w = GGUFWriter(out, "llama")
    _copy_tokenizer(fetch_default_model(), w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel", nargs="?", help="default: the CUDA wheel setup cached")
    ap.add_argument("--out", default=str(ROOT / ".gpu"))
    args = ap.parse_args()
    wheel = Path(args.wheel) if args.wheel else cached_cuda_wheel()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    a, b = out / "a", out / "b"
    a.mkdir(parents=True)
    b.mkdir()
    say(f"lean package from {wheel}")
    lean = out / LEAN_ZIP
    n = lean_zip(wheel, lean)
    split(lean, [a / f"{LEAN_ZIP}.part1", b / f"{LEAN_ZIP}.part2"])
    lean.unlink()
    pure_wheels(a / "wheels")
    tokenizer_gguf(a / "tokenizer.gguf")
    for d in (a, b):
        total = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
        say(f"{d.relative_to(ROOT) if d.is_relative_to(ROOT) else d}: {total / 2**20:.1f} MiB "
            f"(a call carries at most {CALL_LIMIT // 2**20} MiB with the repository)")
        if total > CALL_LIMIT - 4 * 2**20:
            raise SystemExit(f"[ebb gpu-pack] {d} is too large for one call")
    say(f"{n} files of llama_cpp packed; carry {a} in the first call and {b} in the second")
    return 0


if __name__ == "__main__":
    sys.exit(main())
