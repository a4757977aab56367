"""A model split by layers (weights/layer_slice.py): which shard holds what, the hidden states'
handoff, and a split engine's steps, in one process: a lead ModelRunner whose forward hands its
hidden states, through the wire's codec and in several parts, to LayerShards. Every family and
backend computes the bits of the whole model (the same operations on the same values: only
where they run changes), so the comparison is equality, logprobs included."""

from __future__ import annotations

import re
from concurrent.futures import Future

import msgspec
import pytest
import torch

from llmbus.bus.codec import decode, encode
from llmbus.bus.messages import BlockCopy, SamplingParams, ShardInfo, ShardSetup, ShardStep
from llmbus.services.executor.hidden_handoff import hidden_from_parts, hidden_parts
from llmbus.services.executor.layer_shard import LayerShard
from llmbus.services.executor.pipeline_lead import PipelinedForward, sub_geometry, token_ranges
from llmbus.services.executor.pipeline_lead_bus import check_shards
from llmbus.services.executor.runner import ModelRunner
from llmbus.services.executor.weights.layer_slice import (
    LayerSlice,
    file_split,
    parse_shard,
    split_layers,
    tensor_bytes,
)
from tests.gguf_fixtures import TinySpec, generate, write_tiny_llama

PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45], [1, 7, 3]]  # past gemma3's window
PARAMS = [SamplingParams(temperature=0.0, logprobs=3),
          SamplingParams(temperature=1.0, seed=5, logprobs=2)]
FAMILIES = {  # arch: (spec, matrix type, exact)
    "llama-fast": ("llama", TinySpec(num_layers=4), "Q8_0", False),  # the integer kernel
    "llama-exact": ("llama", TinySpec(num_layers=4), "Q8_0", True),  # ONNX Runtime's graphs
    "qwen3": ("qwen3", TinySpec(num_layers=4, head_size=128), None, True),
    # 6 layers, the 6th global: the second shard's last layer must know it is the model's 6th
    "gemma3": ("gemma3", TinySpec(num_layers=6, num_heads=2, num_kv_heads=1, head_size=256,
                                  rope_theta=1e6, rms_norm_eps=1e-6, sliding_window=8),
               "Q8_0", True),
    "qwen3moe": ("qwen3moe", TinySpec(num_layers=4, head_size=128, num_experts=8,
                                      num_experts_used=2, expert_size=96), "Q8_0", False),
}


def test_the_split_evens_out_bytes_the_lead_counting_the_vocabulary():
    assert split_layers(0, [1] * 30, 2) == [range(0, 15), range(15, 30)]
    assert split_layers(0, [1] * 7, 3) == [range(0, 2), range(2, 5), range(5, 7)]
    assert split_layers(6, [1] * 10, 2) == [range(0, 2), range(2, 10)]  # 8 bytes each
    assert split_layers(0, [1] * 5, 2) == [range(0, 2), range(2, 5)]  # a tie: the lead fewer
    assert split_layers(100, [1] * 3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    for count in (0, 4):
        with pytest.raises(ValueError, match="a model of 3 layers takes 1 to 3"):
            split_layers(0, [1] * 3, count)


@pytest.mark.parametrize("tied", [False, True])
def test_a_file_splits_by_the_bytes_a_step_reads(tmp_path, tied):
    """The head's matrix counts (the embedding's, where tied: the head reads it); an untied
    embedding does not (a step looks up a few rows). A head of ~1.8 layers: the lead takes 2
    of 6 layers either way; counting the untied embedding as well would give it 1."""
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, TinySpec(num_layers=6, vocab_size=1024, tied=tied))
    sizes = tensor_bytes(path)
    per_layer = sum(v for n, v in sizes.items() if n.startswith("blk.0."))
    head = sizes["token_embd.weight" if tied else "output.weight"] + sizes["output_norm.weight"]
    assert per_layer < head < 2 * per_layer
    assert file_split(path, 2) == split_layers(head, [per_layer] * 6, 2) == [range(0, 2),
                                                                            range(2, 6)]


def test_a_shard_loads_its_own_tensors_renumbered():
    lead, rest = LayerSlice(0, 15, has_vocab=True), LayerSlice(15, 30, has_vocab=False)
    assert lead.tensor_name("token_embd.weight") == "token_embd.weight"
    assert lead.tensor_name("output_norm.weight") == "output_norm.weight"
    assert lead.tensor_name("blk.14.ffn_down.weight") == "blk.14.ffn_down.weight"
    assert lead.tensor_name("blk.15.ffn_down.weight") is None
    assert rest.tensor_name("blk.15.attn_q.weight") == "blk.0.attn_q.weight"
    assert rest.tensor_name("blk.29.ffn_gate_exps.weight") == "blk.14.ffn_gate_exps.weight"
    assert rest.tensor_name("blk.3.attn_q.weight") is None
    for vocab in ("token_embd.weight", "output.weight", "output_norm.weight"):
        assert rest.tensor_name(vocab) is None
    assert rest.tensor_name("rope_freqs.weight") == "rope_freqs.weight"  # every shard's RoPE


