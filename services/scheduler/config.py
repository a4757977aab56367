"""Every option of the scheduler stage in one place: `SchedulerConfig`, the command-line options
that set it (`add_arguments`, with their help texts), and the one mapping from those onto it
(`config_from_args`). The struct's defaults are the served defaults; the KV cache's shape and
the model's limits are the executor's, filled in once it answers (`with_executor`)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from llmbus.bus.messages import ExecutorInfo
from llmbus.services.scheduler.disaggregation.rule import MODES, DisaggregationRule

ROLES = ("mixed", "prefill", "decode")

# Multi-step decoding (multi_step.py) takes several steps at most this many running requests.
MULTI_STEP_MAX_BATCH = 4


@dataclass(frozen=True)
class SchedulerConfig:
    # The executor's (ExecutorInfo): its KV cache's shape, the model's context and ends.
    num_blocks: int = 0
    block_size: int = 0
    max_model_len: int = 0
    eos_token_ids: tuple[int, ...] = ()
    # Planning (scheduler.py): the batch caps; chunked prefill's step size (why 256:
    # docs/benchmarks.md, "Step budget"); while anything decodes, the forward time a step's
    # prompt chunks may bring it to (step_time.py; 0 = the token budget alone; why 60:
    # docs/benchmarks.md, "Steps sized by time").
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256
    max_step_seconds: float = 0.06
    enable_prefix_caching: bool = True
    # Speculative decoding (ngram_proposer.py): up to this many draft tokens per step, from
    # earlier matches of the last spec_ngram_max..spec_ngram_min tokens; 0 = off.
    num_speculative_tokens: int = 0
    spec_ngram_min: int = 2
    spec_ngram_max: int = 4
    # Multi-step decoding (multi_step.py): tokens a small batch's decodes take per step, at
    # most, and about how long such a step may take (fewer steps when forwards are slow).
    decode_steps: int = 8
    decode_plan_seconds: float = 0.05
    # The engine loop and the adapter (engine_loop.py, service.py).
    engine_id: str = "engine0"
    pipeline_depth: int = 2  # steps in flight at once
    max_queued_requests: int = 256  # waiting for their first step; beyond: refused
    max_queued_tokens: int = 262144  # prompt tokens waiting; beyond: refused
    queue_timeout_seconds: float = 300.0  # waiting for a first step; then an error
    shutdown_timeout_seconds: float = 30.0  # on SIGTERM, to finish what is held
    step_timeout_seconds: float = 60.0  # for the executor's answer to one step
    # Disaggregated serving (disaggregation/): this engine's role, and, for a decode engine,
    # the rule that sends a prompt's prefill to a prefill engine (None: every prompt here),
    # and how long a remote prefill may take before this engine does it itself.
    role: str = "mixed"
    disaggregation: DisaggregationRule | None = None
    remote_prefill_timeout_seconds: float = 30.0
    # The executor's model (ExecutorInfo): an encoder takes each prompt whole, in one step;
    # an embedding engine refuses generation.
    whole_prompts: bool = False
    embed_only: bool = False
    max_adapters: int = 0  # LoRA adapters one step may mix (the executor's slots)
    # A split model (ExecutorInfo.num_shards > 1) without LoRA slots: a plan leaves out the
    # requests whose next token a plan in flight samples, so that the lead computes it while
    # that plan is in the other shards (executor/plan_overlap.py).
    disjoint_plans: bool = False

    def __post_init__(self) -> None:
        check_speculation(self.num_speculative_tokens, self.spec_ngram_min,
                          self.spec_ngram_max)
        if self.decode_steps < 1:
            raise ValueError(f"--decode-steps must be 1 or more, got {self.decode_steps}")
        if not self.max_step_seconds >= 0:
            raise ValueError("--max-step-ms must be 0 (off) or more, got "
                             f"{self.max_step_seconds * 1000:g}")
        if not self.decode_plan_seconds > 0:
            raise ValueError("--decode-plan-ms must be positive, got "
                             f"{self.decode_plan_seconds * 1000:g}")
        if self.pipeline_depth not in (1, 2):
            raise ValueError(f"--pipeline-depth must be 1 or 2, got {self.pipeline_depth}")
        if self.role not in ROLES:
            raise ValueError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}")

    def with_executor(self, info: ExecutorInfo) -> SchedulerConfig:
        """This config on the executor's KV cache and model."""
        rule = self.disaggregation
        if rule is not None and info.layout is not None:  # a token's KV, to time transfers
            layout = info.layout
            element = 4 if layout.dtype == "float32" else 2
            rule = dataclasses.replace(rule, kv_bytes_per_token=2 * layout.num_layers
                                       * layout.num_kv_heads * layout.head_dim * element)
        return dataclasses.replace(
            self, num_blocks=info.num_blocks, block_size=info.block_size,
            max_model_len=info.max_model_len, eos_token_ids=tuple(info.eos_token_ids),
            disaggregation=rule, whole_prompts=info.whole_prompts, embed_only=info.embed_only,
            max_adapters=info.max_adapters,
            disjoint_plans=info.num_shards > 1 and not info.max_adapters)


