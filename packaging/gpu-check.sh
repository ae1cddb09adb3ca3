#!/usr/bin/env bash
# GPU check for a lent NVIDIA machine: tests/gpu/gpu_check.py on a CUDA build of llama.cpp.
# Aim: under 10 minutes including set-up on a 16-core machine.
#
#   packaging/gpu-check.sh [WHEEL] [gpu_check.py args...]
#
# WHEEL: the CUDA llama-cpp-python wheel built on a machine without a GPU (setup caches it
# under ~/.cache/ebb/wheels/llama-cpp-python-*-cuda-rpc-portable-*), carried along so that
# nothing is compiled on the GPU machine. Without it, the CUDA build is compiled here for this
# GPU's architecture only (-DCMAKE_CUDA_ARCHITECTURES=native; several minutes on 16 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
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