def test_shard_options_are_checked_in_their_own_words(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, TinySpec(num_layers=4))
    assert parse_shard(None, None, path) == (0, 1, None)
    rest = file_split(path, 2)[1]
    assert parse_shard("1/2", None, path) == (1, 2, LayerSlice(rest.start, rest.stop, False))
    assert parse_shard("0/2", "0:1", path) == (0, 2, LayerSlice(0, 1, has_vocab=True))
    for shard, layers, problem in (
            (None, "0:2", "give --shard I/N too"), ("1of2", None, "expected I/N"),
            ("2/2", None, "counts from 0 to 1"), ("1/5", None, "takes 1 to 4"),
            ("1/2", "2-4", "expected A:B"), ("1/2", "3:9", "not a range of the model's 4"),
            ("0/2", "1:2", "the lead shard (0) starts at layer 0")):
        with pytest.raises(ValueError, match=re.escape(problem)):
            parse_shard(shard, layers, path)


def test_the_handoff_is_bit_exact_in_any_number_of_parts():
    values = torch.randn(7, 12) * torch.logspace(-40, 38, 12)  # float32's range, denormals too
    values[0, :4] = torch.tensor([float("inf"), -0.0, float("-inf"), float("nan")])
    for hidden in (values, values.to(torch.bfloat16)):
        row_bytes = 12 * hidden.element_size()
        dtype = str(hidden.dtype).removeprefix("torch.")
        for max_bytes, num_parts in ((10**6, 1), (3 * row_bytes, 3), (row_bytes + 1, 7), (1, 7)):
            parts = hidden_parts(hidden, max_bytes)
            assert len(parts) == num_parts
            back = hidden_from_parts(parts, 12, dtype)
            assert back.dtype == hidden.dtype
            assert back.view(torch.uint8).tolist() == hidden.view(torch.uint8).tolist()
    assert hidden_from_parts(hidden_parts(torch.empty(0, 12), 64), 12, "float32").shape == (0, 12)


def test_micro_batches_cut_the_tokens_evenly_and_each_sequence_where_they_fall():
    assert token_ranges([1] * 31, 2) == [(0, 31)]  # 16 tokens each at least
    assert token_ranges([1] * 32, 2) == [(0, 16), (16, 32)]
    assert token_ranges([1] * 8, 2) == [(0, 8)]  # 8 decodes: whole
    assert token_ranges([1000], 3) == [(0, 333), (333, 666), (666, 1000)]
    assert token_ranges([1] * 5, 2, min_tokens=2) == [(0, 2), (2, 5)]
    assert token_ranges([6, 1, 1], 2, min_tokens=2) == [(0, 4), (4, 8)]
    # no token of a longer query alone on one side (it would attend as a decode)
    assert token_ranges([5, 3], 2, min_tokens=2) == [(0, 5), (5, 8)]
    assert token_ranges([1, 2, 1], 2, min_tokens=2) == [(0, 1), (1, 4)]
    assert token_ranges([3, 7, 1, 1], 2, min_tokens=2) == [(0, 6), (6, 12)]
    assert token_ranges([3, 5], 2, min_tokens=2) == [(0, 3), (3, 8)]
    # a 6-token chunk of a prompt whose 6 tokens are new, then two decodes
    geometry = ([6, 1, 1], [6, 9, 4], [[1, 2], [3, 4, 5], [6]])
    assert sub_geometry(geometry, 0, 4) == ([4], [4], [[1, 2]])
    assert sub_geometry(geometry, 4, 8) == ([2, 1, 1], [6, 9, 4], [[1, 2], [3, 4, 5], [6]])
    assert sub_geometry(geometry, 6, 7) == ([1], [9], [[3, 4, 5]])


def _info(first: int, end: int, **changes) -> ShardInfo:
    info = ShardInfo(model_name="m", model_bytes=100, num_model_layers=30, first_layer=first,
                     end_layer=end, backend="b", kv_dtype="float16", kv_budget_bytes=0,
                     kv_token_bytes=0, weight_bytes=0)
    return msgspec.structs.replace(info, **changes)


def test_shards_that_do_not_make_up_the_model_are_named():
    lead = _info(0, 10)
    assert check_shards(lead, [_info(10, 20), _info(20, 30)], 3) == ""
    for shards, problem in (
            ([_info(10, 30, model_bytes=99)], "shard 1/2 serves m (99 bytes), the lead m (100"),
            ([_info(10, 30, kv_dtype="float32")], "in float32, the lead in float16"),
            ([_info(9, 30)], "holds layers 9:30, but the shards before it end at layer 10: "
                             "they overlap"),
            ([_info(11, 30)], "they leave out layers"),
            ([_info(10, 29)], "the shards end at layer 29 of the model's 30")):
        assert problem in check_shards(lead, shards, 2)