def check_speculation(num_tokens: int, ngram_min: int, ngram_max: int) -> None:
    """Raises ValueError, naming the options, for settings speculation cannot run with."""
    if num_tokens < 0:
        raise ValueError(f"--num-speculative-tokens must be 0 (off) or more, got {num_tokens}")
    if not 1 <= ngram_min <= ngram_max:
        raise ValueError("need 1 <= --spec-ngram-min <= --spec-ngram-max, got "
                         f"{ngram_min} and {ngram_max}")


def config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    """The options of `add_arguments` as a SchedulerConfig; ValueError names a bad one."""
    return SchedulerConfig(
        engine_id=args.engine_id, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_step_seconds=args.max_step_ms / 1000,
        enable_prefix_caching=not args.no_prefix_caching, pipeline_depth=args.pipeline_depth,
        max_queued_requests=args.max_queued_requests, max_queued_tokens=args.max_queued_tokens,
        queue_timeout_seconds=args.queue_timeout, shutdown_timeout_seconds=args.shutdown_timeout,
        num_speculative_tokens=args.num_speculative_tokens, spec_ngram_max=args.spec_ngram_max,
        spec_ngram_min=args.spec_ngram_min, decode_steps=args.decode_steps,
        decode_plan_seconds=args.decode_plan_ms / 1000, step_timeout_seconds=args.step_timeout,
        role=args.role, disaggregation=_rule_from_args(args),
        remote_prefill_timeout_seconds=args.remote_prefill_timeout)


