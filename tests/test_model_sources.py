"""Model sources: a hub id found in the Hugging Face cache (offline), a separate tokenizer folder, a chat template
given inline or as a file, and the errors for each kind of missing source."""

from __future__ import annotations

import json
import shutil

import huggingface_hub
import pytest
from checkpoints import make_checkpoint
from fastqwen import LLM, SamplingParams
from fastqwen.config import ConfigError, EngineConfig
from fastqwen.model_source import ModelSourceError, resolve

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TEMPLATE = "{% for m in messages %}<{{ m.role }}> {{ m.content }} {% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("local"))
    make_checkpoint(path, tied=True, seed=5)
    return path


@pytest.fixture
def offline_cache(tmp_path, folder, monkeypatch):
    """A Hugging Face cache holding `tiny/qwen3` at COMMIT (the layout huggingface_hub writes), with the hub
    offline: nothing may be downloaded."""
    repo = tmp_path / "hub" / "models--tiny--qwen3"
    shutil.copytree(folder, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return repo


def test_hub_id_loads_from_the_cache_offline(offline_cache, folder):
    config = resolve(EngineConfig(model="tiny/qwen3"))
    assert config.model == str(offline_cache / "snapshots" / COMMIT)
    from_hub = LLM("tiny/qwen3", device="cpu", dtype="float32", num_pages=64)
    local = LLM(folder, device="cpu", dtype="float32", num_pages=64)
    prompt = [[5, 6, 7, 8]]
    assert (
        from_hub.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids
        == local.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids
    )
    assert from_hub.tokenizer is not None  # the snapshot's tokenizer.json


def test_unknown_hub_id_offline_says_so(offline_cache):
    with pytest.raises(ModelSourceError, match="HF_HUB_OFFLINE") as e:
        resolve(EngineConfig(model="tiny/missing"))
    assert e.value.field == "model" and "hf download tiny/missing" in str(e.value)
    with pytest.raises(ModelSourceError, match="revision v9"):  # cached, but not at this revision
        resolve(EngineConfig(model="tiny/qwen3", revision="v9"))


def test_a_path_that_is_neither_folder_nor_hub_id():
    with pytest.raises(FileNotFoundError, match="not a local path") as e:
        resolve(EngineConfig(model="/no/such/folder"))
    assert e.value.field == "model"


def test_a_folder_without_weights_or_with_a_bad_config(tmp_path, folder):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve(EngineConfig(model=str(empty)))
    no_weights = tmp_path / "no_weights"
    shutil.copytree(folder, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        resolve(EngineConfig(model=str(no_weights)))
    assert resolve(EngineConfig(model=str(no_weights), load_format="dummy")).model == str(no_weights)
    (no_weights / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelSourceError, match="model_type='llama'"):
        resolve(EngineConfig(model=str(no_weights), load_format="dummy"))


def test_preset_names_and_hub_ids():
    with pytest.raises(ConfigError, match="hub id"):
        EngineConfig(model="Qwen3-8B")  # a bare preset name has no weights
    EngineConfig(model="Qwen/Qwen3-8B")  # a hub id, resolved later
    assert resolve(EngineConfig(model="Qwen/Qwen3-8B", load_format="dummy")).model == "Qwen/Qwen3-8B"  # the preset


def test_chat_template_inline_or_from_a_file(tmp_path, folder):
    messages = [{"role": "user", "content": "t3 t4"}]
    expected = "<user> t3 t4 <assistant>"
    inline = LLM(folder, device="cpu", dtype="float32", num_pages=32, chat_template=TEMPLATE)
    assert inline.tokenizer.apply_chat_template(messages) == expected
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert resolve(EngineConfig(model=folder, chat_template=str(path))).chat_template == TEMPLATE
    with pytest.raises(ModelSourceError, match="neither a file nor a jinja template") as e:
        resolve(EngineConfig(model=folder, chat_template=str(tmp_path / "missing.jinja")))
    assert e.value.field == "chat_template"
    with pytest.raises(ModelSourceError, match="does not parse"):
        resolve(EngineConfig(model=folder, chat_template="{% for m in messages %}"))


def test_tokenizer_from_another_folder(tmp_path, folder):
    weights_only = tmp_path / "weights_only"
    shutil.copytree(folder, weights_only, ignore=shutil.ignore_patterns("tokenizer*"))
    assert LLM(str(weights_only), device="cpu", num_pages=32).tokenizer is None
    llm = LLM(str(weights_only), device="cpu", num_pages=32, tokenizer=folder)
    assert llm.generate("t5 t6", GREEDY, use_tqdm=False)[0].prompt_token_ids == [5, 6]
    with pytest.raises(ModelSourceError, match="no tokenizer.json") as e:
        resolve(EngineConfig(model=folder, tokenizer=str(weights_only)))
    assert e.value.field == "tokenizer"
