"""Shared by several messages: the base struct, enums, sampling parameters."""

from __future__ import annotations

import enum

import msgspec


class Message(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True):
    """Every message on the bus (see the package doc for the wire rules)."""


class FinishReason(enum.IntEnum):
    NONE = 0  # still running
    STOP = 1  # eos, a stop token or a stop string
    LENGTH = 2  # max_tokens or the context window
    ABORT = 3  # the client went away or asked to cancel
    ERROR = 4  # a stage failed; `error` says why


class ErrorCode(enum.IntEnum):
    """Why a stage refused or failed a request; the api maps these to HTTP statuses."""

    NONE = 0  # accepted
    INVALID_REQUEST = 1  # -> 400
    CONTEXT_LENGTH_EXCEEDED = 2  # -> 400
    OVERLOADED = 3  # -> 503
    INTERNAL = 4  # -> 500


class StructuredOutput(Message):
    """A constraint on a completion's text, as the client wrote it (never a compiled library
    object: each stage that needs it compiles it, see services/structured_output.py).

    kind: "json_schema" (spec: the schema's JSON text), "json_object" (any JSON object),
    "regex", "choice" (spec: a JSON list of the allowed strings) or "grammar" (Lark, or GBNF
    when it has `::=` rules). `param` is the API parameter it came from, for error messages.
    `after`: the constraint starts once the output has written this text (a thinking model's
    `</think>`: the answer is constrained, not the reasoning); empty: from the first token.
    """

    kind: str
    spec: str = ""
    param: str = "response_format"
    after: str = ""


class SamplingParams(Message):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 16  # 0 = until the context window is full
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    stop: list[str] = []
    include_stop_str_in_output: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already output
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # vLLM/HF: divides (>0) or multiplies (<0) logits of
    #                                  tokens seen in prompt or output
    min_tokens: int = 0  # eos and stop_token_ids are suppressed until this many tokens
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's and the top k
    logit_bias: dict[int, float] = {}
    structured: StructuredOutput | None = None  # constrained decoding (grammar, JSON schema)
    # An embedding request: how its prompt's final hidden states pool into one vector
    # ("mean", "cls", "last"; "model": the model's own default). Nothing is sampled.
    pooling: str = ""
    # The LoRA adapter that generates (its name, as in /v1/models); empty: the base model.
    # It rides here so that every path a request takes (migration, a prefill on another
    # engine) carries it; the prefix cache keys blocks by it (bus/block_hash.py).
    adapter: str = ""


class TokenLogprobs(Message):
    """Log-probabilities of one sampled token, from the model's raw distribution."""

    logprob: float
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []


class ChatMessage(Message):
    role: str
    content: str
    # An assistant's function calls: OpenAI's `tool_calls` list as JSON text (arguments stay
    # strings); a `tool` message's answer names the call it answers.
    tool_calls_json: str = ""
    tool_call_id: str = ""
