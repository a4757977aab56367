"""Time one schedule + update cycle of the scheduler core with many running requests.

No model and no bus: a fake executor samples token 7 for every request. Target: <= 1 ms per
cycle with 256 running requests (the scheduler must never be what the executor waits for).
Then what speculative decoding's n-gram proposer adds per step (target: well under 1 ms at 64
running requests): a lookup for each request, which has gained one token since the last.

    python -m llmbus.bench.scheduler_cycle [--running 256 1024] [--steps 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from llmbus.bus.messages import SamplingParams, StepResult
from llmbus.services.scheduler.config import SchedulerConfig
from llmbus.services.scheduler.ngram_proposer import NgramIndex
from llmbus.services.scheduler.scheduler import Scheduler


def measure(num_running: int, num_steps: int, prefix_caching: bool) -> list[float]:
    block_size = 16
    scheduler = Scheduler(SchedulerConfig(
        num_blocks=num_running * 64 + 1, block_size=block_size, max_model_len=8192,
        eos_token_ids=(2,), max_num_seqs=num_running, max_num_batched_tokens=num_running * 8,
        enable_prefix_caching=prefix_caching, decode_steps=1))
    for i in range(num_running):
        scheduler.add_request(f"r{i}", "api", [i % 50 + 3] * 100 + [5] * (i % 7),
                              SamplingParams(max_tokens=num_steps + 200, ignore_eos=True))
    while scheduler.waiting:  # prefill everything first: we time steady-state decode
        plan = scheduler.schedule()
        scheduler.update(plan, StepResult(step_id=plan.step_id, sampled_token_ids=[7] * sum(
            s.sample for s in plan.scheduled)))
    times = []
    for _ in range(num_steps):
        started = time.perf_counter()
        plan = scheduler.schedule()
        result = StepResult(step_id=plan.step_id, sampled_token_ids=[7] * len(plan.scheduled))
        scheduler.update(plan, result)
        times.append(time.perf_counter() - started)
    assert len(plan.scheduled) == num_running
    return times


def measure_proposer(num_running: int, length: int, num_steps: int) -> list[float]:
    """Seconds per step to propose 4 drafts for each of `num_running` requests of `length`
    tokens (text-like: a 50-token alphabet, so suffixes often match)."""
    rng = random.Random(0)
    requests = [[rng.randrange(50) for _ in range(length)] for _ in range(num_running)]
    indexes = [NgramIndex(2, 4) for _ in requests]
    for index, tokens in zip(indexes, requests, strict=True):
        index.propose((), tokens, 4)  # the prompt is indexed once, when the request starts
    times = []
    for _ in range(num_steps):
        for tokens in requests:
            tokens.append(rng.randrange(50))
        started = time.perf_counter()
        for index, tokens in zip(indexes, requests, strict=True):
            index.propose((), tokens, 4)
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    print(f"{'running':>8} {'prefix cache':>12} {'p50 ms':>8} {'p90 ms':>8} {'max ms':>8}")
    for num_running in args.running:
        for prefix_caching in (True, False):
            times = sorted(measure(num_running, args.steps, prefix_caching))
            p50, p90 = statistics.median(times), times[int(len(times) * 0.9)]
            print(f"{num_running:>8} {str(prefix_caching):>12} {p50 * 1e3:>8.3f} "
                  f"{p90 * 1e3:>8.3f} {times[-1] * 1e3:>8.3f}")
    for num_running, length in ((64, 2000), (256, 2000)):
        times = sorted(measure_proposer(num_running, length, args.steps))
        print(f"n-gram drafts for {num_running} requests of {length} tokens: p50 "
              f"{statistics.median(times) * 1e3:.3f} ms per step, max {times[-1] * 1e3:.3f}")


if __name__ == "__main__":
    main()
