"""What a test may expect of the fast mode's logits: how far its rounding takes them from the
exact forward's, measured on the test's own model and tokens.

The fast mode rounds the activations of a matmul to int8 per block of 32 (step d = max|x| /
127; int16, or float32, into some QKV projections) and stores K and V in float16 (step: 2^-10
of a value's power of two). Which way each value rounds depends on where the grid falls, and
where it falls is arbitrary: a step 0.1% wider rounds other values the other way, and the
deviation's RMS moves by several percent. So a *draw* here is the exact torch forward rounded
as the fast mode rounds, on the weights as the fast mode holds them (`fast_mode_model`), with
both grids scaled by a factor drawn per draw within half a step of 1 (1 + U(-1/2, 1/2) / 127
for int8, 1 + U(-1/2, 1/2) * 2^-10 for float16): equally valid roundings, the fast mode's own
being the one at factor 1. One factor for the whole forward, as the fast mode has one grid:
a factor per block would average out the shifts that move together (independent uniform noise
in place of rounding put a mixed K-quant file's fast mode 3 standard deviations above the
draws). NUM_DRAWS draws give the deviation from exact that such rounding brings, and its
spread, for the model and tokens at hand: the bounds below are that arithmetic's, not numbers
read off one machine's run.

Two consequences are checked:
- The deviation's RMS over all logits: the fast mode's, one more such rounding, stays below the
  draws' mean + Z_RMS of their standard deviations.
- The top token can change only where exact's top two are nearly tied: a row whose argmax j
  differs from exact's i needs exact[i] - exact[j] to be within Z_TIE standard deviations of
  the draws' (deviation[i] - deviation[j]), the noise of that difference.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmbus.services.executor.backends.torch_llama import LlamaModel
from llmbus.services.executor.weights.gguf_loader import load_gguf
from llmbus.services.executor.weights.gguf_quants import (
    Q4_1Weight,
    requantize_q8_0,
)
from llmbus.services.executor.weights.k_quants import KQuantWeight

GROUP = 32  # activations are rounded per block of this many values
NUM_DRAWS = 16
# Normal tails with the standard deviation estimated from NUM_DRAWS draws (Student's t with 15
# degrees of freedom): P(t > 6 * sqrt(16 / 17)) ~ 2e-5 for one forward's RMS.
Z_RMS = 6.0
# P(|N(0, 1)| > 8) ~ 1e-15 per row; 8 rather than 6 because a pair's standard deviation from 16
# draws can come out 0.59x too small (chi-square, 15 degrees of freedom, 1% quantile): 8 x 0.59
# = 4.7 deviations still leaves ~2e-6 per row.
Z_TIE = 8.0


def _fast_values(weight, graphs: bool) -> torch.Tensor:
    """A native form's values as the fast mode computes with them: ONNX Runtime's graphs
    take a K-quant with 16-weight sub-blocks requantized to Q8_0 (cpu_llama._build_graphs)."""
    if graphs and isinstance(weight, KQuantWeight):
        return requantize_q8_0(weight.dequantize().numpy()).dequantize()
    return weight.dequantize()


def fast_mode_model(path: Path, *, graphs: bool, max_positions: int = 128,
                    ) -> tuple[LlamaModel, dict[int, torch.Tensor]]:
    """The torch model of the fast mode's arithmetic on this file, and what each matmul's
    rounding meets (`noise` for rounding_linear), for the integer kernel or (`graphs`) ONNX
    Runtime's graphs.

    The weights are the fast mode's values: Q5_1 requantized to Q8_0 (and the K-quants of
    k_quants.py for the graphs), the rest the file's. The integer kernel rounds every input to
    int8 but a 4-bit QKV part's, to int16 (a step 32767 / 127 times finer), and takes Q4's
    minimums on the rounded block sums, so the noise meets the whole weight. ONNX Runtime's
    graphs give a 4-bit QKV part float32 inputs (no noise), and add Q4's minimums on the float
    block sums, so the noise meets scale x code alone. A float32 matrix takes float32 inputs in
    both. Experts (loaded one by one in the fast mode) keep the file's values and the default
    noise, the whole weight: right for the kernel's 8-bit experts."""
    config, weights, _ = load_gguf(path)  # the file's values
    _, _, native = load_gguf(path, keep_native=True, dense_for_native=False)  # the fast mode's
    weights.update({n: _fast_values(w, graphs) for n, w in native.items() if n in weights})
    model = LlamaModel(config, weights, max_positions=max_positions)

    def rounded(name: str, qkv: bool) -> torch.Tensor:  # what one part's noise meets
        weight = native.get(name)
        if weight is None or (qkv and graphs and isinstance(weight, Q4_1Weight)):
            return torch.zeros_like(weights[name])  # float32 inputs
        if not isinstance(weight, Q4_1Weight):
            return weights[name]  # Q8_0: codes centred on 0, scale x code is the weight
        if graphs:
            return weight.codes.float() * weight.scales.repeat_interleave(GROUP, -1)
        return weights[name] * (127 / 32767 if qkv else 1)

    head = "token_embd.weight" if config.tie_word_embeddings else "output.weight"
    noise = {id(model.lm_head): rounded(head, False)}
    parts = {"qkv": ("attn_q", "attn_k", "attn_v"), "attn_output": ("attn_output",),
             "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}
    for i, layer in enumerate(model.layers):
        for attribute, names in parts.items():
            if getattr(layer, attribute).numel():  # (empty for a mixture of experts)
                noise[id(getattr(layer, attribute))] = torch.cat(
                    [rounded(f"blk.{i}.{n}.weight", attribute == "qkv") for n in names])
    return model, noise


def rounding_linear(scale: float, noise: dict[int, torch.Tensor] | None = None,
                    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """LlamaModel.linear plus the error of rounding x to int8 per block of GROUP, on a grid of
    step d = scale * max|x| / 127: x @ Wᵀ + (round(x / d) * d - x) @ Nᵀ, N = noise[id(W)] where
    given, else W."""
    noise = noise or {}

    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        blocks = x.double().view(x.shape[0], x.shape[1] // GROUP, GROUP)  # [T, K / 32, 32]
        d = blocks.abs().amax(-1, keepdim=True) * (scale / 127)
        error = (torch.where(d > 0, torch.round(blocks / d) * d, 0) - blocks).view_as(x)
        return (torch.nn.functional.linear(x, weight)
                + torch.nn.functional.linear(error.float(), noise.get(id(weight), weight)))
    return linear


class _Float16Kv:
    """The model's ops, but K and V written as float16 rounds them on a grid scaled by `scale`
    (into a float32 cache): v -> float16(v * scale) / scale."""

    def __init__(self, ops: Any, scale: float) -> None:
        self.ops, self.scale = ops, scale

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ops, name)

    def rope_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      num_heads: int) -> torch.Tensor:
        q = self.ops.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads)
        slots = slot_mapping[slot_mapping >= 0]
        for cache in (k_cache, v_cache):
            rows = cache.view(-1, *cache.shape[2:])  # [slots, Hkv, Dh]
            rows[slots] = ((rows[slots].double() * self.scale).half().double()
                           / self.scale).float()
        return q


