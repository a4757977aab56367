"""LoRA deltas in the integer kernel (kernels/cpu/lora_delta.cpp) against the torch reference
(lora/adapter_slots.StepAdapters.add) and against a per-request x·Aᵀ·(s·B)ᵀ: a step mixing
several adapters and the base, every ISA build this CPU runs."""

from __future__ import annotations

import ctypes

import pytest
import torch

from llmbus.services.executor.kernels.cpu.library import load_library
from llmbus.services.executor.lora.adapter_slots import AdapterSlots
from llmbus.services.executor.lora.kernel_tables import KERNEL_TARGETS
from llmbus.services.executor.weights.lora_files import LoraWeights
from llmbus.services.executor.weights.model_config import LlamaConfig
from tests.cpu_isas import ISAS

needs_compiler = pytest.mark.skipif(load_library() is None, reason="no C++ compiler here")
CONFIG = LlamaConfig(num_layers=3, hidden_size=64, intermediate_size=96, num_heads=4,
                     num_kv_heads=2, head_dim=16, vocab_size=256, rope_theta=1e4,
                     rms_norm_eps=1e-5, context_length=64, bos_token_id=1, eos_token_ids=(2,),
                     tie_word_embeddings=False)
SHAPES = {"q": (64, 64), "k": (32, 64), "v": (32, 64), "o": (64, 64), "gate": (96, 64),
          "up": (96, 64), "down": (64, 96)}  # [out, in]


def _adapter(seed: int, rank: int, targets: str) -> LoraWeights:
    gen = torch.Generator().manual_seed(seed)
    matrices = {}
    for layer in range(CONFIG.num_layers):
        for target in targets.split(","):
            out, inp = SHAPES[target]
            matrices[layer, target] = (torch.randn(rank, inp, generator=gen) / inp ** 0.5,
                                       torch.randn(out, rank, generator=gen))
    return LoraWeights(rank=rank, scaling=2.0 / rank, matrices=matrices)


ADAPTERS = {"a": _adapter(1, 8, "q,v,gate,down"), "b": _adapter(2, 16, "q,k,v,o,up"),
            "c": _adapter(3, 4, "down")}


def _slots(max_adapters: int = 3) -> AdapterSlots:
    slots = AdapterSlots(CONFIG, max_adapters, max_rank=64)
    for name, weights in ADAPTERS.items():
        assert slots.prepare(name, weights) == ""
    return slots


def _per_request(adapters: list[str], lens: list[int], layer: int, target: str,
                 x: torch.Tensor) -> torch.Tensor:
    """The deltas of each sequence's rows, one adapter at a time, as PEFT computes them."""
    out = torch.zeros(x.shape[0], SHAPES[target][0], dtype=torch.float64)
    start = 0
    for adapter, n in zip(adapters, lens, strict=True):
        pair = ADAPTERS[adapter].matrices.get((layer, target)) if adapter else None
        if pair is not None:
            a, b = (m.double() for m in pair)
            out[start:start + n] = (x[start:start + n].double() @ a.T @ b.T
                                    * ADAPTERS[adapter].scaling)
        start += n
    return out


def _kernel_delta(lib: ctypes.CDLL, step, layer: int, target: str, x: torch.Tensor,
                  column: int, width: int) -> torch.Tensor:
    out, inp = SHAPES[target]
    y = torch.zeros(x.shape[0], width)
    status = lib.lora_add(step.kernel_pointer, layer, KERNEL_TARGETS.index(target),
                          x.data_ptr(), inp, x.shape[0], y.data_ptr(), width, column, out, 2)
    assert status == 0
    return y[:, column:column + out]


# Each output sums rank products of A·x terms, each a k-long dot product: float32 rounding
# bounds the error by about (k + rank) units in the last place of the magnitudes summed. The
# kernel holds A and s·B in bfloat16: each weight's rounding (2^-9 relative) adds twice that
# to each term.
def _bound(adapters, lens, layer, target, x, weights_rounding=0.0) -> torch.Tensor:
    magnitude = torch.zeros(x.shape[0], SHAPES[target][0], dtype=torch.float64)
    start = 0
    for adapter, n in zip(adapters, lens, strict=True):
        pair = ADAPTERS[adapter].matrices.get((layer, target)) if adapter else None
        if pair is not None:
            a, b = (m.double().abs() for m in pair)
            magnitude[start:start + n] = (x[start:start + n].double().abs() @ a.T @ b.T
                                          * ADAPTERS[adapter].scaling)
        start += n
    k = SHAPES[target][1]
    return magnitude * ((k + 64) * torch.finfo(torch.float32).eps + 2.1 * weights_rounding) \
        + 1e-30


