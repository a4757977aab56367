"""The executor's command-line options, with their help texts (the service is service.py)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from llmbus.services.executor import adapters_bus
from llmbus.services.executor.backend_choice import BACKENDS, DTYPES


class _DeprecatedSpelling(argparse.Action):
    """`--engine`, the old spelling of `--backend` ("engine" is a scheduler and its executor):
    still taken, with a one-line warning."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"{parser.prog}: warning: --engine is deprecated; use --backend", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-id", default="engine0",
                        help="name of the engine this executor serves (default: engine0)")
    parser.add_argument("--model", default=None,
                        help="path of a GGUF model (default: the pulled default model)")
    parser.add_argument("--exact", action="store_true",
                        help="float32 activations and KV cache on the GGUF's exact weight "
                             "values, so greedy output equals HF transformers token for token "
                             "(ONNX Runtime's graphs on a CPU). Default: the fast mode, int8 "
                             "activations in the matmuls and a float16 KV cache, as llama.cpp "
                             "computes (perplexity within 1%% of exact, checked by a test)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="force a compute backend, for tests and benchmarks: "
                             "integer-kernel (llmbus's C++ kernels, the fast mode on a CPU), "
                             "onnxruntime (ONNX Runtime's graphs: --exact on a CPU, or the fast "
                             "mode without a compiler), torch (the reference; Triton kernels on "
                             "CUDA). auto = the fastest that runs here for the mode; the "
                             "executor logs its choice as one line (default: auto)")
    parser.add_argument("--engine", dest="backend", choices=BACKENDS, action=_DeprecatedSpelling,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="torch backend: compute dtype of weights and KV cache; bfloat16 "
                             "only on CPUs with native bfloat16 (AVX-512-BF16 or AMX) or CUDA "
                             "(default: float32)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the model runs; cuda uses the Triton kernels "
                             "(default: auto = cuda when available, else cpu)")
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens per KV-cache block (default: 16)")
    parser.add_argument("--kv-cache-memory", type=float, default=None,
                        help="KV-cache budget in GiB (default: min(2 GiB, 25%% of free RAM))")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="exact number of KV blocks (overrides --kv-cache-memory)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context window (default: the model's)")
    parser.add_argument("--threads", type=int, default=None,
                        help="compute threads (default: all cores)")
    parser.add_argument("--small-step-threads", type=int, default=None,
                        help="torch backend: threads for steps of at most 4 tokens, e.g. "
                             "single-stream decode (default: --threads minus one on machines "
                             "of up to 4 cores, which leaves a core to the other services, else "
                             "--threads)")
    parser.add_argument("--task", choices=("auto", "embed"), default="auto",
                        help="auto: a generation model generates and embeds, an encoder (bert, "
                             "nomic-bert) embeds; embed: only /v1/embeddings and /v1/score "
                             "(default: auto)")
    parser.add_argument("--pooling", choices=("mean", "cls", "last"), default=None,
                        help="how an embedding pools the prompt's final hidden states "
                             "(default: the file's <arch>.pooling_type, else mean)")
    _add_shard_arguments(parser)
    adapters_bus.add_adapter_arguments(parser)
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds to keep serving steps while the scheduler "
                             "finishes its requests (default: 30)")


def _add_shard_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shard", default=None, metavar="I/N",
                        help="run shard I of N of this engine's executor, the model split by "
                             "layers (N up to its layer count) over processes that may run on "
                             "other hosts: shard 0 (the lead) takes the scheduler's steps, "
                             "embeds and samples; shards 1..N-1 hold only their layers. Each "
                             "loads only its own tensors (default: one executor, the whole "
                             "model)")
    parser.add_argument("--layers", default=None, metavar="A:B",
                        help="with --shard: this shard's layers [A, B) (default: a split "
                             "in which every shard reads about the same bytes of the file a "
                             "step, the lead's counting the head)")
    parser.add_argument("--shard-timeout", type=float, default=120.0,
                        help="lead shard: seconds to wait for a shard's answer to a step "
                             "before the engine is given up as dead (default: 120)")


def default_small_step_threads(threads: int) -> int:
    """One core left to the rest of the stack where cores are few (see runner.py)."""
    return max(1, threads - 1) if (os.cpu_count() or 1) <= 4 else threads
