# Over 300 lines: the tiny models' writers (every family, K-quant blocks) and the driver that
# runs them through ModelRunner share TinySpec and its weights.
"""Helpers shared by the executor tests: a tiny random llama GGUF, and a stand-in scheduler."""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmbus.bus.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan
from llmbus.services.executor.weights.gguf_loader import unpermute_qk
from llmbus.services.gguf_metadata import copy_tokenizer
from llmbus.services.gguf_tokenizer import GGUFTokenizer, byte_alphabet

# A trained router's top-k has margins; a random one of logits std ~2 has near-ties that int8
# activations flip (fast-mode perplexity +0.4..1.0% over three seeds), std ~4 margins like a
# trained one's (+0.03..0.05%).
ROUTER_SCALE = 4.0
GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class TinySpec:
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 256
    context_length: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    # Untied by default: with tied random embeddings each token's own logit dominates, and
    # greedy decoding just repeats the last token.
    tied: bool = False
    bos_token_id: int = 1
    eos_token_id: int = 2
    # A head size other than hidden / heads (Qwen3's 128 at any width), written as
    # `<arch>.attention.key_length`.
    head_size: int | None = None
    sliding_window: int = 0  # gemma3: `gemma3.attention.sliding_window`
    # qwen3moe: experts per layer, used per token, and each expert's MLP width
    num_experts: int = 0
    num_experts_used: int = 0
    expert_size: int = 0
    # `<arch>.pooling_type` as llama.cpp writes it for embedders (1 mean, 2 cls, 3 last)
    pooling_type: int | None = None

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads


# transformers reads no head size from a qwen3 GGUF: its default, 128, as in every Qwen3.
QWEN3_SPEC = TinySpec(head_size=128)


