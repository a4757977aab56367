"""What the integer kernel's tests share: a few steps' logits of any backend (a prompt step of
BATCH sequences, then decodes), and the kernel's arithmetic emulated in torch, so that a
kernel's distance from the exact forward can be judged against its own rounding noise."""

from __future__ import annotations

import torch

from llmbus.services.executor.attention.metadata import build_attention_metadata
from llmbus.services.executor.backends.torch_llama import LlamaModel
from llmbus.services.executor.kv_cache import KVCache

GROUP = 32
BATCH = 12  # decodes of a step: above the small steps' int16 down projections


def decode_logits(model, config, kv_dtype, adapters=None, adapter_of=None) -> torch.Tensor:
    """A prompt step of BATCH sequences, then decode steps of one and of BATCH sequences:
    the decodes' logits [52, V]. With `adapters` (lora/adapter_slots.AdapterSlots), sequence
    s runs LoRA adapter `adapter_of(s)` ("": the base)."""
    prompt = [(i * 7919) % 20000 + 100 for i in range(40)]
    kv = KVCache(config, 1 + 4 * BATCH, 16, kv_dtype)
    tables = [list(range(1 + 4 * s, 5 + 4 * s)) for s in range(BATCH)]

    def forward(ids, meta, indices):
        names = [adapter_of(s) if adapters else "" for s in range(len(meta.context_lens))]
        model.step_adapters = (adapters.step(names, meta.cu_seqlens_q.diff().tolist())
                               if adapters else None)
        return model.forward(ids, meta.positions, meta, kv, indices)

    meta = build_attention_metadata([len(prompt)] * BATCH, [len(prompt)] * BATCH, tables, 16)
    forward(torch.tensor(prompt * BATCH), meta, torch.empty(0, dtype=torch.long))
    steps, lengths = [], [len(prompt)] * BATCH
    for batch in [1, BATCH] * 4:
        lengths[:batch] = [n + 1 for n in lengths[:batch]]
        meta = build_attention_metadata([1] * batch, lengths[:batch], tables[:batch], 16)
        ids = torch.tensor([(n * 31 + s) % 20000 + 100 for s, n in enumerate(lengths[:batch])])
        steps.append(forward(ids, meta, torch.arange(batch)))
    return torch.cat(steps)


def emulated_linear(model: LlamaModel):
    """The integer kernel's arithmetic in torch, on the dense float32 weights: x quantized per
    block of 32 before each matmul (int16 into the 4-bit QKV projections, int8 elsewhere),
    then multiplied by w = s * code + m as a whole, as the kernel's d * sum(q) for the
    minimums' share amounts to."""
    qkv = {id(layer.qkv) for layer in model.layers}

    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        wide = id(weight) in qkv
        blocks = x.double().view(x.shape[0], x.shape[1] // GROUP, GROUP)
        d = blocks.abs().amax(-1, keepdim=True) / (32767 if wide else 127)
        quantized = (torch.where(d > 0, torch.round(blocks / d), 0) * d).view_as(x)
        return torch.nn.functional.linear(quantized.float(), weight)
    return linear
