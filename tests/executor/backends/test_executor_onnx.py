"""The CPU backends (backends/onnx_graphs.py, backends/cpu_llama.py) on tiny random llamas: exact
mode equals the float64 reference and the torch runner, for every weight format it reads; fast
mode stays close; quantized weights stay quantized."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from onnx import TensorProto

from llmbus.services.executor.backends.cpu_llama import ACCURACY_EXACT, ACCURACY_FAST, CpuLlamaModel
from llmbus.services.executor.backends.onnx_graphs import MatrixSource, layer_graphs
from llmbus.services.executor.backends.torch_llama import LlamaModel
from llmbus.services.executor.kv_cache import KVCache
from llmbus.services.executor.runner import ModelRunner
from llmbus.services.executor.weights.gguf_loader import load_gguf
from tests.executor.reference_forward import paged_forward, reference_logits
from tests.executor.rounding_noise import (
    assert_changed_only_at_near_ties,
    assert_within_rounding_noise,
    draws,
    fast_mode_model,
)
from tests.gguf_fixtures import TinySpec, generate, write_tiny_llama

SPEC = TinySpec()
BLOCK_SIZE = 4
FORMATS = [None, "Q4_1", "Q4_0", "Q8_0"]  # None: float32 tensors


@pytest.fixture(scope="module", params=FORMATS, ids=lambda f: f or "F32")
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("onnx") / f"tiny-{request.param or 'f32'}.gguf"
    return path, write_tiny_llama(path, SPEC, quantized=request.param)


def _model(path, exact, integer_kernel=None):
    config, dense, native = load_gguf(path, keep_native=True, dense_for_native=False)
    return config, CpuLlamaModel(config, dense, native, max_positions=128, exact=exact,
                                 num_threads=2, integer_kernel=integer_kernel)


def _two_steps(model, config, kv_dtype=torch.float32):
    """Prefixes in one step, the rest (chunks and single tokens) in a second step over the same
    paged cache; returns (our logits, reference logits) of every token, steps concatenated."""
    rng = random.Random(0)
    lengths, splits = [1, 4, 7, 13, 22, 31], [0, 3, 6, 5, 21, 16]
    prompts = [[rng.randrange(SPEC.vocab_size) for _ in range(n)] for n in lengths]
    free = list(range(1, 64))
    rng.shuffle(free)  # scattered block ids
    tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in lengths]
    cache = KVCache(config, num_blocks=64, block_size=BLOCK_SIZE, dtype=kv_dtype)
    first = [(p, 0, s, t) for p, s, t in zip(prompts, splits, tables, strict=True) if s > 0]
    second = [(p, s, len(p), t) for p, s, t in zip(prompts, splits, tables, strict=True)
              if s < len(p)]
    ours = torch.cat([paged_forward(model, cache, first), paged_forward(model, cache, second)])
    return prompts, splits, ours


def test_exact_forward_matches_the_float64_reference(tiny):
    path, weights = tiny
    config, model = _model(path, exact=True)
    prompts, splits, ours = _two_steps(model, config)
    references = [reference_logits(weights, SPEC, p).float() for p in prompts]
    expected = torch.cat([r[:s] for r, s in zip(references, splits, strict=True) if s > 0]
                         + [r[s:] for r, s in zip(references, splits, strict=True) if s < len(r)])
    torch.testing.assert_close(ours, expected, atol=1e-3, rtol=1e-4)


def _dithered(path, forward, graphs: bool) -> torch.Tensor:
    """Draws of the fast mode's rounding (rounding_noise.py) on the torch backend, whose exact
    forward is the CPU backends' exact one: `forward(model, config)` gives the logits."""
    model, noise = fast_mode_model(path, graphs=graphs)
    return draws(model, lambda m: forward(m, model.config), noise)