BFLOAT16 = 2.0 ** -9  # bfloat16's unit roundoff (8 bits of mantissa, rounded to nearest)


ADAPTERS_OF_A_STEP = ["a", "", "b", "a", "c", ""]
LENS = [3, 2, 1, 5, 1, 1]  # prompt chunks and decodes


@needs_compiler
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("target", KERNEL_TARGETS)
def test_a_step_mixing_adapters_adds_each_requests_own_delta(isa, target):
    lib = load_library(isa)
    slots = _slots()
    step = slots.step(ADAPTERS_OF_A_STEP, LENS)
    assert step is not None
    x = torch.randn(sum(LENS), SHAPES[target][1], generator=torch.Generator().manual_seed(7))
    for layer in range(CONFIG.num_layers):
        expected = _per_request(ADAPTERS_OF_A_STEP, LENS, layer, target, x)
        bound = _bound(ADAPTERS_OF_A_STEP, LENS, layer, target, x)
        width = SHAPES[target][0] + 16
        got = _kernel_delta(lib, step, layer, target, x, 8, width)
        kernel_bound = _bound(ADAPTERS_OF_A_STEP, LENS, layer, target, x, BFLOAT16)
        assert ((got.double() - expected).abs() <= kernel_bound).all()
        assert got.any()  # some adapter of the step changes every target
        reference = torch.zeros(x.shape[0], width)
        step.add(layer, target, x, reference, 8)
        assert ((reference[:, 8:8 + SHAPES[target][0]].double() - expected).abs()
                <= bound).all()
        assert not reference[:, :8].any() and not reference[:, 8 + SHAPES[target][0]:].any()


@needs_compiler
@pytest.mark.parametrize("isa", [p for p in ISAS if p.values[0] in ("avx2", "avx512")])
def test_every_vector_build_adds_the_same_bits(isa):
    x = torch.randn(sum(LENS), 64, generator=torch.Generator().manual_seed(3))
    results = []
    for build in (isa, "native"):
        step = _slots().step(ADAPTERS_OF_A_STEP, LENS)
        results.append(_kernel_delta(load_library(build), step, 1, "q", x, 0, 64))
    assert torch.equal(*results)


def test_slots_swap_adapters_least_recently_used_first_never_one_the_step_uses():
    slots = _slots(max_adapters=2)
    slots.step(["a", "b"], [1, 1])
    slots.step(["a"], [1])  # b is now the least recently used
    slots.step(["c", "a"], [1, 1])
    assert sorted(slots.resident()) == ["a", "c"]
    with pytest.raises(RuntimeError, match="--max-loras"):
        slots.step(["a", "b", "c"], [1, 1, 1])
    with pytest.raises(KeyError, match="never prepared"):
        slots.step(["nope"], [1])
    assert slots.step(["", ""], [2, 1]) is None  # the base alone: no deltas at all


def test_an_unloaded_adapter_stays_while_a_request_runs_on_it():
    slots = _slots()
    slots.step(["a"], [1])
    slots.forget("a")
    slots.collect(live={"a"})
    assert "a" in slots.known and slots.resident() == ["a"]
    assert not slots.holds("a")  # loaded again meanwhile, it would be fetched again
    slots.collect(live=set())
    assert "a" not in slots.known and slots.resident() == []


def test_an_adapter_that_does_not_fit_is_refused_with_the_reason():
    slots = AdapterSlots(CONFIG, 2, max_rank=8)
    assert "--max-lora-rank" in slots.prepare("big", ADAPTERS["b"])
    wrong = LoraWeights(rank=4, scaling=1.0,
                        matrices={(0, "q"): (torch.zeros(4, 32), torch.zeros(64, 4))})
    assert "layer 0 q" in slots.prepare("wrong", wrong)
    assert slots.known == {}
