#!/usr/bin/env bash
# GPU check for a lent NVIDIA machine: CUDA build (cached like any other backend), then
# tests/gpu/gpu_check.py. Aim: under 10 minutes on a 16-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_CUDA=on -DGGML_RPC=on -DCMAKE_CUDA_ARCHITECTURES=native}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
nvidia-smi -L
python3 packaging/bootstrap.py
.venv/bin/ebb-engine devices
exec .venv/bin/python tests/gpu/gpu_check.py "$@"
