"""Typed messages of the pipeline, one module per receiving stage, all re-exported here.

All structs are `array_like` msgspec structs: the field order *is* the wire format. Append new
fields at the end with a default, never reorder or retype; tests/bus/test_bus_messages.py pins every
struct's bytes. A reply lives in the module of its request (the stage that serves it).
`gc=False` because these are plain data with no cycles.

Three id spaces, each named so:
- `request_id` in GenerateRequest, SubmitRequest, AbortRequest, RequestTokens and TextDelta: the
  api's id of one prompt (the public `cmpl-...`/`chatcmpl-...` id, or that id plus `-p` for
  prompt p of a batched /v1/completions); a request's n completions share it and are told
  apart by `index`.
- `sequence_id` in NewRequestData, ScheduledRequest and StepPlan (between the scheduler and
  its executor): one sequence of the engine, the prompt's `request_id` itself when n = 1, with
  `#i` for completion i of n (or `#prompt` for a prompt that n completions will fork from).
- `engine_id`: an engine's `--engine-id` name (its scheduler and executor share it);
  `instance_id`: one process of a stage, new on every start.
"""

from llmbus.bus.messages.common import (
    ChatMessage,
    ErrorCode,
    FinishReason,
    SamplingParams,
    StructuredOutput,
    TokenLogprobs,
)
from llmbus.bus.messages.to_api import (
    ApiMetricsRequest,
    ApiMetricsSnapshot,
    DeltaBatch,
    RecentRequest,
    TextDelta,
    TextLogprob,
)
from llmbus.bus.messages.to_detokenizer import CompletionStart, RequestTokens, TokenBatch
from llmbus.bus.messages.to_every_stage import Heartbeat, Ping, Pong
from llmbus.bus.messages.to_executor import (
    AdapterCommand,
    AdapterReply,
    BlockCopy,
    ExecutorInfo,
    ExecutorInfoRequest,
    GrammarReply,
    GrammarRequest,
    KvChunk,
    KvDestination,
    KvLayout,
    KvReceive,
    KvReply,
    KvTransferReport,
    NewRequestData,
    PooledEmbedding,
    ScheduledRequest,
    StepPlan,
    StepProgress,
    StepResult,
)
from llmbus.bus.messages.to_scheduler import (
    AbortRequest,
    EngineStats,
    EngineStatsRequest,
    ModelInfo,
    ModelInfoRequest,
    PrefillDone,
    PrefillReply,
    PrefillRequest,
    ResumedCompletion,
    SubmitRequest,
    UnknownCompletion,
)
from llmbus.bus.messages.to_shard import (
    NOT_SET_UP,
    ShardFetch,
    ShardHidden,
    ShardInfo,
    ShardInfoRequest,
    ShardSetup,
    ShardStep,
)
from llmbus.bus.messages.to_tokenizer import (
    Admission,
    CacheEvent,
    DecodeRequest,
    DecodeResult,
    EncodeRequest,
    EncodeResult,
    GenerateRequest,
)

__all__ = [
    "NOT_SET_UP", "AbortRequest", "AdapterCommand", "AdapterReply", "Admission",
    "ApiMetricsRequest", "ApiMetricsSnapshot", "BlockCopy",
    "CacheEvent", "ChatMessage", "CompletionStart", "DecodeRequest", "DecodeResult", "DeltaBatch",
    "EncodeRequest", "EncodeResult", "EngineStats", "EngineStatsRequest", "ErrorCode",
    "ExecutorInfo", "ExecutorInfoRequest", "FinishReason", "GenerateRequest", "GrammarReply",
    "GrammarRequest", "Heartbeat", "KvChunk", "KvDestination", "KvLayout", "KvReceive", "KvReply",
    "KvTransferReport", "ModelInfo", "ModelInfoRequest", "NewRequestData", "Ping", "Pong",
    "PooledEmbedding", "PrefillDone", "PrefillReply", "PrefillRequest", "RecentRequest",
    "RequestTokens",
    "ResumedCompletion", "SamplingParams", "ScheduledRequest", "ShardFetch", "ShardHidden",
    "ShardInfo", "ShardInfoRequest", "ShardSetup", "ShardStep", "StepPlan", "StepProgress",
    "StepResult",
    "StructuredOutput", "SubmitRequest", "TextDelta", "TextLogprob", "TokenBatch",
    "TokenLogprobs", "UnknownCompletion",
]
