"""Received by the executor (from the scheduler), with its replies."""

from __future__ import annotations

from llmbus.bus.messages.common import Message, SamplingParams, StructuredOutput, TokenLogprobs


class ExecutorInfoRequest(Message):
    pass


class ExecutorInfo(Message):
    """What the executor owns: the physical KV cache geometry and the model limits."""

    model_name: str
    max_model_len: int
    num_blocks: int
    block_size: int
    eos_token_ids: list[int]
    vocab_size: int
    layout: KvLayout | None = None  # what one block of its cache is, for KV moved between engines
    # An encoder (BERT's family): every prompt in one step, never in chunks.
    whole_prompts: bool = False
    embed_only: bool = False  # an encoder, or `--task embed`: generation is refused
    num_shards: int = 1  # processes its model is split over by layers (layer_slice.py)
    # LoRA adapters one step may mix (`--max-loras`); 0: the executor serves none.
    max_adapters: int = 0


class AdapterCommand(Message):
    """api -> every executor (request, many replies): load the adapter `name` from the bus's
    adapter store (services/adapter_store_bus.py) and check that it fits the base model
    (`load`), or forget it (`unload`: requests already running on it finish first)."""

    name: str
    action: str  # "load" | "unload"


class AdapterReply(Message):
    engine_id: str
    error: str = ""  # empty: done; else why this engine refused (one line)
    enabled: bool = True  # false: this engine was started without adapters (--max-loras 0)


class KvLayout(Message):
    """The shape and type of one KV block: engines move blocks between equal layouts only."""

    dtype: str  # torch's name: "float16", "float32", "bfloat16"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def describe(self) -> str:
        return (f"{self.dtype}, {self.block_size} tokens a block, {self.num_layers} layers, "
                f"{self.num_kv_heads} KV heads of {self.head_dim}")

    def mismatch(self, other: KvLayout | None, mine: str = "this cache",
                 theirs: str = "the other engine's") -> str:
        """Why blocks of `other` cannot go into (or come from) blocks of this layout; ""."""
        if other == self:
            return ""
        described = other.describe() if other is not None else "unknown"
        return f"KV layout mismatch: {mine} is {self.describe()}, {theirs} {described}"


class GrammarRequest(Message):
    """scheduler -> executor: compile this constraint now (off the step loop) and keep it, so
    that the request it belongs to can be scheduled; the reply says whether it compiled."""

    structured: StructuredOutput


class GrammarReply(Message):
    error: str = ""  # empty: compiled and cached


class KvDestination(Message):
    """Disaggregated prefill, on the prefill engine: where this sequence's KV goes. Block i of
    the prompt, for i >= first_block, is written into the decode engine's block
    block_ids[i - first_block] (blocks before first_block the decode engine caches already)."""

    transfer_id: str
    engine_id: str  # the decode engine: its executor takes the blocks (executor_kv)
    first_block: int
    block_ids: list[int]


class NewRequestData(Message):
    """Sent once, in the first step that schedules a sequence."""

    sequence_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    traceparent: str = ""  # W3C trace context of the request: executor step spans link to it
    # A resumed request (migrated mid-stream): the output it already has. They follow the
    # prompt in the sequence and count as output for penalties, min_tokens and its grammar.
    output_token_ids: list[int] = []
    kv_destination: KvDestination | None = None  # a prefill for another engine: send its KV


class ScheduledRequest(Message):
    """One request's share of a step: compute `num_tokens` tokens from `start`.

    The executor keeps each request's tokens (prompt + what it sampled) and its block table, so
    the plan only carries deltas: blocks appended to the table since the last step. A prefill
    chunk has num_tokens > 1; a decode has num_tokens == 1 and feeds the last sampled token.
    `sample` is false for a prefill chunk that does not reach the end of the known tokens.

    Speculative decoding: `draft_token_ids` (d guesses) follow the known tokens in the query,
    which is then num_tokens = (tokens from `start` to the last known) + d long; the executor
    keeps the drafts the model agrees with and samples one more token after them.

    Multi-step decoding: a decode with `num_steps` s > 1 runs s forwards in this step, each
    feeding the token the one before sampled, and samples exactly s tokens (its blocks hold
    them all; a plan planned ahead already counts on them): one plan and one result carry s
    tokens of a small batch, not one.
    """

    sequence_id: str
    start: int
    num_tokens: int
    new_block_ids: list[int] = []
    sample: bool = True
    draft_token_ids: list[int] = []
    num_steps: int = 1


