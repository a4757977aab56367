"""The scheduler's options in one place: every `llmbus serve scheduler` option lands in its
SchedulerConfig field, the options' defaults are the struct's, and a bad value is refused
naming its option."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from llmbus.bus.messages import ExecutorInfo
from llmbus.services.cli import build_parser
from llmbus.services.scheduler.config import SchedulerConfig, config_from_args
from llmbus.services.scheduler.disaggregation.rule import DisaggregationRule


def _parse(*options: str) -> SchedulerConfig:
    return config_from_args(build_parser().parse_args(["serve", "scheduler", *options]))


def test_no_options_give_the_structs_defaults():
    assert _parse() == SchedulerConfig()


def test_every_option_sets_its_field():
    config = _parse(
        "--engine-id", "e7", "--max-num-seqs", "3", "--max-num-batched-tokens", "128",
        "--no-prefix-caching", "--pipeline-depth", "1", "--max-queued-requests", "5",
        "--max-queued-tokens", "600", "--queue-timeout", "7", "--shutdown-timeout", "8",
        "--num-speculative-tokens", "2", "--spec-ngram-max", "3", "--spec-ngram-min", "1",
        "--decode-steps", "4", "--decode-plan-ms", "30", "--step-timeout", "9",
        "--max-step-ms", "250", "--role", "decode", "--disaggregation", "always",
        "--remote-prefill-min-tokens", "99", "--remote-prefill-max-cached", "0.25",
        "--remote-prefill-max-queued-tokens", "77", "--remote-prefill-timeout", "12")
    assert config == SchedulerConfig(
        engine_id="e7", max_num_seqs=3, max_num_batched_tokens=128, enable_prefix_caching=False,
        pipeline_depth=1, max_queued_requests=5, max_queued_tokens=600,
        queue_timeout_seconds=7.0, shutdown_timeout_seconds=8.0, num_speculative_tokens=2,
        spec_ngram_max=3, spec_ngram_min=1, decode_steps=4, decode_plan_seconds=0.03,
        step_timeout_seconds=9.0, max_step_seconds=0.25, role="decode",
        disaggregation=DisaggregationRule(mode="always", min_tokens=99, max_cached_fraction=0.25,
                                          max_queued_tokens=77),
        remote_prefill_timeout_seconds=12.0)
    executor_fields = {"num_blocks", "block_size", "max_model_len", "eos_token_ids",
                       "whole_prompts", "embed_only", "max_adapters", "disjoint_plans"}
    unset = [f.name for f in dataclasses.fields(SchedulerConfig)
             if getattr(config, f.name) == f.default and f.name not in executor_fields]
    assert unset == []  # no field without its option


def test_the_executor_gives_the_cache_shape():
    info = ExecutorInfo(model_name="m", max_model_len=512, num_blocks=33, block_size=16,
                        eos_token_ids=[2, 3], vocab_size=100, whole_prompts=True,
                        embed_only=True)
    config = _parse("--max-num-seqs", "3").with_executor(info)
    assert (config.num_blocks, config.block_size, config.max_model_len, config.eos_token_ids,
            config.max_num_seqs) == (33, 16, 512, (2, 3), 3)
    assert config.whole_prompts and config.embed_only and not config.disjoint_plans
    split = msgspec.structs.replace(info, num_shards=2)
    assert _parse().with_executor(split).disjoint_plans  # its lead overlaps plans
    with_slots = msgspec.structs.replace(split, max_adapters=2)  # its lead does not
    assert not _parse().with_executor(with_slots).disjoint_plans


@pytest.mark.parametrize(("options", "named"), [
    (["--decode-steps", "0"], "--decode-steps"),
    (["--decode-plan-ms", "0"], "--decode-plan-ms"),
    (["--max-step-ms", "-1"], "--max-step-ms"),
    (["--num-speculative-tokens", "-1"], "--num-speculative-tokens"),
    (["--spec-ngram-min", "5"], "--spec-ngram-min"),
    (["--role", "decode", "--remote-prefill-min-tokens", "0"], "--remote-prefill-min-tokens"),
    (["--role", "decode", "--remote-prefill-max-cached", "2"], "--remote-prefill-max-cached"),
])
def test_a_bad_value_is_refused_naming_its_option(options, named):
    with pytest.raises(ValueError, match=named):
        _parse(*options)
