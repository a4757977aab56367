"""Temperature, top-k, top-p and min-p sampling on the device, one program per row.

For a row of logits x [V] with temperature T (0 = greedy), and Exp(1) noise E [V]:

    l = x / T;  keep the top_k largest l (ties at the k-th kept);  then the smallest set of
    most likely tokens whose softmax mass reaches top_p;  then tokens with p >= min_p * max(p);
    token = argmax_v softmax(l)[v] / E[v]   over the kept set   (greedy rows: argmax_v x[v])

This is the filter ladder of `sampler.sample` (temperature, top-k, top-p, then min-p); the
torch reference below (`sample_reference`) picks the same token from the same noise, up to
float rounding in the softmax sums at a filter's edge and ties at the top-p edge (all tied
tokens stay). `sampler.sample` runs this kernel on CUDA (`sampler.sample_in_kernel`, the
same Exp(1) noise from the same generators); its torch path on other devices draws noise
differently (over candidates, in log space), so the two agree in distribution there, not draw
for draw.

Every filter keeps an upper set of values, so the kernel never sorts: it keeps one threshold
`keep_key` on an order-preserving integer image of the floats and finds the top-k and top-p
thresholds by a 16-ary search (8 counting passes each over the row). Parameters are read per row
on the device: no host round trip, no "any row uses top-k" flags.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmbus.services.executor.kernels.triton._checks import (
    INDEX_DTYPES,
    check,
    check_device,
    check_tensor,
    interpreting,
)
from llmbus.services.executor.sampling.truncation import apply_top_k, apply_top_p

# Threshold search: 16 probes per pass keep 1/16 of the key range, so 8 passes cover 2**32.
_PROBES = 16
_PASSES = 8


@triton.jit
def _order_key(x):
    """float32 -> int64 that sorts like the floats (-0.0 folded into +0.0)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _chunk(row_ptr, start, vocab_size, temperature, BLOCK_V: tl.constexpr):
    """Columns, mask and l = x / T of one chunk; div_rn rounds the division like torch."""
    cols = start + tl.arange(0, BLOCK_V)  # [BV]
    mask = cols < vocab_size
    x = tl.load(row_ptr + cols, mask=mask, other=float("-inf"))
    return cols, mask, tl.math.div_rn(x, temperature)


