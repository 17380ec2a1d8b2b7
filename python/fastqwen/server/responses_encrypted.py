"""reasoning.encrypted_content: a reasoning item's text in a form a stateless client (Codex CLI with store false)
carries to the next request, where it becomes the assistant turn's reasoning again.

Opaque, not secret: base64 of a small JSON object {"v": version, "text": reasoning}. OpenAI encrypts it so that
only its servers can read it; here it only has to come back unchanged. A value this server did not make is a 400.
"""

from __future__ import annotations

import base64
import binascii
import json

from ..errors import InvalidRequestError

VERSION = "fastqwen-reasoning-1"
INCLUDE_NAME = "reasoning.encrypted_content"  # the include value that asks for it


def encrypted_content(reasoning: str) -> str:
    payload = json.dumps({"v": VERSION, "text": reasoning}, ensure_ascii=False, separators=(",", ":"))
    return base64.b64encode(payload.encode("utf-8")).decode("ascii")


def reasoning_of(value: object, where: str) -> str:
    """The reasoning text an encrypted_content carries; a 400 naming `where` when this server did not make it."""
    try:
        data = json.loads(base64.b64decode(value, validate=True))
    except (TypeError, binascii.Error, ValueError):  # not a string, not base64, not JSON, not UTF-8
        data = None
    if not isinstance(data, dict) or data.get("v") != VERSION or not isinstance(data.get("text"), str):
        raise InvalidRequestError(f"{where}: not an encrypted_content this server made", "input")
    return data["text"]
