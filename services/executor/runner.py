# Over 300 lines: a step's bookkeeping, forward and sampling share every request's state.
"""The executor's pure core: a StepPlan's bookkeeping, one batched forward, sampling.

No NATS, no asyncio: the service adapter decodes a StepPlan, calls `ModelRunner.execute`, and
builds the StepResult from the outcome (with what only it knows: idle time, KV transfers). The
runner keeps each request's tokens and block table (request_state.py), so plans carry only
deltas (new requests once, new block ids, token ranges to compute). Around the step, each in
a room of its own: drafts verified (drafts.py), further steps taken (multi_step.py), grammars
followed (grammar_state.py), prompt blocks gathered for other engines (kv_gathering.py), a
split model's lead taking two plans at once (plan_overlap.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from llmbus.bus.messages import (
    BlockCopy,
    ExecutorInfo,
    NewRequestData,
    PooledEmbedding,
    ScheduledRequest,
    StepPlan,
    StepProgress,
    StepResult,
)
from llmbus.services.executor.attention.metadata import build_attention_metadata
from llmbus.services.executor.backend import Backend
from llmbus.services.executor.backend_choice import BackendChoice, choose_backend
from llmbus.services.executor.backends.encoder_backend import ENCODER_SEQUENCES
from llmbus.services.executor.backends.loading import load_backend
from llmbus.services.executor.drafts import logits_indices, sample_with_drafts
from llmbus.services.executor.embedding_pooling import (
    Pooling,
    model_pooling,
    pool_step,
    resolve_pooling,
)
from llmbus.services.executor.grammar_state import GrammarState
from llmbus.services.executor.kv_cache import (
    KVCache,
    default_budget_bytes,
    num_blocks_for_budget,
)
from llmbus.services.executor.kv_gathering import KvGathering, layout_of
from llmbus.services.executor.lora.backend_support import adapter_slots
from llmbus.services.executor.multi_step import ProgressStream, more_steps
from llmbus.services.executor.plan_overlap import LeadTurns
from llmbus.services.executor.request_state import RequestState, check_scheduled, seed_positions
from llmbus.services.executor.sampling.constraints import Grammars, Vocabulary, apply_masks
from llmbus.services.executor.sampling.logprobs import token_logprobs
from llmbus.services.executor.sampling.penalties import TokenCounts
from llmbus.services.executor.sampling.sampled_tokens import SampledTokens
from llmbus.services.executor.sampling.sampler import sample
from llmbus.services.executor.sampling.sampling_tensors import RequestSampling, SamplingTensors
from llmbus.services.executor.step_outcome import StepOutcome
from llmbus.services.executor.weights.layer_slice import LayerSlice
from llmbus.services.gguf_metadata import read_metadata

# A step this small (a few decodes) is short and memory-bound. When the executor shares a small
# machine with the rest of the stack, a thread of its parallel matmuls that gets descheduled
# stalls the whole step at the next barrier; leaving a core to the other services costs such
# steps less than it saves (2 cores: 35.6 tok/s single-stream with 1 thread, 27.8 with 2).
SMALL_STEP_TOKENS = 4


class ModelRunner:
    """Owns the backend, the physical KV cache and every live request's state; runs a plan's
    step: the plan's bookkeeping, one forward, sampling."""

    def __init__(self, model_path: str | Path, *, model_name: str,
                 choice: BackendChoice | None = None, backend: str = "torch",
                 exact: bool = False, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", block_size: int = 16,
                 num_blocks: int | None = None, kv_cache_bytes: int | None = None,
                 max_model_len: int | None = None, num_threads: int | None = None,
                 small_step_threads: int | None = None, pooling: str | None = None,
                 embed_only: bool = False, layers: LayerSlice | None = None,
                 max_adapters: int = 0, max_adapter_rank: int = 64) -> None:
        """`choice` (backend_choice.py) says which backend runs; without one, it is chosen
        here from `backend`, `exact`, `dtype` and `device` (tests and benchmarks pick so).

        `small_step_threads`: CPU threads for steps of at most SMALL_STEP_TOKENS tokens (None:
        `num_threads`), see SMALL_STEP_TOKENS; torch backend only (the CPU backends keep
        single-threaded sessions for small steps themselves, or need every core).
        `pooling`: how embedding requests that leave it to the model pool (None: the file's
        `<arch>.pooling_type`, else mean). `embed_only`: refuse generation (an encoder always).
        `layers`: the lead shard's part of a model split by layers (layer_slice.py); the rest
        runs where its `model_forward` sends the hidden states (pipeline_lead.py).
        `max_adapters`: LoRA adapters a step mixes (lora/adapter_slots.py; 0: none)."""
        if choice is None:
            choice = choose_backend(model_path, backend=backend, exact=exact,
                                    dtype=str(dtype).removeprefix("torch."), device=str(device))
        self.choice = choice
        if num_threads:
            torch.set_num_threads(num_threads)
        self.num_threads = torch.get_num_threads()
        self.small_step_threads = ((small_step_threads or self.num_threads)
                                   if choice.backend == "torch" else self.num_threads)
        self.model_name, self.block_size = model_name, block_size
        self.device = torch.device(choice.device)
        self.model: Backend = load_backend(model_path, choice, self.device, self.num_threads,
                                           layers)
        # Backend.forward's contract; a split model's lead replaces it (pipeline_lead.py).
        self.model_forward = self.model.forward
        # A split model's lead computing two plans at once: their turns (plan_overlap.py).
        self.turns: LeadTurns | None = None
        # A multi-step plan's tokens as each forward samples them (the service publishes them).
        self.on_progress: Callable[[StepProgress], None] = lambda _: None
        self.tokens_out_at: float | None = None  # when the last step's result was ready
        self.config = config = self.model.config
        if max_model_len is not None and max_model_len > config.context_length:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context "
                             f"length {config.context_length}")
        self.encoder = choice.backend == "encoder"
        self.embed_only = embed_only or self.encoder
        self.asked_max_model_len = max_model_len or config.context_length
        self.set_num_blocks(num_blocks if num_blocks is not None
                            else self._default_num_blocks(kv_cache_bytes))
        # A split model's copy-on-write copies, for its layer shards (pipeline_lead_bus.py).
        self.copies_for_shards: list[BlockCopy] | None = None
        self.requests: dict[str, RequestState] = {}  # by sequence_id
        self.token_counts = TokenCounts(self.device)
        self.shared_generator = torch.Generator(device=self.device)
        self.shared_generator.seed()
        self.pooling = model_pooling(read_metadata(model_path), pooling)
        self.grammars = Grammars(lambda: Vocabulary.from_gguf(
            model_path, config.vocab_size, config.eos_token_ids), config.vocab_size)
        self.adapters = (adapter_slots(self.model, layers, max_adapters, max_adapter_rank)
                         if max_adapters else None)

    def _default_num_blocks(self, kv_cache_bytes: int | None) -> int:
        """Blocks for `kv_cache_bytes` (None: the device's default budget); an encoder's only
        count its tokens (it keeps no KV)."""
        config, block_size = self.config, self.block_size
        if self.encoder:
            return ENCODER_SEQUENCES * -(-config.context_length // block_size) + 1
        budget = (kv_cache_bytes if kv_cache_bytes is not None
                  else default_budget_bytes(self.device))
        return num_blocks_for_budget(config, block_size, getattr(torch, self.choice.kv_dtype),
                                     budget)

    def set_num_blocks(self, num_blocks: int) -> None:
        """A fresh KV cache of `num_blocks` (a split model's: as many as its smallest shard
        holds), and the context window it allows."""
        kv_dtype = getattr(torch, self.choice.kv_dtype)
        # One request can never hold more than every block but the null one.
        self.max_model_len = min(self.asked_max_model_len, (num_blocks - 1) * self.block_size)
        self.model.set_max_positions(self.max_model_len)
        self.kv_cache = KVCache(self.config, num_blocks, self.block_size, kv_dtype, self.device)
        self.kv_gathering = KvGathering(self.kv_cache, self.block_size)  # for other engines

    def info(self) -> ExecutorInfo:
        return ExecutorInfo(
            model_name=self.model_name, max_model_len=self.max_model_len,
            num_blocks=self.kv_cache.num_blocks, block_size=self.block_size,
            eos_token_ids=list(self.config.eos_token_ids), vocab_size=self.config.vocab_size,
            # A split model's blocks are spread over its shards: none moves between engines.
            layout=layout_of(self.kv_cache) if self.copies_for_shards is None else None,
            whole_prompts=self.encoder,
            embed_only=self.embed_only,
            max_adapters=self.adapters.max_adapters if self.adapters is not None else 0)

    def step(self, plan: StepPlan) -> StepResult:
        """`execute(plan).result()`: the StepResult of a step run without a bus (tests,
        benchmarks)."""
        return self.execute(plan).result()

    def execute(self, plan: StepPlan, ticket: int | None = None) -> StepOutcome:
        """Apply the plan's bookkeeping, run one forward, sample. Never raises.

        Mutates request state: forgets finished requests, clears preempted block tables,
        registers new requests, extends block tables, appends sampled tokens. With a
        `ticket` (the lead of a split model, `turns` set), in the turns that let another
        plan compute while this one is in the layer shards (plan_overlap.py).
        """
        if ticket is None or self.turns is None:
            return self._execute(plan)
        with self.turns.plan(ticket, plan):
            return self._execute(plan)

    def _execute(self, plan: StepPlan) -> StepOutcome:
        started = time.perf_counter()
        num_tokens = sum(s.num_tokens for s in plan.scheduled)
        threads = (self.small_step_threads if num_tokens <= SMALL_STEP_TOKENS
                   else self.num_threads)
        if self.device.type == "cpu" and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        embeddings: list[PooledEmbedding] = []  # embedding requests whose prompt ends
        try:
            with torch.inference_mode():
                sampled = self._step(plan, embeddings)
        except Exception as exc:  # the adapter reports it; the executor stays up
            return StepOutcome(plan.step_id, SampledTokens(),
                               error=f"{type(exc).__name__}: {exc}")
        self.tokens_out_at = time.perf_counter()
        return StepOutcome(plan.step_id, sampled, time.perf_counter() - started,
                           len(plan.scheduled), num_tokens, embeddings=tuple(embeddings))

    def _forget(self, sequence_id: str) -> None:
        state = self.requests.pop(sequence_id, None)
        if state is not None and state.penalty_slot is not None:
            self.token_counts.release(state.penalty_slot)
        self.kv_gathering.stop(sequence_id)

    def _register(self, new: NewRequestData) -> None:
        if new.params.adapter and self.adapters is None:
            raise ValueError(f"adapter {new.params.adapter!r}: this executor serves none")
        self._forget(new.sequence_id)
        generator = None
        if new.params.seed is not None:  # seeded at each position: see seed_positions
            generator = torch.Generator(device=self.device)
        sampling = RequestSampling.from_params(new.params, self.config.eos_token_ids,
                                               self.config.vocab_size)
        output = new.output_token_ids  # a resumed request's: output it already has
        grammar = (GrammarState.start(self.grammars, new.params.structured, output)
                   if new.params.structured is not None else None)  # may raise: before the slot
        slot = (self.token_counts.add(new.prompt_token_ids, output) if sampling.has_penalties
                else None)
        pooling = (Pooling(resolve_pooling(new.params.pooling, self.pooling),
                           len(new.prompt_token_ids)) if new.params.pooling else None)
        self.requests[new.sequence_id] = RequestState(
            list(new.prompt_token_ids) + list(output), len(new.prompt_token_ids), new.params,
            sampling, generator, slot, grammar=grammar, pooling=pooling)
        self.kv_gathering.start(new)

    def _apply_plan_changes(self, plan: StepPlan) -> None:
        """What the plan changes before its forward: forgotten, preempted and new requests,
        copy-on-write block copies."""
        for sequence_id in plan.finished_sequence_ids:
            self._forget(sequence_id)
        for sequence_id in plan.preempted_sequence_ids:
            if sequence_id in self.requests:
                self.requests[sequence_id].block_table = []
        for new in plan.new_requests:
            self._register(new)
        for copy in plan.copy_blocks:  # copy-on-write of blocks shared by forked requests
            self.kv_cache.copy_block(copy.src, copy.dst)
        if self.adapters is not None and self.adapters.unloading:  # dropped once unused
            self.adapters.collect({s.params.adapter for s in self.requests.values()})
        if self.copies_for_shards is not None:
            self.copies_for_shards.extend(plan.copy_blocks)

    def _step(self, plan: StepPlan, embeddings: list[PooledEmbedding]) -> SampledTokens:
        self._apply_plan_changes(plan)
        if not plan.scheduled:
            return SampledTokens()
        for sched in plan.scheduled:
            state = self.requests.get(sched.sequence_id)
            if state is None:
                raise KeyError(f"unknown sequence {sched.sequence_id!r}")
            state.block_table.extend(sched.new_block_ids)
            check_scheduled(sched, state, self.block_size, self.max_model_len)
        progress = ProgressStream(plan.step_id, self.on_progress, since=self.tokens_out_at)
        sampled = self._forward(plan.scheduled, embeddings)
        self.kv_gathering.gather_filled(plan.scheduled,
                                        lambda sequence_id: self.requests[sequence_id].block_table)
        if plan.multi_step():
            if sampled.num_sampled:  # drafts verified: a step either speculates or takes several
                raise ValueError("a plan with drafts cannot also take several steps")
            return more_steps(plan.scheduled, sampled,
                              lambda scheduled: self._forward(scheduled, embeddings),
                              lambda sequence_id: len(self.requests[sequence_id].token_ids),
                              progress)
        return sampled

    def _forward(self, scheduled: list[ScheduledRequest],
                 embeddings: list[PooledEmbedding]) -> SampledTokens:
        """One forward over `scheduled` (checked, block tables extended), then sampling;
        pooled prompts are added to `embeddings`."""
        input_ids: list[int] = []
        query_lens, context_lens, block_tables = [], [], []
        sampling_rows: list[int] = []  # index of each sampling sequence in the batch
        for index, sched in enumerate(scheduled):
            state = self.requests[sched.sequence_id]
            end = sched.start + sched.num_tokens
            input_ids.extend(state.token_ids[sched.start:end - len(sched.draft_token_ids)])
            input_ids.extend(sched.draft_token_ids)
            query_lens.append(sched.num_tokens)
            context_lens.append(end)
            block_tables.append(state.block_table)
            if sched.sample:
                sampling_rows.append(index)
        meta = build_attention_metadata(query_lens, context_lens, block_tables,
                                        self.block_size, self.device)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)  # [T]
        samplers = [scheduled[i] for i in sampling_rows]
        rows = torch.tensor(sampling_rows, dtype=torch.int64, device=self.device)  # [S]
        last = meta.cu_seqlens_q[1:][rows] - 1  # [S] last token of each sampler
        if self.adapters is not None:
            self.model.step_adapters = self.adapters.step(
                [self.requests[s.sequence_id].params.adapter for s in scheduled], query_lens)
        logits = self.model_forward(ids, meta.positions, meta, self.kv_cache,
                                    logits_indices(last, samplers))
        embeddings += pool_step(scheduled, meta.cu_seqlens_q.tolist(),
                                lambda sequence_id: self.requests[sequence_id].pooling,
                                self.model.last_hidden)
        if not sampling_rows:
            return SampledTokens()
        states = [self.requests[s.sequence_id] for s in samplers]
        if not any(s.draft_token_ids for s in samplers):
            return self._sample(logits, states)
        return sample_with_drafts(logits, samplers, states, self._sample, self.token_counts,
                                  self.shared_generator)

    def _sample(self, logits: torch.Tensor, states: list[RequestState]) -> SampledTokens:
        """Sample one token per state from logits [S, V]; append it, count it, and move its
        grammar on."""
        slots = [s.penalty_slot for s in states if s.penalty_slot is not None]
        tensors = SamplingTensors.build(
            [s.sampling for s in states], self.device,
            num_output_tokens=[s.num_output_tokens for s in states],
            penalty_counts=self.token_counts.gather(slots) if slots else None)
        constrained = [i for i, s in enumerate(states) if s.constrained]
        seed_positions(states)
        allowed_logits = logits if not constrained else apply_masks(
            logits, constrained, self.grammars.bitmask([states[i].grammar.matcher
                                                        for i in constrained]))
        sampled = sample(allowed_logits, tensors, [s.generator for s in states],
                         self.shared_generator)  # [S]
        # Neither `sample` nor the masks touched `logits`: these are the model's raw logprobs.
        logprobs = token_logprobs(logits, sampled, [s.sampling.num_logprobs for s in states])
        token_ids = sampled.tolist()
        for state, token_id in zip(states, token_ids, strict=True):
            state.token_ids.append(token_id)
            if state.grammar is not None:
                state.grammar.take(token_id, self.grammars.token_bytes)
        if slots:
            self.token_counts.record(slots, [t for s, t in zip(states, token_ids, strict=True)
                                             if s.penalty_slot is not None])
        return SampledTokens(token_ids, logprobs)
