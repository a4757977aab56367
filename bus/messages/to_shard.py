"""Received by a layer shard (from its engine's lead shard), with its replies.

An engine's executor may be split by layers over several processes (layer_slice.py): the lead
shard (0) takes the scheduler's plans, embeds, samples and asks each other shard in turn to run
its layers on the step's hidden states.
"""

from __future__ import annotations

from llmbus.bus.messages.common import Message
from llmbus.bus.messages.to_executor import BlockCopy

# ShardHidden.error of a shard that no lead has set up: it started after its lead did, and
# the KV its lead's requests hold is not in it (the lead gives its engine up).
NOT_SET_UP = "not set up by a lead since it started"


class ShardSetup(Message):
    """lead -> shard, once it has found every shard: the engine's KV geometry. The shard
    allocates its layers' cache (again, after a restart of the lead) and answers ShardInfo."""

    num_blocks: int
    block_size: int
    max_model_len: int


class ShardInfoRequest(Message):
    pass


class ShardInfo(Message):
    """What a shard holds, for the lead to check that the shards make up one model."""

    model_name: str
    model_bytes: int  # the file's size: two files of one name are told apart
    num_model_layers: int  # the whole model's
    first_layer: int
    end_layer: int
    backend: str  # BackendChoice.describe(): the mode, the kernels, the cache's dtype
    kv_dtype: str
    kv_budget_bytes: int  # what it may spend on its KV cache
    kv_token_bytes: int  # a token's K and V in its layers
    weight_bytes: int  # its tensors' bytes in the file
    kv_bytes: int = 0  # its KV cache's, after ShardSetup
    error: str = ""


class ShardStep(Message):
    """lead -> shard: run your layers on these hidden states. Part `part` of `num_parts`: the
    residual stream's rows [T, D] in `dtype`, raw bytes, split by rows so that no message
    exceeds the server's max_payload; the first part carries the step's geometry. The shard
    answers each part but the last with an empty ShardHidden, the last with its output's
    first part (ShardFetch takes the others)."""

    step_id: int
    part: int
    num_parts: int
    hidden: bytes
    dtype: str = "float32"
    num_tokens: int = 0
    query_lens: list[int] = []
    context_lens: list[int] = []
    block_tables: list[list[int]] = []
    copy_blocks: list[BlockCopy] = []  # before the step: copy-on-write, as StepPlan's


class ShardFetch(Message):
    """lead -> shard: part `part` of the output of step `step_id`."""

    step_id: int
    part: int


class ShardHidden(Message):
    """The shard's output: part `part` of `num_parts` of the residual stream after its last
    layer, as ShardStep's; empty while parts are still coming in; `error` when it failed."""

    part: int = 0
    num_parts: int = 0
    hidden: bytes = b""
    error: str = ""
