#!/usr/bin/env bash
# GPU check for a lent NVIDIA machine: tests/gpu/gpu_check.py on a CUDA build of llama.cpp.
# Aim: under 10 minutes including set-up on a 16-core machine.
#
#   packaging/gpu-check.sh [WHEEL] [gpu_check.py args...]
#   packaging/gpu-check.sh --offline [gpu_check.py args...]
#
# WHEEL: the CUDA llama-cpp-python wheel built on a machine without a GPU (setup caches it
# under ~/.cache/ebb/wheels/llama-cpp-python-*-cuda-rpc-portable-*), carried along so that
# nothing is compiled on the GPU machine. Without it, the CUDA build is compiled here for this
# GPU's architecture only (-DCMAKE_CUDA_ARCHITECTURES=native; several minutes on 16 cores).
#
# --offline: a machine with no network whose python3 already has numpy, pillow, jinja2,
# nvidia-ml-py and NVIDIA's CUDA runtime and cuBLAS (the lent H200's image). No venv: what
# packaging/gpu-pack.py packed (.gpu/a and .gpu/b: the CUDA build's llama_cpp package in two
# halves, the gguf, platformdirs and diskcache wheels, a tokenizer-only GGUF) is unpacked into
# /tmp/ebb-gpu/site. A call carries at most 64 MiB, so .gpu/a comes first, in a call of its own
# that copies it to /tmp/ebb-gpu/a; the README's "A GPU check" has the two commands.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--offline" ]; then
  shift
  G=/tmp/ebb-gpu
  A=$G/a
  [ -d .gpu/a ] && A=.gpu/a
  for f in "$A/llama_cpp-lean.zip.part1" .gpu/b/llama_cpp-lean.zip.part2; do
    [ -f "$f" ] || { echo "gpu-check: $f is missing (packaging/gpu-pack.py; README: A GPU check)" >&2; exit 2; }
  done
  rm -rf "$G/site" && mkdir -p "$G/site"
  cat "$A/llama_cpp-lean.zip.part1" .gpu/b/llama_cpp-lean.zip.part2 > "$G/llama_cpp-lean.zip"
  python3 -m zipfile -e "$G/llama_cpp-lean.zip" "$G/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$G/site" "$A"/wheels/*.whl
  export PYTHONPATH="$G/site:$PWD"
  nvidia-smi -L
  python3 -m engine about | grep -E 'backends|notes|cpu_backend'
  python3 -m engine devices
  exec python3 tests/gpu/gpu_check.py --tokenizer-from "$A/tokenizer.gguf" "$@"
fi
if [ $# -gt 0 ] && [[ "$1" == *.whl ]]; then
  export EBB_LLAMA_WHEEL="$(realpath "$1")"
  shift
else
  export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_CUDA=on -DGGML_RPC=on -DCMAKE_CUDA_ARCHITECTURES=native}"
  export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
fi
nvidia-smi -L
python3 packaging/bootstrap.py
.venv/bin/ebb-engine about | grep -E 'backends|notes|cpu_backend'
.venv/bin/ebb-engine devices
exec .venv/bin/python tests/gpu/gpu_check.py "$@"
