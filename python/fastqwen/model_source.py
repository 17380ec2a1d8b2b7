"""Where a model's files come from: a local folder, a config.json, a shape preset (dummy weights), or a Hugging Face
hub id resolved through huggingface_hub (the local cache first; downloaded only when online and not cached;
HF_HUB_OFFLINE=1 never touches the network). Also the tokenizer folder and the chat template (file or inline).

Everything here runs before any weight is read, so a wrong name fails in a second with a message that says what
was tried, not minutes later inside the engine.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace

from .config import PRESETS, ConfigError, EngineConfig, is_preset
from .errors import InvalidRequestError

# What a checkpoint needs from the hub; nothing else is downloaded (no .bin, .pth, .gguf or ONNX copies).
_CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]
_TOKENIZER_FILES = ["*.json", "*.jinja", "*.txt", "*.model"]
# owner/name, as the hub spells repository ids
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class ModelSourceError(ConfigError):
    """A model, tokenizer or chat template that cannot be found or used; `field` names the EngineConfig knob at
    fault (the CLI reports it by its flag)."""


class MissingFileError(ModelSourceError, FileNotFoundError):
    """A path, a config.json or the weights that are not there."""


class UnknownModelError(MissingFileError, InvalidRequestError):
    """A model name that is no path, no hub id and no preset (also the offline API's InvalidRequestError)."""

    def __init__(self, message: str, field: str):
        super().__init__(message, field)
        self.param = field


def looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and not os.path.exists(name)


def resolve(config: EngineConfig) -> EngineConfig:
    """The config with `model` and `tokenizer` made local paths (downloading from the hub when needed) and the chat
    template made text, after checking that the checkpoint folder has what loading it needs. Raises
    ModelSourceError. A config resolved once comes back unchanged."""
    model = config.model
    if not (config.load_format == "dummy" and is_preset(model)):
        model = _local_folder(model, config.revision, _CHECKPOINT_FILES, "model")
        check_checkpoint(model, config.load_format)
    tokenizer = config.tokenizer
    if tokenizer is not None:
        tokenizer = _local_folder(
            tokenizer, config.revision if tokenizer == config.model else None, _TOKENIZER_FILES, "tokenizer"
        )
        if not os.path.isfile(os.path.join(tokenizer, "tokenizer.json")):
            raise ModelSourceError(f"no tokenizer.json in {tokenizer!r}", "tokenizer")
    chat_template = config.chat_template
    if chat_template is not None:
        chat_template = read_chat_template(chat_template)
    if (model, tokenizer, chat_template) == (config.model, config.tokenizer, config.chat_template):
        return config
    return replace(config, model=model, tokenizer=tokenizer, chat_template=chat_template)


def read_chat_template(value: str) -> str:
    """A jinja template given inline, or the text of the file it names; its syntax checked here, at startup."""
    if "{{" in value or "{%" in value:
        source = value
    elif os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            source = f.read()
    else:
        raise ModelSourceError(
            f"{value!r} is neither a file nor a jinja template (an inline template contains {{{{ or {{%)",
            "chat_template",
        )
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelSourceError(
            f"the chat template does not parse: {e.message} (line {e.lineno})", "chat_template"
        ) from e
    return source


def check_checkpoint(path: str, load_format: str) -> None:
    """A folder (or config.json) whose config parses as a dense Qwen3 and that holds safetensors weights (unless the
    weights are dummy ones). Raises ModelSourceError naming the file and what is wrong with it."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    config_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(config_file):
        raise MissingFileError(f"no config.json in {folder!r}: is it a Hugging Face checkpoint folder?", "model")
    from .config import ModelConfig

    try:
        with open(config_file) as f:
            ModelConfig.from_dict(json.load(f))
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
        raise ModelSourceError(f"{config_file} is not a usable Qwen3 config: {what}", "model") from e
    weights = ("model.safetensors", "model.safetensors.index.json")  # what weights.py reads
    if load_format != "dummy" and not any(os.path.isfile(os.path.join(folder, name)) for name in weights):
        raise MissingFileError(
            f"no model.safetensors or model.safetensors.index.json in {folder!r} (only safetensors weights are "
            "read; the dummy load format gives random weights of this config's shapes)",
            "model",
        )


def _local_folder(name: str, revision: str | None, patterns: list[str], field: str) -> str:
    if os.path.exists(name):
        return name
    if not looks_like_hub_id(name):
        presets = f", nor a preset ({', '.join(PRESETS)}) with the dummy load format" if field == "model" else ""
        raise UnknownModelError(
            f"unknown {field} {name!r}: not a local path, nor a Hugging Face hub id (owner/name){presets}", field
        )
    try:
        import huggingface_hub
        from huggingface_hub.utils import HfHubHTTPError
    except ImportError as e:
        raise ModelSourceError(
            f"{name!r} is no local path, and loading hub ids needs huggingface_hub (pip install huggingface_hub)", field
        ) from e
    try:  # the cache first: no network round trip when the files are there
        return huggingface_hub.snapshot_download(
            name, revision=revision, allow_patterns=patterns, local_files_only=True
        )
    except Exception:  # not cached (LocalEntryNotFoundError), or cached without this revision
        pass
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise ModelSourceError(
            f"{name!r}{f' at revision {revision}' if revision else ''} is not in the Hugging Face cache "
            f"({huggingface_hub.constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set: download it first "
            f"(hf download {name}{f' --revision {revision}' if revision else ''}) or pass a local folder",
            field,
        )
    try:
        return huggingface_hub.snapshot_download(name, revision=revision, allow_patterns=patterns)
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ModelSourceError(
            f"could not download {name!r} from the Hugging Face hub: {type(e).__name__}: {e}", field
        ) from e