class BlockCopy(Message):
    """Copy-on-write: copy every layer's KV of block `src` into block `dst` before the step."""

    src: int
    dst: int


class StepPlan(Message):
    step_id: int
    new_requests: list[NewRequestData] = []
    scheduled: list[ScheduledRequest] = []
    # Sequences the executor forgets (finished or aborted) before running this step.
    finished_sequence_ids: list[str] = []
    # Sequences whose blocks were taken back: the executor clears their block tables and keeps
    # their tokens, so a later ScheduledRequest recomputes them from start 0.
    preempted_sequence_ids: list[str] = []
    copy_blocks: list[BlockCopy] = []
    # KV transfers into this engine that ended (done or given up): the executor takes no more
    # blocks for them, before this step may reuse their blocks.
    closed_transfers: list[str] = []

    def multi_step(self) -> bool:
        """Whether a request of the plan takes several forwards in it (multi-step decoding)."""
        return any(item.num_steps > 1 for item in self.scheduled)


class StepResult(Message):
    step_id: int
    # The plan's scheduled requests that had sample=True, in the same order: one token each,
    # or num_sampled[i] consecutive ones for request i.
    sampled_token_ids: list[int] = []
    forward_seconds: float = 0.0
    batch_size: int = 0
    num_tokens: int = 0
    error: str = ""
    # Time the executor sat waiting for this plan since it answered the previous one.
    idle_seconds: float = 0.0
    # Parallel to sampled_token_ids; None where the request did not ask for logprobs.
    logprobs: list[TokenLogprobs | None] = []
    # Tokens each sampling request got, in order, when a step verified drafts (accepted
    # drafts + 1); empty means one each.
    num_sampled: list[int] = []
    # A prefill engine's KV transfers that ended with this step: all sent and acknowledged,
    # or failed (`error`: the decode engine refused or is gone).
    transfers: list[KvTransferReport] = []
    # Embedding requests whose prompt this step finished: their pooled vectors.
    embeddings: list[PooledEmbedding] = []


class StepProgress(Message):
    """executor -> its scheduler (publish), while a plan of several forwards runs (multi-step
    decoding): what its forwards sampled so far, as they sample it, so that the tokens stream
    at about the pace they are made rather than a plan's worth at a time. One message for the
    whole batch every few forwards; the plan's StepResult still carries every token, so a
    progress message that is lost or late delays tokens and never loses them."""

    step_id: int
    forward: int  # the first forward it covers: 0 for the plan's first, then 1, 2, ...
    num_forwards: int = 1  # forwards forward .. forward + num_forwards - 1
    # Forward by forward, one token for each sampling request of the plan still going at
    # that forward (those with num_steps > it), in plan order.
    sampled_token_ids: list[int] = []
    logprobs: list[TokenLogprobs | None] = []  # parallel to them, or empty


class PooledEmbedding(Message):
    sequence_id: str
    vector: bytes  # float32, little-endian: the prompt's final hidden states, pooled


class KvTransferReport(Message):
    transfer_id: str
    num_bytes: int = 0
    seconds: float = 0.0  # while any of its chunks was in flight
    error: str = ""
    # After the prefill's last forward, until its last chunk was acknowledged: what the
    # transfer adds to the time to the first token.
    wait_seconds: float = 0.0


class KvReceive(Message):
    """decode scheduler -> its executor: take the blocks of this transfer into these block ids
    (which the scheduler holds for it); refused unless the sender's layout is this cache's."""

    transfer_id: str
    block_ids: list[int]
    layout: KvLayout


class KvChunk(Message):
    """prefill executor -> decode executor: the K and V of some blocks (layers first_layer..
    first_layer+num_layers of each), raw bytes in the cache's layout
    `[num_layers, len(block_ids), block_size, num_kv_heads, head_dim]`. A chunk is never
    bigger than the server's max_payload."""

    transfer_id: str
    block_ids: list[int]
    first_layer: int
    num_layers: int
    k: bytes
    v: bytes


class KvReply(Message):
    """The answer to KvReceive and to each KvChunk: empty = taken."""

    error: str = ""
