"""The checkpoint's own chat template, rendered with jinja2 the way transformers' apply_chat_template renders it:
a sandboxed environment with trim_blocks and lstrip_blocks, the loop-controls extension, a tojson filter that keeps
non-ASCII text, and the raise_exception and strftime_now helpers.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import InvalidRequestError


class TemplateError(Exception):
    pass


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def load_chat_template(folder: str) -> tuple[str | None, dict[str, str]]:
    """(template, special tokens) from chat_template.jinja or tokenizer_config.json's chat_template."""
    config: dict[str, Any] = {}
    config_path = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(config_path):
        with open(config_path) as f:
            config = json.load(f)
    template = None
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path) as f:
            template = f.read()
    elif isinstance(config.get("chat_template"), str):
        template = config["chat_template"]
    elif isinstance(config.get("chat_template"), list):  # named templates: take the default one
        named = {t["name"]: t["template"] for t in config["chat_template"]}
        template = named.get("default")
    special = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            special[key] = value
    return template, special


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validate messages; content given as a list of text parts becomes one string (parts joined by newlines)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] must be an object with a string role", "messages")
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(
                        f"messages[{i}].content must be a string or a list of text parts ({{'type': 'text', 'text': ...}})",
                        "messages",
                    )
                texts.append(part["text"])
            message["content"] = "\n".join(texts)
        elif content is None:
            message["content"] = ""  # OpenAI allows null content (an assistant turn that only called tools)
        elif not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append(message)
    return out


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(source)
        self._special = dict(special_tokens or {})

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        context = {**self._special, **template_kwargs}
        try:
            return self._template.render(
                messages=normalize_messages(messages),
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **context,
            )
        except TemplateError as e:
            raise InvalidRequestError(f"the chat template rejected the messages: {e}", "messages") from e
        except InvalidRequestError:
            raise
        except Exception as e:  # the template is the checkpoint's and fixed: whatever breaks it came in the messages
            raise InvalidRequestError(f"the chat template failed to render these messages: {e}", "messages") from e
