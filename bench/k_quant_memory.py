"""Peak memory of the executor on a K-quant file, against the file's size plus its KV cache.

Writes a generated llama GGUF of random K-quant blocks in the mix of types llama.cpp's
quantizer makes (`--mix`: q4_k_m, Q4_K with Q6_K for half the layers' attn_v and ffn_down and
the output matrix; q3_k_m; q2_k; see MIXES), then loads it in a fresh process as the executor
does (fast mode) and runs one step. Memory is the process's resident set: its peak over the
load and the step, less what the process held after its imports.

    python -m llmbus.bench.k_quant_memory [--layers 12] [--hidden 1024] [--kv-blocks 256]
    python -m llmbus.bench.k_quant_memory --layers 16 --hidden 2048 --mix q2_k   # 1B-shaped
    python -m llmbus.bench.k_quant_memory --experts 16 --experts-used 4   # a Qwen3-MoE file

`--write FILE` only writes the file, with the default model's tokenizer so that it can be
served and benchmarked (its random weights say nothing; their speed is a real model's): a
Llama-3.2-1B shape is `--layers 16 --hidden 2048 --write llama-1b-q4_k_m.gguf` (1.2B
parameters with SmolLM2's 49,152-token vocabulary; `--mix q3_k_m` or `q2_k` for the others).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

# Per type: (bytes a block, weights a block, where its float16 scales d (and dmin) are)
BLOCKS = {"Q2_K": (84, 256, (80, 82)), "Q3_K": (110, 256, (108,)), "Q4_K": (144, 256, (0, 2)),
          "Q5_K": (176, 256, (0, 2)), "Q6_K": (210, 256, (208,)), "IQ4_NL": (18, 32, (0,)),
          "IQ4_XS": (136, 256, (0,))}


def random_k_quant(kind: str, rows: int, cols: int, rng: np.random.Generator,
                   scale: float = 1.0) -> np.ndarray:
    """Valid blocks of K-quant or IQ4 `kind` (gguf-py has no quantizer for them) with random
    codes and sub-block scales, weights within about ±`scale`: [rows, bytes per row]."""
    block_bytes, weights, at = BLOCKS[kind]
    blocks = rng.integers(0, 256, (rows, cols // weights, block_bytes), dtype=np.uint8)
    if kind == "IQ4_NL":  # no sub-scales (the others' average ~16): d alone carries them
        scale *= 16
    d = rng.uniform(2e-4 * scale, 1e-3 * scale, (rows, cols // weights, 1)).astype(np.float16) \
        .view(np.uint8)
    for offset in at:
        blocks[..., offset:offset + 2] = d
    return blocks.reshape(rows, -1)


# The types llama.cpp's quantizer picks per matrix, roughly (llama_tensor_get_type): the file's
# type for most, more bits for V and the FFN's down projection (on every other layer here, as
# its "use more bits" does on half of them) and Q6_K for the vocabulary head.
MIXES = {
    "q4_k_m": {"base": "Q4_K", "embd": "Q4_K", "v": ("Q6_K", "Q4_K"), "o": "Q4_K",
               "down": ("Q6_K", "Q4_K")},
    "q3_k_m": {"base": "Q3_K", "embd": "Q3_K", "v": ("Q5_K", "Q4_K"), "o": "Q4_K",
               "down": ("Q5_K", "Q4_K")},
    "q2_k": {"base": "Q2_K", "embd": "Q2_K", "v": ("Q4_K", "Q4_K"), "o": "Q3_K",
             "down": ("Q3_K", "Q3_K")},
}


def write_model(path: Path, layers: int, hidden: int, vocab: int,
                tokenizer_from: Path | None = None, experts: int = 0,
                experts_used: int = 0, mix: str = "q4_k_m") -> int:
    """A llama file in one of MIXES's styles; returns its parameter count. With
    `tokenizer_from`, that file's tokenizer and its vocabulary's size. With `experts`, a
    Qwen3-MoE (qwen3moe) file instead: that many experts of hidden / 2 a layer, `experts_used`
    per token."""
    import gguf

    from llmbus.services.gguf_metadata import copy_tokenizer

    heads, kv_heads, ffn = hidden // 64, hidden // 256, 4 * hidden
    writer = gguf.GGUFWriter(str(path), "qwen3moe" if experts else "llama")
    if experts:
        ffn = hidden // 2  # each expert's width, as Qwen3-MoE's are narrow
        writer.add_expert_count(experts)
        writer.add_expert_used_count(experts_used)
        writer.add_expert_feed_forward_length(ffn)
    for add, value in ((writer.add_block_count, layers), (writer.add_context_length, 4096),
                       (writer.add_embedding_length, hidden), (writer.add_head_count, heads),
                       (writer.add_feed_forward_length, ffn),
                       (writer.add_head_count_kv, kv_heads)):
        add(value)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if tokenizer_from is not None:
        vocab = copy_tokenizer(writer, tokenizer_from)
    rng = np.random.default_rng(0)
    num_params = 0

    def matrix(name: str, rows: int, cols: int, kind: str, stacked: int = 0) -> None:
        nonlocal num_params
        raw = random_k_quant(kind, rows * max(stacked, 1), cols, rng)
        if stacked:  # [experts, rows, bytes]
            raw = raw.reshape(stacked, rows, -1)
        writer.add_tensor(name, raw, raw_shape=raw.shape,
                          raw_dtype=gguf.GGMLQuantizationType[kind])
        num_params += rows * cols * max(stacked, 1)

    types = MIXES[mix]
    base = types["base"]
    matrix("token_embd.weight", vocab, hidden, types["embd"])
    for i in range(layers):
        p = f"blk.{i}."
        v, down = types["v"][i % 2], types["down"][i % 2]
        writer.add_tensor(p + "attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        matrix(p + "attn_q.weight", hidden, hidden, base)
        matrix(p + "attn_k.weight", kv_heads * 64, hidden, base)
        matrix(p + "attn_v.weight", kv_heads * 64, hidden, v)
        matrix(p + "attn_output.weight", hidden, hidden, types["o"])
        if experts:
            for n in ("q", "k"):
                writer.add_tensor(f"{p}attn_{n}_norm.weight", np.ones(64, dtype=np.float32))
            writer.add_tensor(p + "ffn_gate_inp.weight", (rng.standard_normal(
                (experts, hidden)) / np.sqrt(hidden)).astype(np.float32))
            num_params += experts * hidden
            matrix(p + "ffn_gate_exps.weight", ffn, hidden, base, stacked=experts)
            matrix(p + "ffn_up_exps.weight", ffn, hidden, base, stacked=experts)
            matrix(p + "ffn_down_exps.weight", hidden, ffn, down, stacked=experts)
            continue
        matrix(p + "ffn_gate.weight", ffn, hidden, base)
        matrix(p + "ffn_up.weight", ffn, hidden, base)
        matrix(p + "ffn_down.weight", hidden, ffn, down)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    matrix("output.weight", vocab, hidden, "Q6_K")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return num_params


def measure(path: str, kv_blocks: int) -> dict:
    """In this (fresh) process: resident memory after imports, then the peak over a load and
    one step."""
    import resource

    from llmbus.bus.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan
    from llmbus.services.executor.kernels.cpu.library import configure_openmp

    configure_openmp()
    import onnxruntime  # noqa: F401  (its memory belongs to the baseline)
    import torch  # noqa: F401

    from llmbus.services.executor.runner import ModelRunner

    def rss() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()

    baseline = rss()
    runner = ModelRunner(path, model_name="k-quant", num_blocks=kv_blocks,
                         backend="auto")
    prompt = list(range(10, 74))
    result = runner.step(StepPlan(step_id=0, new_requests=[NewRequestData(
        "r", prompt, SamplingParams(temperature=0.0))], scheduled=[ScheduledRequest(
            "r", 0, len(prompt), [1, 2, 3, 4])]))
    assert not result.error, result.error
    cache = runner.kv_cache
    out = {"baseline": baseline, "after": rss(),
           "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "kv_bytes": cache.k.numel() * cache.k.element_size() * 2,
           "backend": runner.choice.describe()}
    if runner.config.num_experts:
        out["expert_calls"] = _expert_calls_at_batch_8(runner)
    return out


def _expert_calls_at_batch_8(runner) -> list[list[int]]:
    """A decode step of 8 sequences: per layer, how many times each expert ran (the
    calls are counted as the backend makes them)."""
    from llmbus.bus.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan
    from llmbus.services.executor.backends import int_moe

    prompts = {f"d{i}": [20 + 7 * i + j for j in range(16)] for i in range(8)}
    blocks = {seq: [10 + 2 * i, 11 + 2 * i] for i, seq in enumerate(prompts)}
    runner.step(StepPlan(step_id=1, new_requests=[
        NewRequestData(seq, ids, SamplingParams(temperature=0.0)) for seq, ids in prompts.items()],
        scheduled=[ScheduledRequest(seq, 0, 16, blocks[seq]) for seq in prompts]))
    counts: list[list[int]] = []
    mlp = int_moe.moe_mlp

    def counted(x, router, expert_mlp, top_k):
        layer = [0] * router.shape[0]
        counts.append(layer)

        def expert(e, rows):
            layer[e] += 1
            return expert_mlp(e, rows)
        return mlp(x, router, expert, top_k)

    int_moe.moe_mlp = counted
    result = runner.step(StepPlan(step_id=2, scheduled=[
        ScheduledRequest(seq, 16, 1, []) for seq in prompts]))
    int_moe.moe_mlp = mlp
    assert not result.error, result.error
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--kv-blocks", type=int, default=256)
    parser.add_argument("--experts", type=int, default=0,
                        help="a Qwen3-MoE file with this many experts a layer (0: llama)")
    parser.add_argument("--experts-used", type=int, default=4)
    parser.add_argument("--mix", choices=sorted(MIXES), default="q4_k_m",
                        help="the file's types, in the style of llama.cpp's quantizer")
    parser.add_argument("--write", type=Path, default=None,
                        help="only write the file here, with the default model's tokenizer")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # the child's run
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.kv_blocks)))
        return
    if args.write:
        from llmbus.services.model_files import default_model_path

        num_params = write_model(args.write, args.layers, args.hidden, args.vocab,
                                 tokenizer_from=default_model_path(), mix=args.mix)
        print(f"wrote {args.write}: {num_params / 1e9:.2f}B parameters, "
              f"{args.write.stat().st_size / 2 ** 20:.0f} MiB")
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{args.mix}.gguf"
        num_params = write_model(path, args.layers, args.hidden, args.vocab,
                                 experts=args.experts, experts_used=args.experts_used,
                                 mix=args.mix)
        size = path.stat().st_size
        child = subprocess.run([sys.executable, "-m", "llmbus.bench.k_quant_memory",
                                "--measure", str(path), "--kv-blocks", str(args.kv_blocks)],
                               capture_output=True, text=True, check=True)
        m = json.loads(child.stdout.splitlines()[-1])
    mib = 2 ** 20
    grown_peak, grown_after = m["peak"] - m["baseline"], m["after"] - m["baseline"]
    budget = size + m["kv_bytes"]
    print(f"backend: {m['backend']}; {args.mix}-style file")
    print(f"model: {num_params / 1e6:.0f}M parameters, file {size / mib:.0f} MiB, "
          f"KV cache {m['kv_bytes'] / mib:.0f} MiB; a dense float32 copy would be "
          f"{num_params * 4 / mib:.0f} MiB")
    print(f"process after imports {m['baseline'] / mib:.0f} MiB; over that: peak "
          f"{grown_peak / mib:.0f} MiB, after the step {grown_after / mib:.0f} MiB")
    print(f"peak / (file + KV cache) = {grown_peak / budget:.2f} "
          f"(after the step: {grown_after / budget:.2f}; target <= 1.15)")
    if "expert_calls" in m:
        calls = m["expert_calls"]
        used = [sum(1 for c in layer if c) for layer in calls]
        print(f"decode step at batch 8: {len(calls)} layers; experts used per layer "
              f"{min(used)}..{max(used)} of {len(calls[0])}; most runs of one expert in a "
              f"layer: {max(max(layer) for layer in calls)} (each used expert read once)")


if __name__ == "__main__":
    main()
