"""The structured spec that forces Qwen3's tool-call output, for tool_choice "required" or a named function.

Qwen3's chat template asks for each call as
    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>
with several calls one after another, separated by a newline. The spec is a Lark grammar whose call is an embedded
JSON schema (llguidance's %json) per tool: the name is that tool's, the arguments follow its `parameters` schema.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import InvalidRequestError
from ..sampling_params import StructuredOutput
from .spec import JSON_OPTIONS

_EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # a function of no arguments


def _function(tool: Any, index: int) -> dict:
    if (
        not isinstance(tool, dict)
        or tool.get("type", "function") != "function"
        or not isinstance(tool.get("function"), dict)
    ):
        raise InvalidRequestError(f'tools[{index}] must be {{"type": "function", "function": {{...}}}}', "tools")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"tools[{index}].function.name must be a non-empty string", "tools")
    parameters = function.get("parameters", _EMPTY_PARAMETERS)
    if parameters is None:
        parameters = _EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"tools[{index}].function.parameters must be a JSON schema object", "tools")
    return {"name": name, "parameters": parameters}


def _chosen_name(tool_choice: Any) -> str | None:
    """None for "required"; the function's name for {"type": "function", "function": {"name": ...}}."""
    if tool_choice == "required":
        return None
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if isinstance(name, str) and name:
            return name
    raise InvalidRequestError(
        'tool_choice must be "required" or {"type": "function", "function": {"name": ...}} here', "tool_choice"
    )


def tool_call_structured(
    tools: list[Any], tool_choice: Any = "required", call_tokens: bool = False
) -> StructuredOutput:
    """The spec of one or more <tool_call> blocks over `tools` (OpenAI's shape) for tool_choice "required", or of
    exactly one call of the named function. Raises InvalidRequestError (field "tools" or "tool_choice").

    call_tokens: the tokenizer has <tool_call> and </tool_call> as tokens of their own (Qwen3's does): the grammar
    then asks for those tokens, as the model writes them. (Spelled as text, llguidance would offer the token for the
    forced text and then refuse it, since it keeps added tokens apart from text.)"""
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError("tool_choice needs a non-empty list of tools", "tools")
    functions = [_function(t, i) for i, t in enumerate(tools)]
    name = _chosen_name(tool_choice)
    if name is not None:
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")
        functions = functions[:1]
    calls = []
    for f in functions:
        schema = {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": JSON_OPTIONS,  # the compact JSON of every other schema, not llguidance's free whitespace
        }
        calls.append("%json " + json.dumps(schema, ensure_ascii=True))
    block = (
        'block: <tool_call> "\\n" call "\\n" </tool_call>'
        if call_tokens
        else 'block: "<tool_call>\\n" call "\\n</tool_call>"'
    )
    rules = ["call: " + "\n    | ".join(calls), block]
    start = "start: block" if name is not None else 'start: block ("\\n" block)*'
    lark = "%llguidance {}\n" + "\n".join([start] + rules) + "\n"
    return StructuredOutput("grammar", lark, strict=True, field="tools")
