# Over 300 lines: one class whose request state, steps and sampling (with or without drafts)
# share every field; the engines and the sampling ladder live in engines/ and sampling/.
"""The executor's pure core: request state, one batched forward per StepPlan, sampling.

No NATS, no asyncio: the service adapter decodes a StepPlan, calls `ModelRunner.step`, and
publishes the StepResult. The runner keeps each request's tokens and block table, so plans
carry only deltas (new requests once, new block ids, token ranges to compute).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from llmbus.bus.messages import (
    ExecutorInfo,
    KvDestination,
    NewRequestData,
    SamplingParams,
    ScheduledRequest,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from llmbus.services.executor.attention.metadata import build_attention_metadata
from llmbus.services.executor.engine import Engine
from llmbus.services.executor.kv_cache import (
    KVCache,
    default_budget_bytes,
    num_blocks_for_budget,
)
from llmbus.services.executor.kv_transfer import Outgoing, gather, layout_of
from llmbus.services.executor.plan import ExecutionPlan, resolve_plan
from llmbus.services.executor.sampling.constraints import Grammars, Vocabulary, apply_masks
from llmbus.services.executor.sampling.logprobs import token_logprobs
from llmbus.services.executor.sampling.penalties import TokenCounts
from llmbus.services.executor.sampling.sampler import sample
from llmbus.services.executor.sampling.sampling_tensors import RequestSampling, SamplingTensors
from llmbus.services.executor.sampling.speculative import position_tensors, verify
from llmbus.services.executor.weights.gguf_loader import load_gguf
from llmbus.services.executor.weights.model_config import LlamaConfig

if TYPE_CHECKING:
    from llguidance import LLMatcher


@dataclass
class _RequestState:
    token_ids: list[int]  # prompt + sampled tokens
    num_prompt_tokens: int
    params: SamplingParams
    sampling: RequestSampling
    generator: torch.Generator | None  # only for seeded requests
    penalty_slot: int | None  # its row in the runner's TokenCounts, if it has penalties
    block_table: list[int] = field(default_factory=list)
    matcher: LLMatcher | None = None  # constrained decoding: where its grammar is
    # ... and the text its grammar waits for before it starts (`</think>`: b"" once written),
    # with the output's last bytes, where that text may be half written
    constraint_after: bytes = b""
    tail: bytes = b""
    # A prefill for another engine (kv_transfer.py): where its blocks go, and how many of the
    # prompt's blocks are gathered for it so far.
    destination: KvDestination | None = None
    num_blocks_gathered: int = 0
    traceparent: str = ""

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def constrained(self) -> bool:
        """Whether its next token is masked by its grammar."""
        return self.matcher is not None and not self.constraint_after

    def take(self, token_id: int, token_bytes: Callable[[int], bytes]) -> None:
        """A sampled token into the grammar, or towards the text the grammar waits for."""
        if self.matcher is None:
            return
        if not self.constraint_after:
            self.matcher.consume_token(token_id)
            return
        self.tail += token_bytes(token_id)
        if self.constraint_after in self.tail:
            self.constraint_after = b""  # the grammar takes the tokens from the next one on
        else:
            self.tail = self.tail[-len(self.constraint_after):]


def _seed_positions(states: list[_RequestState]) -> None:
    """Seed each seeded request's generator for the output position it samples now: its draws
    depend on (seed, position) alone, so a request resumed at position k on another engine
    (migrated) goes on exactly as it would have, and so does one sharing a batch."""
    for state in states:
        if state.generator is not None:
            seed = state.params.seed or 0
            state.generator.manual_seed((seed * 1_000_003 + state.num_output_tokens)
                                        % (1 << 63))


# A step this small (a few decodes) is short and memory-bound. When the executor shares a small
# machine with the rest of the stack, a thread of its parallel matmuls that gets descheduled
# stalls the whole step at the next barrier; leaving a core to the other services costs such
# steps less than it saves (2 cores: 35.6 tok/s single-stream with 1 thread, 27.8 with 2).
SMALL_STEP_TOKENS = 4


class ModelRunner:
    """Owns the weights, the physical KV cache and every live request's state."""

    def __init__(self, model_path: str | Path, *, model_name: str,
                 plan: ExecutionPlan | None = None, engine: str = "torch", exact: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_bytes: int | None = None, max_model_len: int | None = None,
                 num_threads: int | None = None, small_step_threads: int | None = None) -> None:
        """`plan` (plan.py) says which engine runs; without one, it is resolved here from
        `engine`, `exact`, `dtype` and `device` (tests and benchmarks pick engines so).

        `small_step_threads`: CPU threads for steps of at most SMALL_STEP_TOKENS tokens (None:
        `num_threads`), see SMALL_STEP_TOKENS; torch engine only (the CPU engines keep
        single-threaded sessions for small steps themselves, or need every core).
        """
        if plan is None:
            plan = resolve_plan(model_path, engine=engine, exact=exact,
                                dtype=str(dtype).removeprefix("torch."), device=str(device))
        self.plan = plan
        if num_threads:
            torch.set_num_threads(num_threads)
        self.num_threads = torch.get_num_threads()
        self.small_step_threads = small_step_threads or self.num_threads
        self.model_name, self.block_size = model_name, block_size
        self.device = torch.device(plan.device)
        self.model: Engine
        if plan.engine == "torch":
            config = self._load_torch(model_path, getattr(torch, plan.dtype))
        else:
            config = self._load_cpu(model_path, plan)
            self.small_step_threads = self.num_threads
        kv_dtype = getattr(torch, plan.kv_dtype)
        if max_model_len is not None and max_model_len > config.context_length:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context "
                             f"length {config.context_length}")
        self.config = config
        if num_blocks is None:
            budget = (kv_cache_bytes if kv_cache_bytes is not None
                      else default_budget_bytes(self.device))
            num_blocks = num_blocks_for_budget(config, block_size, kv_dtype, budget)
        # One request can never hold more than every block but the null one.
        self.max_model_len = min(max_model_len or config.context_length,
                                 (num_blocks - 1) * block_size)
        self.model.set_max_positions(self.max_model_len)
        self.kv_cache = KVCache(config, num_blocks, block_size, kv_dtype, self.device)
        self.kv_outbox: list[Outgoing] = []  # gathered blocks for other engines (_gather_kv)
        self.dropped_transfers: list[str] = []  # ... of sequences forgotten (their sends stop)
        self.kv_chunk_bytes = 1 << 20  # the bus's max_payload: the service sets it
        self.requests: dict[str, _RequestState] = {}  # by sequence_id
        self.token_counts = TokenCounts(self.device)
        self.shared_generator = torch.Generator(device=self.device)
        self.shared_generator.seed()
        self.grammars = Grammars(lambda: Vocabulary.from_gguf(
            model_path, config.vocab_size, config.eos_token_ids), config.vocab_size)

    def _load_torch(self, model_path: str | Path, dtype: torch.dtype) -> LlamaConfig:
        from llmbus.services.executor.engines.torch_llama import LlamaModel

        config, dense, _ = load_gguf(model_path)
        self.model = LlamaModel(config, dense, max_positions=1, dtype=dtype, device=self.device)
        return config

    def _load_cpu(self, model_path: str | Path, plan: ExecutionPlan) -> LlamaConfig:
        from llmbus.services.executor.engines.cpu_llama import CpuLlamaModel
        from llmbus.services.executor.weights.quant_parts import tile_as_loaded

        # The integer kernel takes its matrices tiled: tile each as it is loaded, so the load
        # never holds every matrix twice. ONNX Runtime's graphs read the loaded forms.
        tiled = plan.engine == "integer-kernel"
        config, dense, native = load_gguf(model_path, keep_native=True, dense_for_native=False,
                                          transform=tile_as_loaded if tiled else None,
                                          exact=plan.exact)
        self.model = CpuLlamaModel(
            config, dense, native, max_positions=1, exact=plan.exact, integer_kernel=tiled,
            isa=plan.isa, num_threads=self.num_threads, release_native=True)
        del dense, native  # what the model did not keep goes now
        return config

    def info(self) -> ExecutorInfo:
        return ExecutorInfo(
            model_name=self.model_name, max_model_len=self.max_model_len,
            num_blocks=self.kv_cache.num_blocks, block_size=self.block_size,
            eos_token_ids=list(self.config.eos_token_ids), vocab_size=self.config.vocab_size,
            layout=layout_of(self.kv_cache))

    def step(self, plan: StepPlan) -> StepResult:
        """Apply the plan's bookkeeping, run one forward, sample. Never raises.

        Mutates request state: forgets finished requests, clears preempted block tables,
        registers new requests, extends block tables, appends sampled tokens.
        """
        started = time.perf_counter()
        num_tokens = sum(s.num_tokens for s in plan.scheduled)
        threads = (self.small_step_threads if num_tokens <= SMALL_STEP_TOKENS
                   else self.num_threads)
        if self.device.type == "cpu" and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        try:
            with torch.inference_mode():
                sampled, logprobs, num_sampled = self._step(plan)
        except Exception as exc:  # the adapter reports it; the executor stays up
            return StepResult(step_id=plan.step_id, error=f"{type(exc).__name__}: {exc}")
        return StepResult(
            step_id=plan.step_id, sampled_token_ids=sampled,
            forward_seconds=time.perf_counter() - started, batch_size=len(plan.scheduled),
            num_tokens=num_tokens, logprobs=logprobs, num_sampled=num_sampled)

    def _forget(self, sequence_id: str) -> None:
        state = self.requests.pop(sequence_id, None)
        if state is not None and state.penalty_slot is not None:
            self.token_counts.release(state.penalty_slot)
        if state is not None and state.destination is not None:
            self.dropped_transfers.append(state.destination.transfer_id)

    def _register(self, new: NewRequestData) -> None:
        self._forget(new.sequence_id)
        generator = None
        if new.params.seed is not None:  # seeded at each position: see _seed_positions
            generator = torch.Generator(device=self.device)
        sampling = RequestSampling.from_params(new.params, self.config.eos_token_ids,
                                               self.config.vocab_size)
        matcher = (self.grammars.matcher(new.params.structured)  # may raise: before the slot
                   if new.params.structured is not None else None)
        output = new.output_token_ids  # a resumed request's: output it already has
        slot = (self.token_counts.add(new.prompt_token_ids, output) if sampling.has_penalties
                else None)
        destination = new.kv_destination
        state = self.requests[new.sequence_id] = _RequestState(
            list(new.prompt_token_ids) + list(output), len(new.prompt_token_ids), new.params,
            sampling, generator, slot, matcher=matcher, destination=destination,
            num_blocks_gathered=destination.first_block if destination else 0,
            traceparent=new.traceparent, constraint_after=(
                new.params.structured.after.encode() if matcher is not None else b""))
        for token_id in output:  # the grammar is where those tokens took it
            state.take(token_id, self.grammars.token_bytes)

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

    def _check_scheduled(self, sched: ScheduledRequest, state: _RequestState) -> None:
        """Refuse a share of a step that the request's tokens and blocks cannot serve."""
        end = sched.start + sched.num_tokens
        known_end = end - len(sched.draft_token_ids)
        if sched.draft_token_ids and (not sched.sample or known_end <= sched.start):
            raise ValueError(f"sequence {sched.sequence_id!r}: drafts must follow a known token "
                             "of a step that samples")
        if sched.num_steps > 1 and (sched.draft_token_ids or not sched.sample
                                    or sched.num_tokens != 1):
            raise ValueError(f"sequence {sched.sequence_id!r}: several steps are for a plain "
                             "decode (one token, sampled, no drafts)")
        end += sched.num_steps - 1  # the positions the further steps write
        if sched.num_tokens < 1 or sched.start < 0 or known_end > len(state.token_ids):
            raise ValueError(f"sequence {sched.sequence_id!r}: tokens [{sched.start}, "
                             f"{known_end}) outside its {len(state.token_ids)} known tokens")
        if sched.sample and known_end != len(state.token_ids):
            raise ValueError(f"sequence {sched.sequence_id!r}: sampling after token {end} "
                             f"of {len(state.token_ids)} would skip known tokens")
        if end > self.max_model_len:
            raise ValueError(f"sequence {sched.sequence_id!r}: {end} tokens exceed "
                             f"max_model_len {self.max_model_len}")
        if len(state.block_table) * self.block_size < end:
            raise ValueError(f"sequence {sched.sequence_id!r}: {len(state.block_table)} "
                             f"blocks cannot hold {end} tokens")

    def _step(self, plan: StepPlan) -> tuple[list[int], list[TokenLogprobs | None], list[int]]:
        self._apply_plan_changes(plan)
        if not plan.scheduled:
            return [], [], []
        for sched in plan.scheduled:
            state = self.requests.get(sched.sequence_id)
            if state is None:
                raise KeyError(f"unknown sequence {sched.sequence_id!r}")
            state.block_table.extend(sched.new_block_ids)
            self._check_scheduled(sched, state)
        sampled, logprobs, counts = self._forward(plan.scheduled)
        self._gather_kv(plan.scheduled)
        if any(s.num_steps > 1 for s in plan.scheduled):
            if counts:  # drafts verified: a step either speculates or takes several steps
                raise ValueError("a plan with drafts cannot also take several steps")
            return self._more_steps(plan.scheduled, sampled, logprobs)
        return sampled, logprobs, counts

    def _gather_kv(self, scheduled: list[ScheduledRequest]) -> None:
        """Prefills for other engines: copy out the prompt blocks this step filled (the last,
        partial one with the prompt's end), for the service to send (kv_transfer.py)."""
        for sched in scheduled:
            state = self.requests[sched.sequence_id]
            if state.destination is None:
                continue
            end = sched.start + sched.num_tokens
            final = end >= state.num_prompt_tokens
            upto = (-(-state.num_prompt_tokens // self.block_size) if final
                    else end // self.block_size)
            if upto > state.num_blocks_gathered or final:
                self.kv_outbox.append(gather(
                    self.kv_cache, state.destination,
                    state.block_table[state.num_blocks_gathered:upto],
                    state.num_blocks_gathered, self.kv_chunk_bytes, final, state.traceparent))
                state.num_blocks_gathered = upto

    def take_kv_outbox(self) -> tuple[list[Outgoing], list[str]]:
        """Blocks gathered for other engines, and the transfers of sequences forgotten."""
        outbox, self.kv_outbox = self.kv_outbox, []
        dropped, self.dropped_transfers = self.dropped_transfers, []
        return outbox, dropped

    def _more_steps(self, scheduled: list[ScheduledRequest], first: list[int],
                    first_logprobs: list[TokenLogprobs | None],
                    ) -> tuple[list[int], list[TokenLogprobs | None], list[int]]:
        """Multi-step decoding: after the plan's forward, decode the requests that asked for
        more steps, one forward per step, each feeding its own last token. Returns every
        sampler's tokens in plan order, with their counts."""
        samplers = [s for s in scheduled if s.sample]
        tokens = {s.sequence_id: [t] for s, t in zip(samplers, first, strict=True)}
        with_logprobs = bool(first_logprobs)
        logprobs = {s.sequence_id: [lp] for s, lp in zip(
            samplers, first_logprobs or [None] * len(samplers), strict=True)}
        for step in range(1, max(s.num_steps for s in samplers)):
            batch = [ScheduledRequest(sequence_id=s.sequence_id, num_tokens=1,
                                      start=len(self.requests[s.sequence_id].token_ids) - 1)
                     for s in samplers if s.num_steps > step]
            sampled, step_logprobs, _ = self._forward(batch)
            with_logprobs = with_logprobs or bool(step_logprobs)
            for s, token, lp in zip(batch, sampled, step_logprobs or [None] * len(batch),
                                    strict=True):
                tokens[s.sequence_id].append(token)
                logprobs[s.sequence_id].append(lp)
        order = [s.sequence_id for s in samplers]
        return ([t for r in order for t in tokens[r]],
                [lp for r in order for lp in logprobs[r]] if with_logprobs else [],
                [len(tokens[r]) for r in order])

    def _forward(self, scheduled: list[ScheduledRequest],
                 ) -> tuple[list[int], list[TokenLogprobs | None], list[int]]:
        """One forward over `scheduled` (checked, block tables extended), then sampling."""
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
        logits_indices = self._logits_indices(meta, sampling_rows, samplers)
        logits = self.model.forward(ids, meta.positions, meta, self.kv_cache, logits_indices)
        if not sampling_rows:
            return [], [], []
        states = [self.requests[s.sequence_id] for s in samplers]
        if not any(s.draft_token_ids for s in samplers):
            return *self._sample(logits, states), []
        return self._sample_with_drafts(logits, samplers, states)

    def _logits_indices(self, meta, sampling_rows: list[int],
                        samplers: list[ScheduledRequest]) -> torch.Tensor:
        """The query positions whose logits are sampled: each sampler's last token, and
        before it one position per draft (the last known token and every draft but the last).
        """
        rows = torch.tensor(sampling_rows, dtype=torch.int64, device=self.device)  # [S]
        last = meta.cu_seqlens_q[1:][rows] - 1  # [S] last token of each sampler
        if not any(s.draft_token_ids for s in samplers):
            return last
        back = [j for s in samplers for j in range(len(s.draft_token_ids), -1, -1)]
        counts = torch.tensor([len(s.draft_token_ids) + 1 for s in samplers], device=self.device)
        return last.repeat_interleave(counts) - torch.tensor(back, device=self.device)

    def _sample_with_drafts(self, logits: torch.Tensor, samplers: list[ScheduledRequest],
                            states: list[_RequestState],
                            ) -> tuple[list[int], list[TokenLogprobs | None], list[int]]:
        """Samplers without drafts sample as usual; the others verify their drafts
        (speculative.py). logits holds 1 row per plain sampler, d + 1 per one with d drafts."""
        firsts, row = [], 0
        for s in samplers:
            firsts.append(row)
            row += len(s.draft_token_ids) + 1
        plain = [i for i, s in enumerate(samplers) if not s.draft_token_ids]
        plain_tokens, plain_logprobs = iter([]), iter([])
        if plain:
            rows = torch.tensor([firsts[i] for i in plain], device=self.device)
            tokens, logprobs = self._sample(logits.index_select(0, rows),
                                            [states[i] for i in plain])
            plain_tokens, plain_logprobs = iter(tokens), iter(logprobs or [None] * len(tokens))
        sampled: list[int] = []
        logprobs_out: list[TokenLogprobs | None] = []
        counts: list[int] = []
        for i, (sched, state) in enumerate(zip(samplers, states, strict=True)):
            if not sched.draft_token_ids:
                sampled.append(next(plain_tokens))
                logprobs_out.append(next(plain_logprobs))
                counts.append(1)
                continue
            drafts = list(sched.draft_token_ids)
            rows = logits[firsts[i]:firsts[i] + len(drafts) + 1]
            seen = None
            if state.penalty_slot is not None:
                token_ids, output_counts = self.token_counts.gather([state.penalty_slot])
                seen = dict(zip(token_ids[0].tolist(), output_counts[0].tolist(), strict=True))
            tensors = position_tensors(state.sampling, state.num_output_tokens, drafts, seen,
                                       self.device)
            _seed_positions([state])
            tokens = verify(rows, drafts, tensors, state.generator or self.shared_generator)
            for token in tokens:
                state.token_ids.append(token)
                if state.penalty_slot is not None:
                    self.token_counts.record([state.penalty_slot], [token])
            sampled += tokens
            counts.append(len(tokens))
            logprobs_out += token_logprobs(
                rows[:len(tokens)], torch.tensor(tokens, device=self.device),
                [state.sampling.num_logprobs] * len(tokens)) or [None] * len(tokens)
        if all(lp is None for lp in logprobs_out):
            logprobs_out = []
        return sampled, logprobs_out, counts

    def _sample(self, logits: torch.Tensor, states: list[_RequestState],
                ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Sample one token per state from logits [S, V]; append it and count it."""
        slots = [s.penalty_slot for s in states if s.penalty_slot is not None]
        tensors = SamplingTensors.build(
            [s.sampling for s in states], self.device,
            num_output_tokens=[s.num_output_tokens for s in states],
            penalty_counts=self.token_counts.gather(slots) if slots else None)
        constrained = [i for i, s in enumerate(states) if s.constrained]
        _seed_positions(states)
        allowed_logits = logits if not constrained else apply_masks(
            logits, constrained, self.grammars.bitmask([states[i].matcher for i in constrained]))
        sampled = sample(allowed_logits, tensors, [s.generator for s in states],
                         self.shared_generator)  # [S]
        # Neither `sample` nor the masks touched `logits`: these are the model's raw logprobs.
        logprobs = token_logprobs(logits, sampled, [s.sampling.num_logprobs for s in states])
        token_ids = sampled.tolist()
        for state, token_id in zip(states, token_ids, strict=True):
            state.token_ids.append(token_id)
            state.take(token_id, self.grammars.token_bytes)
        if slots:
            self.token_counts.record(slots, [t for s, t in zip(states, token_ids, strict=True)
                                             if s.penalty_slot is not None])
        return token_ids, logprobs