def permute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """HF layout -> llama.cpp rotary layout, as convert_hf_to_gguf.py writes Q and K."""
    out = w.shape[0]
    return w.reshape(num_heads, 2, out // num_heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def tiny_weights(spec: TinySpec, seed: int = 0) -> dict[str, np.ndarray]:
    """Random HF-layout weights under GGUF names; scaled so logits are well spread (no ties)."""
    rng = np.random.default_rng(seed)

    def linear(out: int, inp: int) -> np.ndarray:
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    d, f, dh = spec.hidden_size, spec.intermediate_size, spec.head_dim
    weights = {"token_embd.weight": rng.standard_normal((spec.vocab_size, d)).astype(np.float32)}
    for i in range(spec.num_layers):
        p = f"blk.{i}."
        weights |= {
            p + "attn_norm.weight": norm(d),
            p + "attn_q.weight": linear(spec.num_heads * dh, d),
            p + "attn_k.weight": linear(spec.num_kv_heads * dh, d),
            p + "attn_v.weight": linear(spec.num_kv_heads * dh, d),
            p + "attn_output.weight": linear(d, spec.num_heads * dh),
            p + "ffn_norm.weight": norm(d),
            p + "ffn_gate.weight": linear(f, d),
            p + "ffn_up.weight": linear(f, d),
            p + "ffn_down.weight": linear(d, f),
        }
    weights["output_norm.weight"] = norm(d)
    if not spec.tied:
        weights["output.weight"] = 3.0 * linear(spec.vocab_size, d)  # logits std ~3
    return weights


def random_k_quant(kind, rows: int, cols: int, seed: int, scale: float = 1.0) -> np.ndarray:
    """Random but valid blocks of a K-quant GGMLQuantizationType (see bench/k_quant_memory),
    weights within about ±`scale`."""
    from llmbus.bench.k_quant_memory import random_k_quant as blocks

    return blocks(kind.name, rows, cols, np.random.default_rng(seed), scale)


def family_tensors(spec: TinySpec, arch: str, seed: int) -> dict[str, np.ndarray]:
    """What a family adds to llama's tensors: qwen2's Q/K/V biases, qwen3's Q/K norms,
    gemma3's Q/K norms and post-norms (stored, as llama.cpp converts them, with Gemma's +1),
    qwen3moe's Q/K norms, router and stacked experts ([E, F, D] gate and up, [E, D, F] down,
    in place of the dense MLP)."""
    rng = np.random.default_rng(seed + 1000)
    extra = {}
    d, e, f = spec.hidden_size, spec.num_experts, spec.expert_size
    for i in range(spec.num_layers):
        if arch == "qwen2":
            for n, heads in (("q", spec.num_heads), ("k", spec.num_kv_heads),
                             ("v", spec.num_kv_heads)):
                extra[f"blk.{i}.attn_{n}.bias"] = \
                    (0.5 * rng.standard_normal(heads * spec.head_dim)).astype(np.float32)
        elif arch in ("qwen3", "gemma3", "qwen3moe"):
            for n in "qk":
                extra[f"blk.{i}.attn_{n}_norm.weight"] = \
                    (1.0 + 0.3 * rng.standard_normal(spec.head_dim)).astype(np.float32)
        if arch == "qwen3moe":
            extra[f"blk.{i}.ffn_gate_inp.weight"] = \
                (ROUTER_SCALE * rng.standard_normal((e, d)) / np.sqrt(d)).astype(np.float32)
            for n, shape, fan_in in (("gate", (e, f, d), d), ("up", (e, f, d), d),
                                     ("down", (e, d, f), f)):
                extra[f"blk.{i}.ffn_{n}_exps.weight"] = \
                    (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
        if arch == "gemma3":
            for n in ("post_attention_norm", "post_ffw_norm"):
                extra[f"blk.{i}.{n}.weight"] = \
                    (1.0 + 0.3 * rng.standard_normal(spec.hidden_size)).astype(np.float32)
    return extra


def _add_hyperparameters(writer, spec: TinySpec) -> None:
    """`<arch>.*` keys of the spec, as llama.cpp's converter writes them."""
    import gguf

    writer.add_block_count(spec.num_layers)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    if spec.head_size is not None:
        writer.add_key_length(spec.head_size)
        writer.add_value_length(spec.head_size)
    if spec.sliding_window:
        writer.add_sliding_window(spec.sliding_window)
    if spec.pooling_type is not None:
        writer.add_pooling_type(gguf.PoolingType(spec.pooling_type))
    if spec.num_experts:
        writer.add_expert_count(spec.num_experts)
        writer.add_expert_used_count(spec.num_experts_used)
        writer.add_expert_feed_forward_length(spec.expert_size)


def write_tensors(writer, tensors: dict[str, np.ndarray], matrix_type: str | None) -> None:
    """Add `tensors` to a gguf.GGUFWriter (its matrices stored as `matrix_type`, e.g. "Q8_0";
    None: float32) and write the file."""
    import gguf

    for name, array in tensors.items():
        array = np.asarray(array, np.float32)
        if array.ndim == 2 and matrix_type is not None:
            kind = gguf.GGMLQuantizationType[matrix_type]
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, array)
    write_file(writer)


def write_file(writer) -> None:
    """A gguf.GGUFWriter's header, metadata and tensors to its file, then closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tiny_llama(path: Path, spec: TinySpec = TinySpec(), seed: int = 0,
                     quantized: str | None = None, rope_freqs: np.ndarray | None = None,
                     rope_scaling: tuple[str, float] | None = None,
                     arch: str = "llama", vocab_from: Path | None = None,
                     k_quants: dict[str, object] | None = None,
                     k_quant_scale: float = 1.0) -> dict[str, np.ndarray]:
    """Write a llama GGUF (Q/K permuted like llama.cpp); returns the HF-layout weights.

    Tensors are F32. With `quantized` ("Q4_1", "Q4_0", "Q5_0", "Q5_1" or "Q8_0"), as in
    llama.cpp's files of that type: the layers' matmul weights take that format, the embedding
    and vocab head Q8_0;
    they are returned dequantized, so references computed from them stay exact. RoPE scaling
    as llama.cpp writes it: `rope_freqs` (Llama 3.1+: a factor per frequency, as a tensor) or
    `rope_scaling` (type, factor) in the metadata. `arch="qwen2"`: Q/K/V biases, and Q/K rows
    in HF's order (llama.cpp permutes them for llama files only); `arch="qwen3"`: Q/K norms
    per head instead of biases, rows in HF's order. `vocab_from`: a GGUF whose
    tokenizer (vocabulary, merges, chat template; spec.vocab_size must match) this file takes,
    so that the whole stack can serve it. `k_quants`: matrices whose name ends with a key take
    that type instead: random blocks of a K-quant or IQ4 (returned dequantized, as the file
    holds them, within about ±`k_quant_scale`), or the weights quantized by gguf-py.
    """
    import gguf

    weights = tiny_weights(spec, seed) | family_tensors(spec, arch, seed)
    if spec.num_experts:  # experts instead of the dense MLP
        weights = {n: w for n, w in weights.items()
                   if not n.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"))}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-random-llama")
    _add_hyperparameters(writer, spec)
    if vocab_from is None:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([f"<t{i}>" for i in range(spec.vocab_size)])
        writer.add_bos_token_id(spec.bos_token_id)
        writer.add_eos_token_id(spec.eos_token_id)
    else:
        copy_tokenizer(writer, vocab_from)
    if rope_scaling is not None:
        writer.add_string(f"{arch}.rope.scaling.type", rope_scaling[0])
        writer.add_float32(f"{arch}.rope.scaling.factor", rope_scaling[1])
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    for name, hf_array in weights.items():
        heads = (spec.num_heads if name.endswith("attn_q.weight") else
                 spec.num_kv_heads if name.endswith("attn_k.weight") else None)
        array = permute_qk(hf_array, heads) if heads and arch == "llama" else hf_array
        kind = next((k for suffix, k in (k_quants or {}).items() if name.endswith(suffix)), None)
        if kind is None and quantized and array.ndim >= 2 and not name.endswith("_inp.weight"):
            kind = gguf.GGMLQuantizationType[quantized if name.startswith("blk.") else "Q8_0"]
        if kind is not None and array.ndim == 2 and kind.name.endswith(("_K", "_NL", "_XS")):
            raw = random_k_quant(kind, *array.shape, seed=seed * 7919 + zlib.crc32(name.encode()),
                                 scale=k_quant_scale)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
            values = np.asarray(gguf.quants.dequantize(raw, kind), np.float32).reshape(array.shape)
            weights[name] = unpermute_qk(values, heads) if heads and arch == "llama" else values
        elif kind is not None and array.ndim >= 2:
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
            # Blocks run along rows and the rotary permutation moves whole rows, so the exact
            # HF-layout values are those of the unpermuted array's own blocks.
            weights[name] = gguf.quants.dequantize(gguf.quants.quantize(hf_array, kind), kind) \
                .reshape(hf_array.shape)
        else:
            writer.add_tensor(name, array)
    write_file(writer)
    return weights


def generate(runner, prompts: list[list[int]], *, max_tokens: int,
             params: list[SamplingParams] | None = None, chunk_size: int | None = None,
             shuffle_blocks: int | None = None, stop_token_ids: tuple[int, ...] = (),
             sequence_ids: list[str] | None = None) -> list[list[int]]:
    """Drive `runner.step` like a scheduler would, until every request has its tokens.

    Requests advance together; prefill goes in chunks of `chunk_size` tokens (all at once when
    None); blocks come from a free list shuffled with `shuffle_blocks` as seed, so block tables
    are non-contiguous. Returns the sampled tokens of each request (a stop token included).
    """
    block_size = runner.block_size
    free = list(range(1, runner.kv_cache.num_blocks))
    if shuffle_blocks is not None:
        random.Random(shuffle_blocks).shuffle(free)
    params = params or [GREEDY] * len(prompts)
    sequence_ids = sequence_ids or [f"req-{i}" for i in range(len(prompts))]
    tokens = [list(p) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    num_computed = [0] * len(prompts)
    tables: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    new = [NewRequestData(sequence_id=sequence_ids[i], prompt_token_ids=list(prompts[i]),
                          params=params[i]) for i in active]
    finished: list[str] = []
    step_id = 0
    while active:
        scheduled = []
        for i in active:
            remaining = len(tokens[i]) - num_computed[i]
            num_tokens = min(remaining, chunk_size or remaining)
            end = num_computed[i] + num_tokens
            new_blocks = [free.pop() for _ in range(-(-end // block_size) - len(tables[i]))]
            tables[i] += new_blocks
            scheduled.append(ScheduledRequest(
                sequence_id=sequence_ids[i], start=num_computed[i], num_tokens=num_tokens,
                new_block_ids=new_blocks, sample=end == len(tokens[i])))
            num_computed[i] = end
        plan = StepPlan(step_id=step_id, new_requests=new, scheduled=scheduled,
                        finished_sequence_ids=finished)
        result = runner.step(plan)
        assert result.error == "", result.error
        step_id, new, finished = step_id + 1, [], []
        sampled = iter(result.sampled_token_ids)
        for i, sched in zip(list(active), scheduled, strict=True):
            if not sched.sample:
                continue
            token_id = next(sampled)
            tokens[i].append(token_id)
            outputs[i].append(token_id)
            if len(outputs[i]) >= max_tokens or token_id in stop_token_ids:
                active.remove(i)
                finished.append(sequence_ids[i])
                free += tables[i]
    runner.step(StepPlan(step_id=step_id, finished_sequence_ids=finished))
    return outputs


def tiny_tokenizer(chat_template: str | None = None) -> GGUFTokenizer:
    """A byte-level BPE vocabulary of 262 tokens (<s>, </s>, the 256 bytes, he, ll, hell,
    hello): the model-free stand-in for tokenizer tests."""
    alphabet = byte_alphabet()
    tokens = ["<s>", "</s>", *(alphabet[b] for b in range(256)), "he", "ll", "hell", "hello"]
    return GGUFTokenizer(tokens=tokens, token_types=[3, 3] + [1] * (len(tokens) - 2),
                         merges=["h e", "l l", "he ll", "hell o"], bos_token_id=0,
                         eos_token_id=1, add_bos_token=True, chat_template=chat_template)
