"""YaRN rope scaling (rope_type "yarn", Qwen3's documented way to 131,072 tokens): the cos/sin cache against YaRN
recomputed in float64 here and against transformers bit for bit, greedy generation against Hugging Face past the
original context, config.json's spellings and the --rope-scaling / --max-model-len overrides, and the refusals."""

from __future__ import annotations

import json
import math
import os
import random
import shutil

import pytest
import torch
from checkpoints import engine_logits, hf_greedy, hf_logits, make_checkpoint
from fastqwen import LLM, SamplingParams
from fastqwen.config import ConfigError, ModelConfig, YarnScaling, context_length, load_model_config
from fastqwen.ops import rope_cos_sin_cache

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
QWEN_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}  # Qwen's documented one


def yarn_cos_sin_float64(head_dim: int, positions: int, theta: float, yarn: YarnScaling | None) -> torch.Tensor:
    """[positions, head_dim] float64: cos | sin of YaRN's angles times its attention factor, from the method's
    definition (Peng et al. 2023, ramped over rotary pairs as its reference code and transformers do)."""
    pairs = head_dim // 2
    freq = [theta ** (-2 * i / head_dim) for i in range(pairs)]  # radians per position of rotary pair i
    gain = 1.0
    if yarn is not None:
        # Pair i turns original * freq[i] / (2 pi) times over the pretraining context; the ramp runs between the
        # (fractional) pairs that turn beta_fast times (kept, and every faster pair) and beta_slow times (slower
        # pairs are divided by the factor). transformers clamps the upper end at head_dim - 1.
        def pair_turning(times: float) -> float:
            return math.log(yarn.original_max_position_embeddings / (2 * math.pi * times), theta) * head_dim / 2

        fast, slow = pair_turning(yarn.beta_fast), pair_turning(yarn.beta_slow)
        if yarn.truncate:
            fast, slow = math.floor(fast), math.ceil(slow)
        fast, slow = max(fast, 0), min(slow, head_dim - 1)
        weights = [min(max((i - fast) / (slow - fast), 0.0), 1.0) for i in range(pairs)]  # 1: fully interpolated
        freq = [f * (1 - w) + f / yarn.factor * w for f, w in zip(freq, weights)]
        if yarn.attention_factor is not None:
            gain = yarn.attention_factor
        elif yarn.mscale and yarn.mscale_all_dim:
            gain = (1 + 0.1 * yarn.mscale * math.log(yarn.factor)) / (
                1 + 0.1 * yarn.mscale_all_dim * math.log(yarn.factor)
            )
        elif yarn.factor > 1:
            gain = 1 + 0.1 * math.log(yarn.factor)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * torch.tensor(freq, dtype=torch.float64)[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1) * gain


CACHE_CASES = {
    "tiny": (16, 1e6, 256, YarnScaling(4.0, 64)),
    "qwen3": (128, 1e6, 4096, YarnScaling(4.0, 32768)),
    "untruncated": (64, 1e4, 2048, YarnScaling(8.0, 512, beta_fast=16.0, beta_slow=2.0, truncate=False)),
    "mscales": (64, 5e5, 1024, YarnScaling(3.0, 1000, mscale=0.7, mscale_all_dim=1.1)),
    "attention_factor": (64, 5e5, 1024, YarnScaling(3.0, 1000, attention_factor=1.3)),
    "unscaled": (128, 1e6, 4096, None),
}


@pytest.mark.parametrize("case", list(CACHE_CASES))
def test_cos_sin_cache_matches_yarn_in_float64(case):
    head_dim, theta, positions, yarn = CACHE_CASES[case]
    cache = rope_cos_sin_cache(head_dim, positions, theta, torch.device("cpu"), yarn)
    truth = yarn_cos_sin_float64(head_dim, positions, theta, yarn)
    assert cache.dtype == torch.float32 and cache.shape == (positions, head_dim)
    # float32 angles drift by about an ulp of the position per step: the bound grows with the position.
    bound = 1e-6 + 3e-7 * torch.arange(positions, dtype=torch.float64)[:, None]
    error = (cache.double() - truth).abs()
    assert (error <= bound).all(), f"worst error {error.max().item():.2e} at row {error.max(1).values.argmax().item()}"


