"""The request parameters that constrain output, checked and turned into one StructuredOutput
(or none): OpenAI's `response_format` and `tools`/`tool_choice`, and vLLM's `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar` extras (the older vLLM family, on both
endpoints). At most one of them may constrain a request.

Every check runs here, before the request is admitted, so bad input is a 400 naming its
parameter: a schema that is not one, a keyword the grammar library does not implement, a regex
or grammar that does not parse, a `tool_choice` naming an unknown function.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from llmbus.bus.messages import StructuredOutput
from llmbus.services.api.errors import bad_request
from llmbus.services.structured_output import ConstraintError, check
from llmbus.services.tool_calls import calls_schema

_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class ToolUse:
    """How a chat request may call functions: `mode` "auto" (text or calls, the model's
    choice) or "required" (calls only, constrained; a named function is "required" over that
    one function)."""

    mode: str
    names: frozenset[str]
    tools_json: str  # the tools the model is shown, for the tokenizer's template


def _constraint(kind: str, spec: str, param: str) -> StructuredOutput:
    structured = StructuredOutput(kind=kind, spec=spec, param=param)
    try:
        check(structured)
    except ConstraintError as exc:
        raise bad_request(str(exc), param=exc.param) from None
    return structured


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise bad_request(f"`{param}` is not valid JSON: {exc}", param=param) from None
    if not isinstance(schema, dict):
        raise bad_request(f"`{param}` must be a JSON schema object", param=param)
    return json.dumps(schema)


def response_format(value: Any) -> StructuredOutput | None:
    param = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or kind == "text":
        return None
    if kind == "json_object":
        return _constraint("json_object", "", param)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request("`response_format.json_schema` must be an object with a "
                              "`schema`", param=param)
        return _constraint("json_schema", _schema_text(spec["schema"], param), param)
    raise bad_request("`response_format.type` must be one of text, json_object, json_schema",
                      param=param)


def guided(req: Any) -> list[StructuredOutput]:
    """vLLM's guided_* parameters that are set, each checked."""
    out = []
    if req.guided_json is not None:
        out.append(_constraint("json_schema", _schema_text(req.guided_json, "guided_json"),
                               "guided_json"))
    if req.guided_regex is not None:
        out.append(_constraint("regex", req.guided_regex, "guided_regex"))
    if req.guided_choice is not None:
        if not req.guided_choice or not all(isinstance(c, str) and c for c in req.guided_choice):
            raise bad_request("`guided_choice` must be a non-empty list of non-empty strings",
                              param="guided_choice")
        out.append(_constraint("choice", json.dumps(req.guided_choice), "guided_choice"))
    if req.guided_grammar is not None:
        out.append(_constraint("grammar", req.guided_grammar, "guided_grammar"))
    return out


def _functions(tools: Any) -> list[dict]:
    if not isinstance(tools, list) or not tools:
        raise bad_request("`tools` must be a non-empty list of functions", param="tools")
    functions = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
                function, dict):
            raise bad_request('each tool must be {"type": "function", "function": {...}}',
                              param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
            raise bad_request(f"function name {name!r} must be 1 to 64 letters, digits, _ or -",
                              param="tools")
        parameters = function.get("parameters")
        if parameters is not None:
            _constraint("json_schema", _schema_text(parameters, "tools"), "tools")
        functions.append(function)
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("function names in `tools` must be unique", param="tools")
    return functions


def tool_use(tools: Any, tool_choice: Any, parallel: bool | None,
             ) -> tuple[ToolUse | None, StructuredOutput | None]:
    """How the request may call functions, and the constraint on its calls, if any."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise bad_request("`tool_choice` needs `tools`", param="tool_choice")
        return None, None
    functions = _functions(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None, None
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise bad_request(f"`tool_choice` names the function {name!r}, which is not in "
                              "`tools`", param="tool_choice")
        functions, choice = chosen, "required"
    elif choice not in ("auto", "required"):
        raise bad_request('`tool_choice` must be "none", "auto", "required" or {"type": '
                          '"function", "function": {"name": ...}}', param="tool_choice")
    use = ToolUse(choice, frozenset(f["name"] for f in functions), json.dumps(
        [{"type": "function", "function": f} for f in functions]))
    if choice == "auto":
        return use, None
    schema = calls_schema(functions, parallel=parallel is not False)
    return use, _constraint("json_schema", json.dumps(schema), "tool_choice")


def output_constraint(req: Any, *, chat: bool) -> tuple[StructuredOutput | None, ToolUse | None]:
    """The one constraint of a request (a 400 if it asks for several), and its tool use."""
    constraints = guided(req)
    fmt = response_format(req.response_format)
    if fmt is not None:
        constraints.append(fmt)
    tools = None
    if chat:
        tools, calls = tool_use(req.tools, req.tool_choice, req.parallel_tool_calls)
        if calls is not None:
            constraints.append(calls)
    if len(constraints) > 1:
        raise bad_request("only one of " + ", ".join(f"`{c.param}`" for c in constraints)
                          + " may constrain the output", param=constraints[1].param)
    if constraints and req.min_tokens:  # the grammar may allow only the end it would ban
        raise bad_request(f"`min_tokens` cannot be combined with `{constraints[0].param}`",
                          param="min_tokens")
    return (constraints[0] if constraints else None), tools