@triton.jit
def _total(row_ptr, vocab_size, temperature, row_max, keep_key, BLOCK_V: tl.constexpr):
    """Softmax denominator over the kept tokens: sum(exp(l - max(l))), key >= keep_key."""
    total = tl.zeros((), tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        cols, mask, x = _chunk(row_ptr, start, vocab_size, temperature, BLOCK_V)
        kept = mask & (_order_key(x) >= keep_key)
        total += tl.sum(tl.where(kept, tl.exp(x - row_max), 0.0), axis=0)
    return total


@triton.jit
def _top_k_key(row_ptr, vocab_size, temperature, top_k, max_key, BLOCK_V: tl.constexpr,
               PROBES: tl.constexpr, PASSES: tl.constexpr):
    """The k-th largest key: the largest t with count(key >= t) >= k.

    Each pass counts against PROBES thresholds at once and keeps one sub-range.
    Invariant: the predicate holds at lo and fails above hi.
    """
    lo = tl.full((), -(2**31), tl.int64)
    hi = max_key
    j = tl.arange(0, PROBES).to(tl.int64)  # [P]
    for _ in range(PASSES):
        step = (hi - lo + PROBES) // PROBES  # ceil((hi - lo + 1) / PROBES)
        probes = lo + j * step  # [P] the bottom of each sub-range
        counts = tl.zeros([PROBES], tl.int64)
        for start in range(0, vocab_size, BLOCK_V):
            cols, mask, x = _chunk(row_ptr, start, vocab_size, temperature, BLOCK_V)
            above = (_order_key(x)[:, None] >= probes[None, :]) & mask[:, None]  # [BV, P]
            counts += tl.sum(above.to(tl.int32), axis=0).to(tl.int64)
        lo += tl.max(tl.where(counts >= top_k, j, 0), axis=0) * step
        hi = tl.minimum(hi, lo + step - 1)
    return lo


@triton.jit
def _top_p_key(row_ptr, vocab_size, temperature, top_p, row_max, inv_z, keep_key, max_key,
               BLOCK_V: tl.constexpr, PROBES: tl.constexpr, PASSES: tl.constexpr):
    """The smallest t in [keep_key, max_key] with mass(kept tokens with key > t) < top_p.

    Searched like `_top_k_key`, probing the top of each sub-range; max_key always counts as
    a fit, so the top token stays even for top_p = 0.
    """
    lo = keep_key
    hi = max_key
    j = tl.arange(0, PROBES).to(tl.int64)  # [P]
    for _ in range(PASSES):
        step = (hi - lo + PROBES) // PROBES
        probes = lo + (j + 1) * step - 1  # [P] the top of each sub-range
        mass = tl.zeros([PROBES], tl.float32)
        for start in range(0, vocab_size, BLOCK_V):
            cols, mask, x = _chunk(row_ptr, start, vocab_size, temperature, BLOCK_V)
            key = _order_key(x)
            prob = tl.where(mask & (key >= keep_key), tl.exp(x - row_max) * inv_z, 0.0)
            above = key[:, None] > probes[None, :]  # [BV, P]
            mass += tl.sum(tl.where(above, prob[:, None], 0.0), axis=0)
        fits = (mass < top_p) | (probes >= hi)
        first = tl.min(tl.where(fits, j, PROBES - 1), axis=0)
        lo += first * step
        hi = tl.minimum(hi, lo + step - 1)
    return hi


@triton.jit
def _sampling_kernel(logits_ptr, noise_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
                     out_ptr, vocab_size, stride_logits, stride_noise, BLOCK_V: tl.constexpr,
                     PROBES: tl.constexpr, PASSES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * stride_logits
    temperature = tl.load(temperature_ptr + row)
    sampling = temperature != 0.0
    temperature = tl.where(sampling, temperature, 1.0)
    row_max = tl.full((), float("-inf"), tl.float32)  # max(l); its index is the greedy token
    token = tl.zeros((), tl.int64)
    for start in range(0, vocab_size, BLOCK_V):
        cols, mask, x = _chunk(logits_row, start, vocab_size, temperature, BLOCK_V)
        chunk_max = tl.max(x, axis=0)
        token = tl.where(chunk_max > row_max, start + tl.argmax(x, axis=0), token)
        row_max = tl.maximum(row_max, chunk_max)
    if sampling:
        max_key = _order_key(row_max)
        keep_key = tl.full((), -(2**31), tl.int64)  # below every float's key: keep all
        top_k = tl.load(top_k_ptr + row).to(tl.int64)
        if (top_k > 0) & (top_k < vocab_size):
            keep_key = _top_k_key(logits_row, vocab_size, temperature, top_k, max_key, BLOCK_V,
                                  PROBES, PASSES)
        top_p = tl.load(top_p_ptr + row)
        if top_p < 1.0:
            inv_z = 1.0 / _total(logits_row, vocab_size, temperature, row_max, keep_key,
                                 BLOCK_V)
            keep_key = _top_p_key(logits_row, vocab_size, temperature, top_p, row_max, inv_z,
                                  keep_key, max_key, BLOCK_V, PROBES, PASSES)
        z = _total(logits_row, vocab_size, temperature, row_max, keep_key, BLOCK_V)
        min_prob = tl.load(min_p_ptr + row) * (1.0 / z)  # min_p * the top token's probability
        z_final = tl.zeros((), tl.float32)
        for start in range(0, vocab_size, BLOCK_V):
            cols, mask, x = _chunk(logits_row, start, vocab_size, temperature, BLOCK_V)
            e = tl.exp(x - row_max)
            kept = mask & (_order_key(x) >= keep_key) & (e / z >= min_prob)
            z_final += tl.sum(tl.where(kept, e, 0.0), axis=0)
        best = tl.full((), -1.0, tl.float32)
        for start in range(0, vocab_size, BLOCK_V):
            cols, mask, x = _chunk(logits_row, start, vocab_size, temperature, BLOCK_V)
            e = tl.exp(x - row_max)
            kept = mask & (_order_key(x) >= keep_key) & (e / z >= min_prob)
            noise = tl.load(noise_ptr + row * stride_noise + cols, mask=mask, other=1.0)
            score = tl.where(kept, (e / z_final) / noise, -1.0)  # [BV]
            chunk_best = tl.max(score, axis=0)
            token = tl.where(chunk_best > best, start + tl.argmax(score, axis=0), token)
            best = tl.maximum(best, chunk_best)
    tl.store(out_ptr + row, token)


def sample(logits: torch.Tensor, noise: torch.Tensor, temperature: torch.Tensor,
           top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
           block_v: int | None = None) -> torch.Tensor:
    """logits, noise [S, V] float32; per-row parameters [S] -> token ids [S] int64.

    temperature 0 = greedy, top_k 0 / top_p 1 / min_p 0 = off; noise is Exp(1).
    Grid: (S,), one program per row, walking the row in `block_v`-wide chunks.
    """
    device = logits.device
    check_device(device)
    check_tensor(logits, "logits", (None, None), (torch.float32,), device)
    num_rows, vocab_size = logits.shape
    check_tensor(noise, "noise", (num_rows, vocab_size), (torch.float32,), device)
    check_tensor(temperature, "temperature", (num_rows,), (torch.float32,), device)
    check_tensor(top_k, "top_k", (num_rows,), INDEX_DTYPES, device)
    check_tensor(top_p, "top_p", (num_rows,), (torch.float32,), device)
    check_tensor(min_p, "min_p", (num_rows,), (torch.float32,), device)
    out = torch.empty(num_rows, dtype=torch.int64, device=device)  # [S]
    if num_rows == 0:
        return out
    if block_v is None:  # the interpreter is fastest with the whole row in one chunk
        # On a GPU the [block_v, 16] probe tiles must fit in registers.
        block_v = min(triton.next_power_of_2(vocab_size), 1 << 16 if interpreting() else 1024)
    check(block_v & (block_v - 1) == 0, f"block_v must be a power of two, got {block_v}")
    _sampling_kernel[(num_rows,)](logits, noise, temperature, top_k, top_p, min_p, out,
                                  vocab_size, logits.stride(0), noise.stride(0),
                                  BLOCK_V=block_v, PROBES=_PROBES,
                                  PASSES=_PASSES, num_warps=8)
    return out


def sample_reference(logits: torch.Tensor, noise: torch.Tensor, temperature: torch.Tensor,
                     top_k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor) -> torch.Tensor:
    """sampler.sample's ladder with min-p as the last filter, on given noise."""
    greedy = logits.argmax(dim=-1)  # [S]
    is_greedy = temperature == 0.0
    logits = logits / torch.where(is_greedy, 1.0, temperature)[:, None]
    logits = apply_top_k(logits, top_k.long())
    # top_p = 1 is "off", not "drop what the float32 cumsum puts at 1.0".
    logits = torch.where((top_p < 1.0)[:, None], apply_top_p(logits, top_p), logits)
    probs = logits.softmax(dim=-1)  # [S, V]
    logits = logits.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True),
                                float("-inf"))
    sampled = (logits.softmax(dim=-1) / noise).argmax(dim=-1)
    return torch.where(is_greedy, greedy, sampled)