@pytest.mark.parametrize(
    "config",
    [
        {"rope_parameters": {**YARN, "rope_theta": 1e6}, "max_position_embeddings": 256},  # transformers 5
        {"rope_scaling": {**YARN, "type": "yarn"}, "rope_theta": 1e6, "max_position_embeddings": 256},
        {"rope_scaling": {"type": "yarn", "factor": 4}, "rope_theta": 1e4, "max_position_embeddings": 64},  # old key
        {"rope_scaling": {**QWEN_YARN, "beta_fast": 16, "truncate": False}, "rope_theta": 1e6},
        {"rope_parameters": {**QWEN_YARN, "rope_theta": 1e6, "mscale": 0.7, "mscale_all_dim": 1.1}},
    ],
    ids=["rope_parameters", "rope_scaling", "type-key", "untruncated", "mscales"],
)
def test_cos_sin_cache_equals_transformers_bit_for_bit(config):
    """config.json read by fastqwen and by transformers: the same theta, inverse frequencies and attention factor,
    and the cache rows equal to Qwen3RotaryEmbedding's cos and sin in float32."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    config = {
        "vocab_size": 32,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "head_dim": 16,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "max_position_embeddings": 40960,
        **config,
    }
    ours = ModelConfig.from_dict(json.loads(json.dumps(config)))  # copies: transformers edits the dicts it is given
    assert ours.rope_scaling is not None
    rotary = Qwen3RotaryEmbedding(Qwen3Config(**json.loads(json.dumps(config))))
    positions = 600
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(positions)[None, :])
    cache = rope_cos_sin_cache(16, positions, ours.rope_theta, torch.device("cpu"), ours.rope_scaling)
    assert torch.equal(cache[:, :8], cos[0, :, :8]) and torch.equal(cache[:, 8:], sin[0, :, :8])


@pytest.fixture(scope="module")
def yarn_checkpoint(tmp_path_factory):
    """A tiny Qwen3 with YaRN 4 x 64 (context 256), its HF model, and a prompt well past the original 64."""
    folder = str(tmp_path_factory.mktemp("yarn"))
    model = make_checkpoint(folder, tied=False, seed=12, max_positions=256, logit_scale=4.0, rope_scaling=YARN)
    rng = random.Random(3)
    prompt = [rng.randrange(0, 380) for _ in range(170)]
    return folder, model, prompt


NEW_TOKENS = 24


def _greedy(llm: LLM, prompt: list[int]) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].token_ids


def test_greedy_matches_hf_past_the_original_context(yarn_checkpoint):
    folder, hf_model, prompt = yarn_checkpoint
    assert hf_model.config.rope_parameters["rope_type"] == "yarn"
    expected = hf_greedy(hf_model, prompt, NEW_TOKENS)
    llm = LLM(folder, dtype="float32", device="cpu", page_size=8, num_pages=64, max_num_batched_tokens=64)
    assert llm.frontend.info.max_model_len == 256  # 4 x 64
    tokens, logits = engine_logits(llm, prompt, NEW_TOKENS)
    assert len(expected) == NEW_TOKENS and tokens == expected
    reference = hf_logits(hf_model, prompt, tokens)
    err = (logits - reference).abs().max().item()
    assert err < 1e-4 * reference.abs().max().item(), f"max |logit difference| {err}"


def test_the_old_key_and_the_override_give_the_same_model(yarn_checkpoint, tmp_path):
    """config.json's rope_scaling with "type" (transformers 4), and an unscaled checkpoint with --rope-scaling, run
    the same YaRN as the checkpoint's rope_parameters."""
    folder, hf_model, prompt = yarn_checkpoint
    expected = hf_greedy(hf_model, prompt, NEW_TOKENS)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    variants = {}
    for name, rope in (("old", {"rope_scaling": {**YARN, "type": "yarn"}}), ("unscaled", {})):
        variants[name] = str(tmp_path / name)
        shutil.copytree(folder, variants[name])
        edited = {k: v for k, v in config.items() if k != "rope_parameters"}
        edited.update(rope_theta=1e6, max_position_embeddings=64 if name == "unscaled" else 256, **rope)
        with open(os.path.join(variants[name], "config.json"), "w") as f:
            json.dump(edited, f)
    assert load_model_config(variants["old"])[0] == load_model_config(folder)[0]
    assert load_model_config(variants["unscaled"])[0].context_length == 64
    knobs = dict(dtype="float32", device="cpu", page_size=8, num_pages=64)
    assert (
        _greedy(LLM(variants["unscaled"], rope_scaling=json.dumps(YARN), max_model_len=256, **knobs), prompt)
        == expected
    )
    assert _greedy(LLM(variants["old"], **knobs), prompt) == expected


