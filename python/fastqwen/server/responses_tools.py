"""/v1/responses tools as the chat path's function tools, and the model's calls back as Responses items.

- `function` tools are chat's, flattened: {"type": "function", "name", "description", "parameters", "strict"}.
- `custom` (freeform) tools, such as Codex CLI's apply_patch, take one string: Qwen3 calls tools in JSON, so each is
  rendered as a function of one string parameter `input` (its format's grammar, when it has one, is shown in the
  description, not enforced), and a call comes back as a `custom_tool_call` item with that string as its `input`.
- `namespace` tools (Codex CLI's MCP servers and sub-agent tools) group function and custom tools: they are rendered
  under their own names, and a call comes back with its `namespace`. Two tools with one name are a 400.
- Built-in tools (`web_search`, `file_search`, `code_interpreter`, ...) run on OpenAI's servers; this server runs
  none, so a request that offers one is a 400 naming `tools`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidRequestError

CUSTOM_INPUT = "input"  # the one parameter a custom tool is rendered with

_CODEX_HINT = {
    "web_search": ' (Codex CLI sends it by default: set web_search = "disabled" in its config.toml)',
}


def _fail(where: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{where}: {message}", "tools")


@dataclass
class ToolCatalog:
    """The request's tools: chat's function tools, and per name whether it is custom and its namespace."""

    chat_tools: list[dict[str, Any]] = field(default_factory=list)
    custom: set[str] = field(default_factory=set)
    namespaces: dict[str, str] = field(default_factory=dict)

    def call_item(self, call_id: str, name: str) -> dict[str, Any]:
        """The output item a call of `name` opens (its arguments or input still empty)."""
        if name in self.custom:
            item = {"type": "custom_tool_call", "call_id": call_id, "name": name, "input": ""}
        else:
            item = {"type": "function_call", "call_id": call_id, "name": name, "arguments": ""}
        if name in self.namespaces:
            item["namespace"] = self.namespaces[name]
        return item


def custom_input(arguments: str) -> str:
    """A custom tool's input from the arguments the model wrote ({"input": "..."}); the text as written when the
    model wrote something else (a call cut short by max_output_tokens)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str):
        return value[CUSTOM_INPUT]
    return arguments


def custom_arguments(text: str) -> str:
    """A custom tool call's input as the arguments of the function it is rendered as."""
    return json.dumps({CUSTOM_INPUT: text}, ensure_ascii=False)


def _custom_function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    description = tool.get("description") or ""
    if not isinstance(description, str):
        raise _fail(where, "a tool's description is a string")
    fmt = tool.get("format") or {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar"):
        raise _fail(where, 'a custom tool\'s format is {"type": "text"} or {"type": "grammar", ...}')
    note = "Its input is one string, passed as `input`."
    if fmt["type"] == "grammar":
        note += f" The string follows this {fmt.get('syntax', 'lark')} grammar:\n{fmt.get('definition', '')}"
    parameters = {
        "type": "object",
        "properties": {CUSTOM_INPUT: {"type": "string", "description": "The tool's whole input, as raw text."}},
        "required": [CUSTOM_INPUT],
        "additionalProperties": False,
    }
    return {"name": tool["name"], "description": (description + "\n\n" + note).strip(), "parameters": parameters}


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    return {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}


def tool_catalog(tools: list[Any]) -> ToolCatalog:
    catalog = ToolCatalog()

    def add(tool: Any, where: str, namespace: str | None) -> None:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace" and namespace is None:
            name, inner = tool.get("name"), tool.get("tools")
            if not isinstance(name, str) or not isinstance(inner, list):
                raise _fail(where, "a namespace tool needs its name and its tools (a list)")
            for j, member in enumerate(inner):
                add(member, f"{where}.tools[{j}]", name)
            return
        if not isinstance(tool, dict):
            raise _fail(where, "a tool is an object")
        if kind not in ("function", "custom"):
            raise _fail(
                where,
                f"{kind!r} tools are not supported: only function, custom and namespace tools are (this server runs no "
                f"built-in tools){_CODEX_HINT.get(kind, '')}",
            )
        if kind == "function" and "function" in tool and "name" not in tool:
            raise _fail(where, 'Responses tools are flat: {"type": "function", "name": ..., "parameters": ...}')
        if not isinstance(tool.get("name"), str):
            raise _fail(where, "a tool needs its name")
        function = _function(tool) if kind == "function" else _custom_function(tool, where)
        name = function["name"]
        if any(t["function"]["name"] == name for t in catalog.chat_tools):
            raise _fail(where, f"two tools are named {name!r}: calls could not tell them apart")
        catalog.chat_tools.append({"type": "function", "function": function})
        if kind == "custom":
            catalog.custom.add(name)
        if namespace is not None:
            catalog.namespaces[name] = namespace

    for i, tool in enumerate(tools):
        add(tool, f"tools[{i}]", None)
    return catalog
