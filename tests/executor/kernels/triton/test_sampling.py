"""On-device sampling: the same tokens as the torch ladder when given the same noise."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from llmbus.services.executor.kernels.triton.sampling import sample, sample_reference  # noqa: E402
from tests.executor.kernels.triton.helpers import DEVICE, gpu, requires_cuda  # noqa: E402


def _batch(num_rows: int, vocab_size: int, seed: int):
    """Continuous random logits (no ties) and Exp(1) noise, on the test device."""
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(num_rows, vocab_size, generator=g)
    noise = torch.empty(num_rows, vocab_size).exponential_(generator=g)
    return logits.to(DEVICE), noise.to(DEVICE)


def _params(temperature, top_k, top_p, min_p):
    return (torch.tensor(temperature, dtype=torch.float32, device=DEVICE),
            torch.tensor(top_k, dtype=torch.int64, device=DEVICE),
            torch.tensor(top_p, dtype=torch.float32, device=DEVICE),
            torch.tensor(min_p, dtype=torch.float32, device=DEVICE))


# One row per filter and their mixes: greedy, plain, top-k, top-p, min-p, all three, top-k
# >= vocab (off), top-p 0 (top token only).
MIXED = _params(
    temperature=[0.0, 1.0, 0.7, 1.0, 1.3, 0.8, 1.0, 1.0],
    top_k=[0, 0, 20, 0, 0, 40, 10_000, 0],
    top_p=[1.0, 1.0, 1.0, 0.8, 1.0, 0.6, 1.0, 0.0],
    min_p=[0.0, 0.0, 0.0, 0.0, 0.05, 0.02, 0.0, 0.0],
)


@pytest.mark.parametrize("vocab_size,block_v,seed", [
    (300, None, 0), (300, None, 1), (300, None, 2), (1000, 256, 3), (97, 32, 4),
], ids=["one-chunk-0", "one-chunk-1", "one-chunk-2", "four-chunks", "odd-vocab"])
def test_sample_matches_reference(vocab_size, block_v, seed):
    logits, noise = _batch(len(MIXED[0]), vocab_size, seed)
    tokens = sample(logits, noise, *MIXED, block_v=block_v)
    assert tokens.dtype == torch.int64 and tokens.device == logits.device
    assert tokens.tolist() == sample_reference(logits, noise, *MIXED).tolist()


def test_degenerate_filters_pick_the_top_token():
    logits, noise = _batch(4, 200, seed=5)
    params = _params([1.0, 0.9, 2.0, 0.0], [1, 0, 0, 3], [1.0, 0.0, 1.0, 0.5], [0.0, 0.0, 1.0, 0])
    assert sample(logits, noise, *params).tolist() == logits.argmax(-1).tolist()


def test_filters_keep_the_sampled_token_inside_the_kept_set():
    """Across many noise draws a top-k row only ever picks one of its k largest logits."""
    logits, _ = _batch(1, 64, seed=6)
    g = torch.Generator().manual_seed(7)
    noise = torch.empty(16, 64).exponential_(generator=g).to(DEVICE)
    params = _params([1.0] * 16, [5] * 16, [1.0] * 16, [0.0] * 16)
    tokens = sample(logits.expand(16, 64).contiguous(), noise, *params)
    allowed = set(logits[0].topk(5).indices.tolist())
    assert set(tokens.tolist()) <= allowed and len(set(tokens.tolist())) > 1


def test_launcher_rejects_bad_arguments():
    logits, noise = _batch(2, 50, seed=0)
    params = _params([1.0, 1.0], [0, 0], [1.0, 1.0], [0.0, 0.0])
    with pytest.raises(ValueError, match="noise: axis 1"):
        sample(logits, noise[:, :10], *params)
    with pytest.raises(ValueError, match="logits: dtype"):
        sample(logits.half(), noise, *params)
    with pytest.raises(ValueError, match="top_k: dtype"):
        sample(logits, noise, params[0], params[1].float(), *params[2:])
    with pytest.raises(ValueError, match="block_v"):
        sample(logits, noise, *params, block_v=48)


@gpu
@requires_cuda
def test_full_vocab_batch_on_gpu():
    rows = 64
    logits, noise = _batch(rows, 49152, seed=0)
    params = _params([0.0, 1.0, 0.7, 1.2] * (rows // 4), [0, 0, 50, 20] * (rows // 4),
                     [1.0, 0.9, 1.0, 0.95] * (rows // 4), [0.0, 0.0, 0.05, 0.1] * (rows // 4))
    assert sample(logits, noise, *params).tolist() == \
        sample_reference(logits, noise, *params).tolist()


def test_the_sampler_draws_in_the_kernel_what_the_ladder_draws_from_the_same_noise():
    """sampler.sample's kernel path (CUDA's default): logit bias and min_tokens bans first,
    then every row's ladder and draw on Exp(1) noise from the row's own seeded generator."""
    from llmbus.bus.messages import SamplingParams
    from llmbus.services.executor.sampling.sampler import exponential_noise, process_logits
    from llmbus.services.executor.sampling.sampler import sample as sampler_sample
    from llmbus.services.executor.sampling.sampling_tensors import RequestSampling, SamplingTensors

    vocab_size = 300
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.7, top_k=20, seed=2),
              SamplingParams(temperature=1.0, top_p=0.8, seed=3),
              SamplingParams(temperature=1.3, min_p=0.05, seed=4),
              SamplingParams(temperature=0.8, top_k=40, top_p=0.6, min_p=0.02, seed=5),
              SamplingParams(temperature=1.0, logit_bias={7: 100.0}, seed=6),
              SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[11])]
    rows = [RequestSampling.from_params(p, eos_token_ids=(11,), vocab_size=vocab_size)
            for p in params]
    tensors = SamplingTensors.build(rows, DEVICE)
    logits, _ = _batch(len(rows), vocab_size, seed=0)
    logits[7, 11] = 50.0  # the greedy choice, until min_tokens bans it

    def generators():
        return [torch.Generator(DEVICE).manual_seed(p.seed) if p.seed is not None else None
                for p in params]

    shared = torch.Generator(DEVICE).manual_seed(99)
    got = sampler_sample(logits, tensors, generators(), shared, in_kernel=True)
    noise = exponential_noise(tuple(logits.shape), generators(),
                              torch.Generator(DEVICE).manual_seed(99), DEVICE)
    want = sample_reference(process_logits(logits, tensors), noise, *(
        t.contiguous() for t in (tensors.temperature, tensors.top_k, tensors.top_p,
                                 tensors.min_p)))
    assert got.tolist() == want.tolist()
    assert got[0] == logits[0].argmax() and got[6] == 7 and got[7] != 11