def test_context_length_follows_yarn():
    qwen3_8b = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288}
    qwen3_8b.update(num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    qwen3_8b.update(max_position_embeddings=40960, rope_theta=1e6)
    assert ModelConfig.from_dict(qwen3_8b).context_length == 40960
    assert ModelConfig.from_dict({**qwen3_8b, "rope_scaling": QWEN_YARN}).context_length == 131072
    preset, _ = load_model_config("Qwen3-8B", QWEN_YARN)  # --rope-scaling on a shape preset, for benchmarks
    assert preset.context_length == 131072 and context_length(preset, None) == 131072
    assert context_length(preset, 100_000) == 100_000
    plain, _ = load_model_config("Qwen3-8B", {"rope_type": "default"})
    assert plain.rope_scaling is None and plain.context_length == 40960


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "longrope", "llama3", "su"])
def test_other_rope_types_are_refused_by_name(rope_type, tmp_path):
    rope = {"rope_type": rope_type, "factor": 2.0}
    with pytest.raises(ValueError, match=f"rope_type '{rope_type}' is not supported"):
        ModelConfig.from_dict(
            {
                "vocab_size": 8,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 1,
                "rope_scaling": rope,
            }
        )
    with pytest.raises(ConfigError, match=f"rope_type '{rope_type}' is not supported") as e:
        load_model_config("Qwen3-0.6B", rope)
    assert e.value.field == "rope_scaling"


@pytest.fixture
def no_listening(monkeypatch):
    """serve.main past its checks fails to bind (exit status 1) instead of starting a server."""
    from fastqwen import serve

    def refuse(host, port):
        raise OSError("not in this test")

    monkeypatch.setattr(serve, "_bind", refuse)


@pytest.mark.parametrize(
    "value, message",
    [
        ('{"rope_type": "yarn", "factor": 4', "not valid JSON"),
        ("[4]", "must be a JSON object"),
        ('{"rope_type": "yarn"}', "factor must be a number >= 1, not None"),
        ('{"rope_type": "yarn", "factor": 0.5}', "factor must be a number >= 1, not 0.5"),
        (
            '{"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": -1}',
            "original_max_position_embeddings",
        ),
        ('{"rope_type": "yarn", "factor": 4, "scale": 2}', "unknown keys ['scale']"),
        ('{"rope_type": "yarn", "factor": 4, "attention_factor": 0}', "attention_factor must be a positive number"),
        ('{"rope_type": "yarn", "factor": 4, "partial_rotary_factor": 0.5}', "partial_rotary_factor must be 1"),
        ('{"rope_type": "ntk", "factor": 4}', "rope_type 'ntk' is not supported"),
    ],
)
def test_bad_overrides_stop_the_server_before_it_starts(value, message, capsys, no_listening):
    from fastqwen.serve import main

    assert main(["--model", "Qwen3-0.6B", "--load-format", "dummy", "--device", "cpu", "--rope-scaling", value]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("python -m fastqwen.serve: error: --rope-scaling: ") and message in last, last


def test_a_context_longer_than_the_model_is_refused(capsys, no_listening):
    from fastqwen.serve import main

    dummy = ["--model", "Qwen3-0.6B", "--load-format", "dummy", "--device", "cpu"]
    assert main([*dummy, "--max-model-len", "40961"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert "error: --max-model-len: 40961 is longer than the model's context of 40960 tokens" in last, last
    assert "pass --rope-scaling" in last
    assert main([*dummy, "--rope-scaling", json.dumps(QWEN_YARN), "--max-model-len", "131073"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert "131073 is longer than the model's context of 131072 tokens (with YaRN factor 4" in last, last
