"""On-device sampling: the same tokens as the torch ladder when given the same noise."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from services.executor.kernels.sampling import sample, sample_reference  # noqa: E402
from tests.kernels.helpers import DEVICE, gpu, requires_cuda  # noqa: E402


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