def draws(model: LlamaModel, forward: Callable[[LlamaModel], torch.Tensor],
          noise: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """NUM_DRAWS runs of `forward` rounded as the module's docstring says, as logits
    [NUM_DRAWS, rows, V]. `forward` gives `model` a float32 KV cache (the draws round what is
    written there); `noise` as rounding_linear takes it."""
    runs, ops = [], model.ops
    for seed in range(NUM_DRAWS):
        u = torch.rand(2, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        model.linear = rounding_linear(1 + (float(u[0]) - 0.5) / 127, noise)
        model.ops = _Float16Kv(ops, 1 + (float(u[1]) - 0.5) * 2.0**-10)
        runs.append(forward(model))
    del model.linear  # back to the class's exact F.linear
    model.ops = ops
    return torch.stack(runs)


def rms(deviation: torch.Tensor) -> torch.Tensor:
    """RMS over the last two dimensions (rows and vocabulary)."""
    return deviation.pow(2).mean((-2, -1)).sqrt()


def assert_within_rounding_noise(logits: torch.Tensor, exact: torch.Tensor,
                                 rounded: torch.Tensor) -> None:
    """`logits` [rows, V] of the fast mode are as far from `exact` as rounding takes them,
    `rounded` [NUM_DRAWS, rows, V] being draws of that rounding (see the module's docstring).
    """
    noise = rms(rounded - exact)  # [NUM_DRAWS]
    bound = noise.mean() + Z_RMS * noise.std()
    assert rms(logits - exact) <= bound, (float(rms(logits - exact)), noise.tolist())
    assert_changed_only_at_near_ties(logits.argmax(-1), exact, rounded)


def assert_changed_only_at_near_ties(token_ids: torch.Tensor, exact: torch.Tensor,
                                     rounded: torch.Tensor) -> None:
    """The fast mode's top tokens `token_ids` [rows] are exact's, but in rows where exact's
    top token and this one are within Z_TIE standard deviations of their logits' rounding
    noise (the draws' spread of the difference)."""
    wants = exact.argmax(-1)  # [rows]
    for row in (token_ids != wants).nonzero().flatten().tolist():
        i, j = int(wants[row]), int(token_ids[row])
        gap = exact[row, i] - exact[row, j]
        spread = ((rounded - exact)[:, row, i] - (rounded - exact)[:, row, j]).std()
        assert gap <= Z_TIE * spread, (row, float(gap), float(spread))
