"""`POST /v1/responses/compact`: a long conversation made short, by the model itself.

The conversation (the stored one that `previous_response_id` continues, then `input`) is
shown to the model as a transcript with the request to summarise it; the answer is the
user's messages as they were, then one `compaction` item whose `encrypted_content` holds the
summary. OpenAI encrypts that content; here it is the summary's plain text (the server keeps
no key to hide it with). Sent back as input, a compaction item stands for the turns it
summarises (responses_schema.py)."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from litestar import Request, post
from litestar.datastructures import State

from llmbus.services.api.bodies import Int, decode_body
from llmbus.services.api.chat import start_chat
from llmbus.services.api.errors import bad_request
from llmbus.services.api.openapi import body_of
from llmbus.services.api.responses_items import input_items
from llmbus.services.api.responses_output import new_id, usage
from llmbus.services.api.responses_schema import check_tool_results, input_messages
from llmbus.services.api.responses_stored import history_of
from llmbus.services.api.schemas import ChatCompletionRequest, ChatMessageIn

INSTRUCTION = ("Summarise the conversation below for whoever continues it: what the user "
               "wants, what was decided or found, and what is still open. Be brief and "
               "concrete; leave nothing out that the next answer needs.")
SUMMARY_TOKENS = 512  # the summary's cap unless the request sets max_output_tokens


class CompactRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: str | list[Any] | None = None
    previous_response_id: str | None = None
    instructions: str | None = None
    max_output_tokens: Int | None = None  # the summary's (an extension; OpenAI sets its own)
    prompt_cache_key: str | None = None  # accepted: the prefix cache needs no key


def transcript(messages: list[ChatMessageIn]) -> str:
    """The conversation as text the model reads: one paragraph per turn, named by role."""
    lines = []
    for message in messages:
        text = message.content if isinstance(message.content, str) else ""
        calls = "".join(f" [calls {c.function.name}({c.function.arguments})]"
                        for c in message.tool_calls or [])
        lines.append(f"{message.role}: {text}{calls}".rstrip())
    return "\n\n".join(lines)


@post("/responses/compact", status_code=200, opt=body_of(CompactRequest))
async def compact_response(request: Request, state: State) -> dict:
    req = decode_body(await request.body(), CompactRequest)
    if req.input is None and req.previous_response_id is None:
        raise bad_request("send `input`, `previous_response_id` or both", param="input")
    given = input_messages(req.input) if req.input is not None else []
    conversation = await history_of(state, req.previous_response_id) + given
    check_tool_results(conversation)
    system = INSTRUCTION + (f"\n\nThe conversation's instructions: {req.instructions}"
                            if req.instructions else "")
    generation = await start_chat(state, ChatCompletionRequest(
        model=req.model, temperature=0, max_tokens=req.max_output_tokens or SUMMARY_TOKENS,
        messages=[ChatMessageIn(role="system", content=system),
                  ChatMessageIn(role="user", content=transcript(conversation))]))
    generation.engine.runtime.num_handled += 1
    completion = await generation.collect()
    summary = completion["choices"][0]["message"]["content"] or ""
    kept = [item for item in input_items(req.input or [])
            if item["type"] == "message" and item.get("role") == "user"]
    return {"id": new_id("resp"), "object": "response.compaction",
            "created_at": int(time.time()),
            "output": [*kept, {"type": "compaction", "id": new_id("cmp"),
                               "encrypted_content": summary}],
            "usage": usage(completion["usage"])}
