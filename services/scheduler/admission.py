"""Up-front checks: a request that can never run here is refused before it waits."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import msgspec

from llmbus.bus.messages import KvDestination, ResumedCompletion, SamplingParams
from llmbus.services.scheduler.config import SchedulerConfig
from llmbus.services.scheduler.request import RemotePrefillState, Request, Sent, Trace


class AdmissionError(ValueError):
    """A request that can never run here (too long for the context or the whole cache)."""

    def __init__(self, message: str, param: str | None = None, *,
                 context_length: bool = False) -> None:
        super().__init__(message)
        self.param = param
        self.context_length = context_length


def refuse_task(config: SchedulerConfig, params: SamplingParams, num_prompt_tokens: int) -> str:
    """Why this engine cannot serve the request's kind ("" if it can): generation on an
    embedding engine, or an encoder's prompt longer than one step takes."""
    if config.embed_only and not params.pooling:
        return ("this model only computes embeddings (an encoder, or --task embed): use "
                "/v1/embeddings or /v1/score")
    if config.whole_prompts and num_prompt_tokens > config.max_num_batched_tokens:
        return (f"the input has {num_prompt_tokens} tokens; this encoder takes each input whole, "
                f"in one step of at most {config.max_num_batched_tokens} tokens "
                "(--max-num-batched-tokens)")
    return ""


def resolve_max_tokens(config: SchedulerConfig, num_usable_blocks: int, num_prompt_tokens: int,
                       params: SamplingParams, n: int) -> int:
    """The request's output limit (0 in params = as much as fits), or AdmissionError when
    the prompt, or the prompt plus n outputs, can never fit the context or the KV cache."""
    num_prompt = num_prompt_tokens
    if num_prompt == 0:
        raise AdmissionError("the prompt is empty", param="prompt")
    if not 1 <= n <= config.max_num_seqs:
        raise AdmissionError(f"n must be between 1 and {config.max_num_seqs}", param="n")
    if num_prompt >= config.max_model_len:
        raise AdmissionError(
            f"this model's maximum context length is {config.max_model_len} tokens, "
            f"but the prompt has {num_prompt} tokens", param="messages",
            context_length=True)
    room = config.max_model_len - num_prompt
    if params.max_tokens > room:
        raise AdmissionError(
            f"this model's maximum context length is {config.max_model_len} tokens; "
            f"the prompt has {num_prompt} tokens, so max_tokens can be at most {room} "
            f"(got {params.max_tokens})", param="max_tokens", context_length=True)
    max_tokens = params.max_tokens or room
    num_cache_tokens = num_usable_blocks * config.block_size
    # Completions share the prompt; each needs room for its output and its copy of the
    # shared partial block.
    headroom = 0 if n == 1 else config.block_size
    if num_prompt + n * (max_tokens + headroom) > num_cache_tokens:
        if params.max_tokens:
            raise AdmissionError(
                f"prompt ({num_prompt} tokens) + {n} x max_tokens ({max_tokens}) exceeds "
                f"the KV cache of this server ({num_cache_tokens} tokens)",
                param="max_tokens")
        max_tokens = (num_cache_tokens - num_prompt) // n - headroom
        if max_tokens < 1:
            raise AdmissionError(
                f"the prompt ({num_prompt} tokens) does not fit the KV cache of this "
                f"server ({num_cache_tokens} tokens)", param="messages")
    return max_tokens


def params_for(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index` of a seeded request gets its own seed, so the n texts differ."""
    if index == 0 or params.seed is None:
        return params
    return msgspec.structs.replace(params, seed=params.seed + index)


def sequences(request_id: str, attempt: int, n: int, num_prompt_tokens: int,
              resumed: Sequence[ResumedCompletion]) -> list[tuple[str, int, int, list[int]]]:
    """The sequences an admitted request starts as: (sequence id, completion index, forks,
    output so far). n = 1: one. n > 1: a parent that prefills the prompt and forks into the n
    completions (`<id>#prompt`, then `<id>#<index>`), or n independent ones when the prompt is
    one token (nothing to share). A migrated request's resumed completions continue from the
    tokens they streamed. The sequences of each attempt are distinct (`<request id>~<attempt>`):
    a step of the old attempt still in flight can never feed the new one."""
    base = request_id if attempt == 0 else f"{request_id}~{attempt}"
    if resumed:
        return [(base if n == 1 else f"{base}#{c.index}", c.index, 1, list(c.output_token_ids))
                for c in resumed]
    if n == 1:
        return [(base, 0, 1, [])]
    if num_prompt_tokens == 1:
        return [(f"{base}#{i}", i, 1, []) for i in range(n)]
    return [(f"{base}#prompt", 0, n, [])]


def admitted(request_id: str, reply_subject: str, prompt_token_ids: list[int],
             params: SamplingParams, max_tokens: int, n: int, trace: Trace, attempt: int,
             resumed: Sequence[ResumedCompletion],
             kv_destination: KvDestination | None) -> list[Request]:
    """The Requests an admitted request starts as (`sequences`), each with its own `trace`
    (only its context and arrival time are read)."""
    return [Request(sequence_id, request_id, index, reply_subject, list(prompt_token_ids),
                    params_for(params, index), max_tokens=max_tokens, num_forks=num_forks,
                    attempt=attempt, output_token_ids=output_token_ids,
                    remote=RemotePrefillState(kv_destination=kv_destination),
                    trace=Trace(traceparent=trace.traceparent, arrival_time=trace.arrival_time),
                    sent=Sent(num_tokens=len(output_token_ids)))  # replayed downstream
            for sequence_id, index, num_forks, output_token_ids
            in sequences(request_id, attempt, n, len(prompt_token_ids), resumed)]


def enqueue(waiting: deque[Request], request: Request) -> None:
    """Queue an admitted request. A generation goes ahead of the embedding requests still
    waiting (in arrival order among generations): someone watches its stream start, while
    an embedding client's batch of 32 inputs is thousands of prompt tokens that no one reads
    until all are done (behind them a chat's first token waited ~3 s more, issue 43)."""
    if request.embeds:
        waiting.append(request)
        return
    for position, queued in enumerate(waiting):
        if queued.embeds:
            waiting.insert(position, request)
            return
    waiting.append(request)