@pytest.mark.parametrize("integer_kernel", [None, False], ids=["default", "graphs"])
def test_fast_forward_stays_close_to_exact(tiny, integer_kernel):
    """int8 activations and a float16 KV cache: the logits as close to exact as that rounding
    allows (a float32 file's matrices take float32 activations: only its KV cache rounds), in
    llmbus's integer kernel where it takes the file (the default), and in ONNX Runtime's int8
    graphs."""
    path, _ = tiny
    config, exact = _model(path, exact=True)
    _, fast = _model(path, exact=False, integer_kernel=integer_kernel)
    assert (fast.int_step is None) == bool(fast.graphs)
    _, _, expected = _two_steps(exact, config)
    _, _, ours = _two_steps(fast, config, kv_dtype=torch.float16)
    dithered = _dithered(path, lambda model, cfg: _two_steps(model, cfg)[2],
                         graphs=fast.int_step is None)
    assert_within_rounding_noise(ours, expected, dithered)


def _last_logits(model, config, token_ids: list[int]) -> torch.Tensor:
    """The logits [1, V] after `token_ids`, in one forward (a float32 cache)."""
    cache = KVCache(config, num_blocks=64, block_size=BLOCK_SIZE)
    n = len(token_ids)
    table = list(range(1, 1 + -(-n // BLOCK_SIZE)))
    return paged_forward(model, cache, [(token_ids, 0, n, table)], BLOCK_SIZE)[-1:]


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_runner_generates_like_the_torch_runner(tiny, precision):
    """Greedy tokens through ModelRunner, prefill in chunks, blocks scattered: exact mode
    equals the torch runner token for token; fast mode too, up to its first token where the
    exact logits are within the rounding's noise of a tie (after which the two continue
    different texts)."""
    path, _ = tiny
    prompts = [[5, 9, 13, 200, 31], [7, 7, 100], list(range(3, 40))]
    runners = {"torch": ModelRunner(path, model_name="t", block_size=BLOCK_SIZE, num_blocks=128),
               "onnx": ModelRunner(path, model_name="t", block_size=BLOCK_SIZE, num_blocks=128,
                                   backend="onnxruntime", exact=precision == "exact")}
    assert runners["onnx"].kv_cache.k.dtype == (torch.float32 if precision == "exact"
                                                else torch.float16)
    outputs = {name: generate(r, prompts, max_tokens=12, chunk_size=8, shuffle_blocks=3)
               for name, r in runners.items()}
    if precision == "exact":
        assert outputs["onnx"] == outputs["torch"]
        return
    config, dense, _ = load_gguf(path)
    torch_model = LlamaModel(config, dense, max_positions=128)
    for prompt, ours, theirs in zip(prompts, outputs["onnx"], outputs["torch"], strict=True):
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b),
                     None)
        if first is None:
            continue
        context = prompt + theirs[:first]  # the same in both runners up to there
        exact = _last_logits(torch_model, config, context)  # [1, V]
        dithered = _dithered(path, lambda m, cfg, ids=context: _last_logits(m, cfg, ids),
                             graphs=True)
        assert int(exact.argmax()) == theirs[first]
        assert_changed_only_at_near_ties(torch.tensor([ours[first]]), exact, dithered)


@pytest.mark.parametrize("quant", ["Q4_1", "Q8_0"])
def test_quantized_weights_have_no_dense_copy(tmp_path, quant):
    """In the fast mode a quantized file's layer matrices exist only as codes with small scale
    tables, the QKV projection's float32 activations included (for 8-bit weights it keeps
    int8 ones rather than a dense stand-in); no float initializer as large as a matrix."""
    path = tmp_path / f"tiny-{quant}.gguf"
    write_tiny_llama(path, SPEC, quantized=quant)
    config, dense, native = load_gguf(path, keep_native=True, dense_for_native=False)
    assert not any(name.startswith("blk.") and name.endswith(("_q.weight", "_up.weight"))
                   for name in dense)
    matrices = {n: MatrixSource(w, None) for n, w in native.items()}
    norms = {n: t.numpy() for n, t in dense.items()}
    smallest = SPEC.hidden_size * SPEC.hidden_size
    for graph in layer_graphs(config, matrices, norms, ACCURACY_FAST,
                              qkv_q4_accuracy_level=ACCURACY_EXACT):  # as CpuLlamaModel builds
        floats = [int(np.prod(i.dims)) for i in graph.graph.initializer
                  if i.data_type == TensorProto.FLOAT]
        assert max(floats) < smallest / 4
        assert sum(n.op_type == "MatMulNBits" for n in graph.graph.node) >= 1


def test_backend_options_are_checked(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, SPEC, quantized="Q4_1")
    with pytest.raises(ValueError, match="compute in float32"):
        ModelRunner(path, model_name="t", num_blocks=16, backend="onnxruntime",
                    dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="unknown backend"):
        ModelRunner(path, model_name="t", num_blocks=16, backend="tvm")
    with pytest.raises(ValueError, match="runs on the CPU"):
        ModelRunner(path, model_name="t", num_blocks=16, backend="onnxruntime", device="cuda")
    # the same budget holds twice the blocks with a float16 cache
    budget = 1 << 20
    blocks = {p: ModelRunner(path, model_name="t", kv_cache_bytes=budget, backend="onnxruntime",
                             exact=p == "exact").kv_cache.num_blocks for p in ("exact", "fast")}
    assert blocks["fast"] == 2 * blocks["exact"]


def test_without_a_compiler_the_torch_attention_gives_the_same_logits(tmp_path):
    """Where the C++ kernel could not be built, attention falls back to the torch reference."""
    path = tmp_path / "tiny-q4_1.gguf"
    write_tiny_llama(path, SPEC, quantized="Q4_1")
    config, model = _model(path, exact=True)
    if model.paged_attention is None:
        pytest.skip("no C++ compiler here: every other test already runs the fallback")
    _, _, with_kernel = _two_steps(model, config)
    model.paged_attention = None
    _, _, with_torch = _two_steps(model, config)
    torch.testing.assert_close(with_torch, with_kernel, atol=1e-4, rtol=1e-4)


def test_a_head_the_kernel_cannot_tile_falls_back_to_the_graphs(tmp_path):
    """A vocabulary that is no multiple of 8 (the kernel's column groups): the fast mode runs
    ONNX Runtime's graphs instead of refusing the file."""
    from dataclasses import replace

    path = tmp_path / "tiny-v250.gguf"
    write_tiny_llama(path, replace(SPEC, vocab_size=250), quantized="Q4_1")
    config, model = _model(path, exact=False)
    assert model.int_step is None and model.graphs
    cache = KVCache(config, num_blocks=8, block_size=BLOCK_SIZE, dtype=torch.float16)
    logits = paged_forward(model, cache, [([3, 1, 4, 1, 5, 9, 2], 0, 7, [1, 2])])
    assert logits.shape[-1] == 250 and torch.isfinite(logits).all()


@pytest.mark.parametrize("vocab_size", [256, 250], ids=["tiled-at-load", "graphs"])
def test_the_fast_runner_tiles_at_load_or_reloads_for_the_graphs(tmp_path, vocab_size):
    """The fast runner tiles each matrix as it is loaded when the integer kernel takes the
    whole file; a head it cannot tile (250 rows) means a second load in the graphs' form. Both
    answer as a model built from a plain load."""
    from dataclasses import replace

    from llmbus.bus.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan
    from llmbus.services.executor.kernels.cpu.library import load_library

    path = tmp_path / f"tiny-v{vocab_size}.gguf"
    write_tiny_llama(path, replace(SPEC, vocab_size=vocab_size), quantized="Q4_1")
    runner = ModelRunner(path, model_name="tiny", num_blocks=16, block_size=BLOCK_SIZE,
                         backend="auto")
    if load_library() is None:
        pytest.skip("no C++ compiler: nothing is tiled")
    assert (runner.model.int_step is not None) == (vocab_size == 256)
    prompt = [3, 1, 4, 1, 5, 9, 2]
    step = runner.step(StepPlan(step_id=0, new_requests=[NewRequestData(
        "r", prompt, SamplingParams(temperature=0.0, logprobs=1))],
        scheduled=[ScheduledRequest("r", 0, len(prompt), [1, 2])]))
    config, model = _model(path, exact=False)
    cache = KVCache(config, num_blocks=8, block_size=BLOCK_SIZE, dtype=torch.float16)
    logits = paged_forward(model, cache, [(prompt, 0, len(prompt), [1, 2])])[-1]
    assert step.sampled_token_ids == [int(logits.argmax())]
    assert step.logprobs[0].logprob == pytest.approx(
        float(torch.log_softmax(logits, -1).max()), abs=1e-4)