def _rule_from_args(args: argparse.Namespace) -> DisaggregationRule | None:
    if args.role != "decode" or args.disaggregation == "never":
        return None
    if args.remote_prefill_min_tokens < 1 or not 0 <= args.remote_prefill_max_cached <= 1:
        raise ValueError("need --remote-prefill-min-tokens >= 1 and 0 <= "
                         "--remote-prefill-max-cached <= 1")
    return DisaggregationRule(mode=args.disaggregation,
                              min_tokens=args.remote_prefill_min_tokens,
                              max_cached_fraction=args.remote_prefill_max_cached,
                              max_queued_tokens=args.remote_prefill_max_queued_tokens)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`llmbus serve scheduler`'s options; their defaults are SchedulerConfig's."""
    _step_options(parser)
    _queue_options(parser)
    _decoding_options(parser)
    _disaggregation_options(parser)
    c = SchedulerConfig
    parser.add_argument("--step-timeout", type=float, default=c.step_timeout_seconds,
                        help="seconds to wait for the executor's answer to one step before "
                             f"failing its requests (default: {c.step_timeout_seconds:g})")


def _step_options(parser: argparse.ArgumentParser) -> None:
    c = SchedulerConfig
    parser.add_argument("--engine-id", default=c.engine_id,
                        help="name of the engine (scheduler + executor pair) "
                             f"(default: {c.engine_id})")
    parser.add_argument("--max-num-seqs", type=int, default=c.max_num_seqs,
                        help=f"most requests in one step (default: {c.max_num_seqs})")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=c.max_num_batched_tokens,
                        help="token budget of one step; longer prompts are prefilled in chunks. "
                             "Smaller steps let running decodes and a burst's first arrivals "
                             "out sooner (one step of 256 tokens is ~0.35 s on 2 CPU cores for "
                             "the default model); raise it on a GPU "
                             f"(default: {c.max_num_batched_tokens})")
    parser.add_argument("--max-step-ms", type=float, default=c.max_step_seconds * 1000,
                        help="while requests decode, prompt chunks take only what keeps a "
                             "step's forward within this many ms, predicted by a model of step "
                             "time learnt from the executor's answers, so that streams never "
                             "freeze behind a long prompt; where the decodes alone take half "
                             "of it or more (a big model), a step may take twice their own "
                             "time, so prompts keep a share; a step with no decodes takes the "
                             "whole token budget; 0 = the token budget alone "
                             f"(default: {c.max_step_seconds * 1000:g})")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="do not reuse the KV blocks of earlier requests' shared prefixes")
    parser.add_argument("--pipeline-depth", type=int, default=c.pipeline_depth, choices=(1, 2),
                        help="steps in flight at once: 2 plans step N+1 while the executor "
                             f"runs step N (default: {c.pipeline_depth})")


def _queue_options(parser: argparse.ArgumentParser) -> None:
    c = SchedulerConfig
    parser.add_argument("--max-queued-requests", type=int, default=c.max_queued_requests,
                        help="requests waiting for their first step beyond which new ones are "
                             f"refused with 503 (default: {c.max_queued_requests})")
    parser.add_argument("--max-queued-tokens", type=int, default=c.max_queued_tokens,
                        help="prompt tokens waiting beyond which new requests are refused "
                             f"with 503 (default: {c.max_queued_tokens})")
    parser.add_argument("--queue-timeout", type=float, default=c.queue_timeout_seconds,
                        help="seconds a request may wait for its first step before it ends "
                             f"with an error (default: {c.queue_timeout_seconds:g})")
    parser.add_argument("--shutdown-timeout", type=float, default=c.shutdown_timeout_seconds,
                        help="on SIGTERM, seconds to finish the requests held before failing "
                             f"them (default: {c.shutdown_timeout_seconds:g})")


def _decoding_options(parser: argparse.ArgumentParser) -> None:
    """Speculative and multi-step decoding."""
    c = SchedulerConfig
    parser.add_argument("--num-speculative-tokens", type=int,
                        default=c.num_speculative_tokens,
                        help="speculative decoding: verify up to this many draft tokens per "
                             "step, guessed by looking the last tokens up in the prompt and "
                             "output so far (helps output that repeats its context: "
                             "summaries, edits, code; greedy output is unchanged); 0 = off "
                             f"(default: {c.num_speculative_tokens})")
    parser.add_argument("--spec-ngram-max", type=int, default=c.spec_ngram_max,
                        help="speculative decoding: longest suffix looked up "
                             f"(default: {c.spec_ngram_max})")
    parser.add_argument("--spec-ngram-min", type=int, default=c.spec_ngram_min,
                        help="speculative decoding: shortest suffix looked up "
                             f"(default: {c.spec_ngram_min})")
    parser.add_argument("--decode-steps", type=int, default=c.decode_steps,
                        help="multi-step decoding: while nothing waits and at most "
                             f"{MULTI_STEP_MAX_BATCH} requests run, each step decodes up to this "
                             "many tokens of each (one plan and one result on the bus per that "
                             "many tokens; a request that arrives meanwhile waits for them); "
                             f"1 = off (default: {c.decode_steps})")
    parser.add_argument("--decode-plan-ms", type=float, default=c.decode_plan_seconds * 1000,
                        help="multi-step decoding: about how long one plan of several steps "
                             "may take; fewer steps than --decode-steps when the model's "
                             "forwards are slow, so that text still arrives this often and a "
                             "new request waits at most about this long "
                             f"(default: {c.decode_plan_seconds * 1000:g})")


def _disaggregation_options(parser: argparse.ArgumentParser) -> None:
    c, rule = SchedulerConfig, DisaggregationRule()
    parser.add_argument("--role", choices=ROLES, default=c.role,
                        help="disaggregated serving: a prefill engine only prefills prompts "
                             "for decode engines (the router sends it no requests); a decode "
                             "engine sends the prefill of a long, uncached prompt to a prefill "
                             "engine when that is predicted to give the first token sooner "
                             "(--disaggregation); mixed does both itself (default: mixed)")
    parser.add_argument("--disaggregation", choices=MODES, default=rule.mode,
                        help="a decode engine: auto = per request, by --remote-prefill-* and "
                             "the predicted time to the first token; always = every prompt "
                             "a prefill engine has room for; never = none "
                             f"(default: {rule.mode})")
    parser.add_argument("--remote-prefill-min-tokens", type=int, default=rule.min_tokens,
                        help="auto: prompts with fewer uncached tokens are prefilled here "
                             f"(default: {rule.min_tokens})")
    parser.add_argument("--remote-prefill-max-cached", type=float,
                        default=rule.max_cached_fraction,
                        help="auto: prompts with more than this fraction cached here are "
                             f"prefilled here (default: {rule.max_cached_fraction:g})")
    parser.add_argument("--remote-prefill-max-queued-tokens", type=int,
                        default=rule.max_queued_tokens,
                        help="a prefill engine with more prompt tokens waiting is taken for "
                             f"saturated (default: {rule.max_queued_tokens})")
    parser.add_argument("--remote-prefill-timeout", type=float,
                        default=c.remote_prefill_timeout_seconds,
                        help="seconds a remote prefill may take before this engine prefills "
                             "the prompt itself (a dead prefill engine is noticed sooner, by "
                             f"its heartbeats) (default: {c.remote_prefill_timeout_seconds:g})")
