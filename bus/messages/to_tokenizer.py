"""Received by the tokenizer (from the api; cache events from the engines for its router), with
its replies."""

from __future__ import annotations

from llmbus.bus.messages.common import ChatMessage, ErrorCode, Message, SamplingParams
from llmbus.bus.messages.to_scheduler import ResumedCompletion


class GenerateRequest(Message):
    """A request the api accepted; either `messages` (chat) or `prompt` is set."""

    request_id: str
    reply_subject: str  # where the detokenizer sends text deltas (the owning api copy)
    model: str
    params: SamplingParams
    messages: list[ChatMessage] = []
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    add_generation_prompt: bool = True
    n: int = 1
    # Function definitions for the chat template (OpenAI's `tools` list as JSON text), when
    # the model is to see them; see services/tool_calls.py.
    tools_json: str = ""
    # A migration (services/api/migration.py): the attempt, the completions it resumes, and
    # the scheduler copy not to route to (the one that failed; empty: any).
    attempt: int = 0
    resumed: list[ResumedCompletion] = []
    avoid_instance_id: str = ""
    # Extra variables for the chat template, a JSON object (`chat_template_kwargs`, vLLM's
    # extension: `{"enable_thinking": false}`); empty: none.
    chat_template_kwargs_json: str = ""
    # The detokenizer copies the api takes for dead (it heard none of them for DEAD_AFTER): no
    # engine sends this request's tokens there, though its own view of them may lag (a
    # scheduler that reconnected counts them alive a while longer, and what it sends them
    # meanwhile is lost with no one left to notice).
    avoid_detokenizer_ids: list[str] = []
    # The prompt continues the last (assistant) message instead of opening a new turn: a
    # prefill, which the Messages API documents (vLLM's `continue_final_message`).
    continue_final_message: bool = False


class Admission(Message):
    """Reply to GenerateRequest / SubmitRequest: accepted (error_code NONE) or refused."""

    num_prompt_tokens: int = 0
    error_code: ErrorCode = ErrorCode.NONE
    error_message: str = ""
    error_param: str | None = None
    # The scheduler process that holds the request (the api watches its heartbeats), and how
    # often it had reconnected when it took it: a later reconnect may have lost its messages.
    scheduler_instance_id: str = ""
    scheduler_reconnects: int = 0
    # A chat whose model thinks (services/api/reasoning.py): split its output at the think
    # tags into reasoning and content; `reasoning_open`: the prompt itself opened the think
    # block, so the output starts as reasoning.
    reasoning: bool = False
    reasoning_open: bool = False


class EncodeRequest(Message):
    """api -> tokenizer: the token ids of a prompt or a conversation (for /tokenize)."""

    messages: list[ChatMessage] = []
    prompt: str | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    chat_template_kwargs_json: str = ""  # as in GenerateRequest
    tools_json: str = ""  # as in GenerateRequest (count_tokens counts the tools' prompt too)
    continue_final_message: bool = False  # as in GenerateRequest


class EncodeResult(Message):
    token_ids: list[int] = []
    error_message: str = ""


class DecodeRequest(Message):
    """api -> tokenizer: the text of token ids (for /detokenize)."""

    token_ids: list[int]


class DecodeResult(Message):
    text: str = ""
    error_message: str = ""


class CacheEvent(Message):
    """An engine's prefix cache changed: blocks (by chained hash) stored or evicted.

    Routers keep an approximate view of what each engine caches from these; see
    bus/block_hash.py for the hash.
    """

    engine_id: str
    stored: list[int] = []
    removed: list[int] = []
    cleared: bool = False  # the engine dropped its whole cache (e.g. after a failure)
    instance_id: str = ""  # the scheduler copy (a restarted engine is a new copy)
