"""llmbus against the engines users would pick instead, on one machine, one server at a time.

Starts `llmbus up`, then each peer that bench/install_peers.sh installed (llama.cpp's
llama-server, vLLM for CPUs), runs the same streaming workloads against each, runs HF
transformers `generate` as the naive baseline, and prints markdown tables of ratios
(peer / llmbus). Raw JSON reports and server logs go to bench/results/<time>/.

    python bench/compare.py [--peers llmbus,llama-cpp,vllm-cpu,hf] [--threads 2]

The same as `llmbus bench compare`; see docs/benchmarks.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from services.bench.compare import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