def split_runner(path, count: int, min_tokens: int = 10**6, **options) -> ModelRunner:
    """A lead runner whose forward goes through `count - 1` in-process LayerShards, each step
    through the bus's codec and in parts of three rows, as over the bus; steps of at least
    2 * `min_tokens` tokens in micro-batches (pipeline_lead.py)."""
    layers = file_split(path, count)
    lead = ModelRunner(path, model_name="tiny",
                       layers=LayerSlice(0, layers[0].stop, has_vocab=True), **options)
    shards = [LayerShard(path, lead.choice, LayerSlice(r.start, r.stop, has_vocab=False), 1,
                         1 << 30) for r in layers[1:]]
    for shard in shards:
        shard.setup(ShardSetup(lead.kv_cache.num_blocks, lead.block_size, lead.max_model_len))
    copies: list[BlockCopy] = []
    lead.copies_for_shards = copies

    def send(hidden, geometry) -> Future:
        query_lens, context_lens, tables = geometry
        step = decode(encode(ShardStep(
            step_id=0, part=0, num_parts=1, hidden=b"", num_tokens=hidden.shape[0],
            query_lens=query_lens, context_lens=context_lens, block_tables=tables,
            copy_blocks=copies[:])), ShardStep)
        copies.clear()
        for shard in shards:
            parts = hidden_parts(hidden, 3 * hidden.shape[1] * hidden.element_size())
            hidden = shard.run(step, hidden_from_parts(parts, hidden.shape[1], "float32"))
        done: Future = Future()
        done.set_result(hidden)
        return done

    lead.model_forward = PipelinedForward(lead.model, send, count, min_tokens)
    return lead


class _Recorded:
    """A runner whose step results are kept (`generate` returns only the tokens)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.results = runner, []
        self.block_size, self.kv_cache = runner.block_size, runner.kv_cache

    def step(self, plan):
        self.results.append(self.runner.step(plan))
        return self.results[-1]


def _run(runner: ModelRunner) -> list:
    recorded = _Recorded(runner)
    generate(recorded, PROMPTS, max_tokens=6, params=PARAMS, chunk_size=5, shuffle_blocks=3)
    return [(r.sampled_token_ids, r.logprobs) for r in recorded.results]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_split_engine_samples_the_bits_of_the_whole_model(tmp_path, family):
    """Without micro-batches, every backend's bits; with them, see below."""
    arch, spec, matrix_type, exact = FAMILIES[family]
    path = tmp_path / f"{family}.gguf"
    write_tiny_llama(path, spec, seed=4, arch=arch, quantized=matrix_type)
    options = {"block_size": 4, "num_blocks": 64, "num_threads": 1,
               "backend": "auto" if arch != "qwen3moe" else "integer-kernel", "exact": exact}
    from llmbus.services.executor.backend_choice import choose_backend

    choice = choose_backend(path, backend=options.pop("backend"), exact=options.pop("exact"))
    whole = _run(ModelRunner(path, model_name="tiny", choice=choice, **options))
    counts = (2, 3) if family == "llama-fast" else (2,)
    for count in counts:
        assert _run(split_runner(path, count, choice=choice, **options)) == whole
        # Micro-batches of 2+ tokens: prompt chunks cut in two, decodes in halves. The integer
        # kernel's rows are independent of each other, and no cut leaves one token of a chunk
        # to attend as a decode (token_ranges): the same bits. ONNX Runtime's float32
        # GEMMs block their sums by the rows they get, so its bits move with a step's shape
        # (as they do with a batch's): the same tokens, logprobs within the exact mode's 1e-4.
        cut = _run(split_runner(path, count, min_tokens=2, choice=choice, **options))
        if choice.backend != "onnxruntime":
            assert cut == whole
            continue
        assert [tokens for tokens, _ in cut] == [tokens for tokens, _ in whole]
        for (_, mine), (_, theirs) in zip(cut, whole, strict=True):
            for a, b in zip(mine, theirs, strict=True):
                assert a.top_token_ids == b.top_token_ids
                assert max(abs(x - y) for x, y in zip(a.top_logprobs, b.top_logprobs,
                                                      strict=True)) < 1e-4


def test_a_shard_copies_blocks_before_its_step(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, TinySpec(num_layers=2))
    lead = ModelRunner(path, model_name="tiny", layers=LayerSlice(0, 1, has_vocab=True))
    shard = LayerShard(path, lead.choice, LayerSlice(1, 2, has_vocab=False), 1, 1 << 30)
    shard.setup(ShardSetup(num_blocks=4, block_size=4, max_model_len=12))
    kv = shard.kv_cache
    kv.k[:, 2].normal_()
    kv.v[:, 2].normal_()
    shard.run(ShardStep(step_id=1, part=0, num_parts=1, hidden=b"",
                        copy_blocks=[BlockCopy(src=2, dst=3)]), torch.empty(0, 64))
    assert torch.equal(kv.k[:, 3], kv.k[:, 2]) and torch.equal(kv.v[:, 3], kv.v[:, 2])
    assert kv.k[:, 2].abs().sum() > 0
