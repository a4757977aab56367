"""Function calling: how the model is shown the functions, the one format its calls are
constrained to, and how calls are read back out of its text.

The format: a JSON array of calls, `[{"name": "get_weather", "arguments": {"city": "Paris"}}]`.
With `tool_choice: "required"` or a named function the output is constrained to it (the JSON
schema `calls_schema` builds), so the calls always parse and their arguments always validate.
With `"auto"` the model writes text or calls as it likes; `parse_calls` also reads the
`<tool_call>{...}</tool_call>` blocks and bare call objects of templates that define their own
format (Qwen2.5, Hermes, Llama 3.1), and anything else is the answer's content.

A chat template that renders `tools` itself is given them, as transformers does; for one that
does not (SmolLM2's), `tools_system_prompt` describes the functions and the format in a system
message. Shared by the tokenizer (the prompt) and the api (the schema and the parsing).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON object, as text (what OpenAI's `function.arguments` holds)


def function_of(tool: dict) -> dict:
    """The `function` part of one OpenAI tool (`{"type": "function", "function": {...}}`)."""
    return tool["function"]


def calls_schema(functions: list[dict], parallel: bool) -> dict:
    """The JSON schema of the calls array: each item calls one of `functions` with arguments
    valid for its `parameters` (any object where it has none)."""
    variants = [{
        "type": "object",
        "properties": {"name": {"const": f["name"]},
                       "arguments": f.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False,
    } for f in functions]
    items = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tools_system_prompt(functions: list[dict]) -> str:
    """What a model whose template has no tool format is told about the functions."""
    listed = "\n".join(json.dumps({key: f[key] for key in ("name", "description", "parameters")
                                   if key in f}, ensure_ascii=False) for f in functions)
    return ("You can call these functions:\n" + listed + "\n\nTo call functions, reply with "
            "only a JSON array of calls, like "
            '[{"name": "function_name", "arguments": {"argument": "value"}}]. '
            "Otherwise, answer normally.")


def _as_call(item: Any, names: set[str]) -> Call | None:
    name = item.get("name") if isinstance(item, dict) else None
    if not isinstance(name, str) or name not in names:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return Call(item["name"], json.dumps(arguments, ensure_ascii=False))


def parse_calls(text: str, names: set[str]) -> list[Call] | None:
    """The calls in `text` (every one naming a known function), or None when `text` is not
    calls: a JSON array of calls, one call object, or `<tool_call>` blocks of either, from its
    start (text that opens with prose is an answer, streamed or not)."""
    start = text.lstrip()
    blocks = _TOOL_CALL_BLOCK.findall(start) if start.startswith("<tool_call>") else [start]
    calls: list[Call] = []
    for block in blocks:
        try:
            value = json.loads(block)
        except ValueError:
            return None
        for item in value if isinstance(value, list) and value else [value]:
            call = _as_call(item, names)
            if call is None:
                return None
            calls.append(call)
    return calls or None


def template_messages(messages: list[dict], template_has_tools: bool) -> list[dict]:
    """Chat messages as a template reads them: an assistant's `tool_calls` with arguments as
    objects (transformers' convention); for a template without a tool format, an assistant's
    calls written out in the calls format as its content."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if not calls:
            out.append(message)
            continue
        parsed = []
        for call in calls:
            arguments = call["function"].get("arguments") or "{}"
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass  # the template gets the string as the client sent it
            parsed.append({"id": call.get("id"), "type": "function", "function": {
                "name": call["function"]["name"], "arguments": arguments}})
        if template_has_tools:
            out.append({**message, "tool_calls": parsed})
        else:
            written = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                       for c in parsed]
            text = json.dumps(written, ensure_ascii=False)
            out.append({key: value for key, value in message.items() if key != "tool_calls"}
                       | {"content": ((message.get("content") or "") + text)})
    return out
