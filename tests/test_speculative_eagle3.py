"""The eagle3 method on the CPU reference path: a tiny random EAGLE-3 head written in the published layout (config.json
+ safetensors, as SpecForge and AngelSlim export Qwen3 heads). Greedy outputs equal decoding without speculation
(random drafts are wrong, and wrong drafts never change the output); every draft equals a float64 reference of the
published architecture recomputed from scratch over Hugging Face's hidden states (so the capture layers, the feature
fed back, the positions, d2t and the head's KV rollback are all checked); loading errors name what is wrong."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from checkpoints import VOCAB, make_checkpoint
from cpu_graphs import graph_llm
from fastqwen import LLM, SamplingParams
from fastqwen.config import ConfigError, EngineConfig
from fastqwen.speculative.config import SpeculativeConfig, SpeculativeConfigError

K = 3
LAYERS = 4
HEAD = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "intermediate": 80, "draft_vocab": 200}
ROPE_THETA = 10000.0


def write_head(folder: str, *, seed: int = 0, target_hidden: int = 64, layer_ids=None, **overrides) -> dict:
    """A random EAGLE-3 head in the published layout; returns its float64 tensors."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    h, inter, dv = HEAD["hidden"], HEAD["intermediate"], HEAD["draft_vocab"]
    q, kv = HEAD["heads"] * HEAD["head_dim"], HEAD["kv_heads"] * HEAD["head_dim"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.15):
        return torch.randn(*shape, generator=gen) * std

    def norm(n):
        return 1.0 + 0.2 * torch.randn(n, generator=gen)

    # The draft vocabulary: a sorted subset of the target's, as the published heads map their frequent tokens.
    subset = torch.sort(torch.randperm(VOCAB, generator=gen)[:dv]).values
    tensors = {
        "fc.weight": rand(h, 3 * target_hidden),
        "midlayer.input_layernorm.weight": norm(h),
        "midlayer.hidden_norm.weight": norm(h),
        "midlayer.self_attn.q_proj.weight": rand(q, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, q),
        "midlayer.post_attention_layernorm.weight": norm(h),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "norm.weight": norm(h),
        "lm_head.weight": rand(dv, h, std=1.0),  # sharp: the reference's argmax is decisive
        "d2t": subset - torch.arange(dv),
        "t2d": torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, subset, True),
    }
    tensors.update(overrides.pop("tensors", {}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": HEAD["heads"],
        "num_key_value_heads": HEAD["kv_heads"],
        "head_dim": HEAD["head_dim"],
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": ROPE_THETA,
        "vocab_size": VOCAB,
        "draft_vocab_size": dv,
        "max_position_embeddings": 2048,
        **overrides,
    }
    if layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return {k: v.double() if v.is_floating_point() else v for k, v in tensors.items()}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    target = str(root / "target")
    model = make_checkpoint(target, tied=False, seed=5, logit_scale=4.0, layers=LAYERS, max_positions=1024)
    head = str(root / "head")
    return target, model, head, write_head(head, seed=1)


def make_llm(path: str, spec: dict | None = None, **knobs) -> LLM:
    knobs = {"dtype": "float32", "device": "cpu", "page_size": 4, "num_pages": 256, **knobs}
    return LLM(path, speculative_config=spec, **knobs)


def prompts(n: int, length: int = 20, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(length)] for _ in range(n)]


def outputs(llm: LLM, prompt_list, params) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompt_list, params, use_tqdm=False)]


# ---- the published architecture in float64, written here from the papers' and peers' description ------------------


def rms(x, w, eps=1e-6):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x, positions):  # x [T, heads, D], Llama's rotate-half RoPE
    d = x.shape[-1]
    inv = 1.0 / ROPE_THETA ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def reference_drafts(model, w: dict, tokens: list[int], k: int) -> list[int]:
    """The head's k drafts after `tokens`, from scratch: the target's residual stream entering layers 2, L // 2 and
    L - 3 (Hugging Face's hidden_states[i]) at every position but the last, each with the next token's embedding;
    then k - 1 steps that feed the head's output before its final norm back at the next position."""
    with torch.no_grad():
        states = model(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
    aux = torch.cat([states[i][0].double() for i in (2, LAYERS // 2, LAYERS - 3)], -1)
    embed = model.model.embed_tokens.weight.double()
    nh, nkv, hd = HEAD["heads"], HEAD["kv_heads"], HEAD["head_dim"]
    keys, values = [], []

    def layer(token_ids, feature, positions):
        x = torch.cat(
            [
                rms(embed[token_ids], w["midlayer.input_layernorm.weight"]),
                rms(feature, w["midlayer.hidden_norm.weight"]),
            ],
            -1,
        )
        q = rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(-1, nh, hd), positions)
        keys.append(rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(-1, nkv, hd), positions))
        values.append((x @ w["midlayer.self_attn.v_proj.weight"].T).view(-1, nkv, hd))
        kk = torch.cat(keys).repeat_interleave(nh // nkv, 1)
        vv = torch.cat(values).repeat_interleave(nh // nkv, 1)
        n = kk.shape[0]
        scores = torch.einsum("thd,nhd->htn", q, kk) / hd**0.5
        causal = torch.arange(n)[None, :] <= (n - len(positions) + torch.arange(len(positions)))[:, None]
        attn = torch.einsum("htn,nhd->thd", scores.masked_fill(~causal, float("-inf")).softmax(-1), vv)
        residual = feature + attn.reshape(len(positions), -1) @ w["midlayer.self_attn.o_proj.weight"].T
        y = rms(residual, w["midlayer.post_attention_layernorm.weight"])
        mlp = torch.nn.functional.silu(y @ w["midlayer.mlp.gate_proj.weight"].T) * (
            y @ w["midlayer.mlp.up_proj.weight"].T
        )
        out = residual + mlp @ w["midlayer.mlp.down_proj.weight"].T
        draft = int((rms(out[-1], w["norm.weight"]) @ w["lm_head.weight"].T).argmax())
        return draft + int(w["d2t"][draft]), out[-1:]

    n = len(tokens) - 1
    draft, feature = layer(torch.tensor(tokens[1:]), aux @ w["fc.weight"].T, torch.arange(n))
    drafts = [draft]
    for i in range(1, k):
        draft, feature = layer(torch.tensor([drafts[-1]]), feature, torch.tensor([n + i - 1]))
        drafts.append(draft)
    return drafts


# ---- tests ------------------------------------------------------------------------------------------------------


def test_greedy_output_is_unchanged_and_the_kv_invariant_holds(setup):
    target, _, head, _ = setup
    batch = prompts(6, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = outputs(make_llm(target), batch, params)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": K}
    # 6 requests of 44 tokens in 4-token pages need 66 pages: 40 force preemptions (the head's KV is recomputed).
    llm = make_llm(target, spec, num_pages=40)
    assert outputs(llm, batch, params) == reference
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens >= stats.spec_num_drafts
    assert stats.num_preemptions > 0
    llm.engine.check_invariants()
    assert not llm.engine.speculator.drafter._states  # finished requests leave nothing behind


def recorded_proposals(drafter) -> list:
    """(tokens, draft, limit) of every proposal the drafter makes from now on."""
    proposals = []
    propose = drafter.propose

    def recording(rid, tokens, num_prompt_tokens, limit):
        draft, score = propose(rid, tokens, num_prompt_tokens, limit)
        proposals.append((list(tokens), draft, limit))
        return draft, score

    drafter.propose = recording
    return proposals


@pytest.mark.parametrize("synthetic", [None, 2.5])
def test_every_draft_equals_the_float64_reference(setup, synthetic):
    """Each proposal the drafter makes, recomputed from scratch: the head's KV after verify steps (drafts rejected,
    or accepted several at a time in the benchmark mode) and preemptions must equal one built over the committed
    tokens only."""
    target, model, head, w = setup
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": K, "synthetic_acceptance_length": synthetic}
    # 2 requests of 36 tokens in 4-token pages need 18 pages and more for drafts: 14 force preemptions, after which
    # the head's KV is recomputed from position 0.
    llm = make_llm(target, spec, enable_prefix_caching=False, num_pages=14)
    proposals = recorded_proposals(llm.engine.speculator.drafter)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs(llm, prompts(2, seed=8), params)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and (stats.spec_num_accepted_tokens > 0 or synthetic is None)
    checked = 0
    for tokens, draft, limit in proposals[:: max(1, len(proposals) // 8)]:
        assert draft == reference_drafts(model, w, tokens, min(K, limit)), len(tokens)
        checked += 1
    assert checked >= 6
    llm.engine.check_invariants()


def test_verify_graphs_stay_on_with_eagle3(setup, monkeypatch):
    """The decode and verify steps replay graphs (tests/cpu_graphs.py's stand-ins), which write the target's hidden
    states at the head's layers into their buffer: greedy output equals speculation off, and the drafts made from
    the replayed steps' hidden states equal the float64 reference (so the rows the runner copies out are the real
    sequences', not padding)."""
    target, model, head, w = setup
    batch = prompts(5, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reference = outputs(make_llm(target), batch, params)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": K}
    llm = graph_llm(monkeypatch, target, speculative_config=spec, page_size=4, num_pages=256)
    verify_graphs = llm.engine.runner.verify_graphs
    assert verify_graphs is not None and verify_graphs.aux is not None
    proposals = recorded_proposals(llm.engine.speculator.drafter)
    assert outputs(llm, batch, params) == reference
    assert len(verify_graphs.forwards) >= 5 and llm.engine.stats().spec_num_drafts > 0
    later = proposals[len(proposals) // 2 :]  # made after verify steps that replayed graphs
    for tokens, draft, limit in later[:: max(1, len(later) // 6)]:
        assert draft == reference_drafts(model, w, tokens, min(K, limit)), len(tokens)
    llm.engine.check_invariants()


def test_aux_layer_ids_name_layer_outputs(tmp_path, setup):
    """eagle_aux_hidden_state_layer_ids [0, 1, 3]: the residual stream after layers 0, 1 and 3 (the last one: before
    the final norm), i.e. entering layers 1, 2 and 4."""
    target, _, _, _ = setup
    head = str(tmp_path / "head")
    write_head(head, seed=2, layer_ids=[0, 1, LAYERS - 1])
    llm = make_llm(target, {"method": "eagle3", "model": head, "num_speculative_tokens": 2})
    assert llm.engine.model.aux_layers == (1, 2, LAYERS)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert outputs(llm, prompts(2, seed=4), params) == outputs(make_llm(target), prompts(2, seed=4), params)


def test_bad_head_folders_are_refused_naming_the_problem(tmp_path, setup):
    target, _, head, _ = setup

    def refused(spec: dict, words: str, load: bool = False):
        spec = {"method": "eagle3", "num_speculative_tokens": 2, **spec}
        with pytest.raises(ConfigError) as error:
            if load:
                make_llm(target, spec)
            else:
                EngineConfig(model=target, speculative_config=spec)
        assert error.value.field == "speculative_config"
        assert words in str(error.value), str(error.value)

    refused({}, "must name the EAGLE-3 draft head's folder")
    refused({"model": str(tmp_path / "nowhere")}, "is not a folder")
    os.makedirs(tmp_path / "empty")
    refused({"model": str(tmp_path / "empty")}, "has no config.json")
    wrong = str(tmp_path / "wrong")
    write_head(wrong, architectures=["LlamaForCausalLM"])
    refused({"model": wrong}, "is not an EAGLE-3 head")
    other = str(tmp_path / "other_target")  # a head trained for a target with hidden size 96
    write_head(other, target_hidden=96)
    refused({"model": other}, "target's hidden size 64", load=True)
    incomplete = str(tmp_path / "incomplete")
    write_head(incomplete, tensors={"midlayer.hidden_norm.weight": torch.ones(3)})
    refused({"model": incomplete}, "'midlayer.hidden_norm.weight' has shape (3,)", load=True)
    with pytest.raises(ConfigError, match="only eagle3 loads a draft model"):
        EngineConfig(model=target, speculative_config={"method": "ngram", "model": head})
    with pytest.raises(ConfigError, match="tensor_parallel_size 1"):
        EngineConfig(model=target, tensor_parallel_size=2, speculative_config={"method": "eagle3", "model": head})


def fp8_rounded(weight: torch.Tensor) -> torch.Tensor:
    """A weight as FP8 e4m3 with one scale per 128 x 128 block (amax / 448) holds it, back in float64: written here
    from the format's description (torch's e4m3 cast rounds)."""
    rows, cols = weight.shape
    out = torch.empty_like(weight)
    for r in range(0, rows, 128):
        for c in range(0, cols, 128):
            block = weight[r : r + 128, c : c + 128]
            amax = float(block.abs().max())
            scale = amax / 448.0 if amax > 0 else 1.0
            out[r : r + 128, c : c + 128] = (block / scale).float().to(torch.float8_e4m3fn).double() * scale
    return out


def test_an_fp8_head_drafts_what_its_fp8_weights_give(setup):
    """speculative_config.quantization "fp8": the head's projections and LM head become e4m3 with block scales (the
    stacked q/k/v and gate/up as one matrix each, as loaded), and every draft equals the float64 reference over those
    rounded weights; the rounding changes some drafts of the dense reference, so the comparison tells them apart."""
    target, model, head, w = setup
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": K, "quantization": "fp8"}
    llm = make_llm(target, spec, enable_prefix_caching=False)
    weights = llm.engine.speculator.drafter.head.weights
    linears = (weights.fc, weights.qkv, weights.o_proj, weights.gate_up, weights.down, weights.lm_head)
    assert all(lw.weight.dtype == torch.float8_e4m3fn for lw in linears)
    rounded = dict(w)
    attn, mlp = "midlayer.self_attn.", "midlayer.mlp."
    for stacked in (
        [attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"],
        [mlp + "gate_proj.weight", mlp + "up_proj.weight"],
    ):
        parts = fp8_rounded(torch.cat([w[name] for name in stacked])).split([w[n].shape[0] for n in stacked])
        rounded.update(zip(stacked, parts))
    for name in ("fc.weight", attn + "o_proj.weight", mlp + "down_proj.weight", "lm_head.weight"):
        rounded[name] = fp8_rounded(w[name])
    proposals = recorded_proposals(llm.engine.speculator.drafter)
    outputs(llm, prompts(3, seed=9), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    checked = changed = 0
    for tokens, draft, limit in proposals[:: max(1, len(proposals) // 12)]:
        k = min(K, limit)
        assert draft == reference_drafts(model, rounded, tokens, k), len(tokens)
        changed += draft != reference_drafts(model, w, tokens, k)
        checked += 1
    assert checked >= 8 and changed >= 1, (checked, changed)


def test_head_quantization_is_checked(setup):
    head = setup[2]
    for spec in (
        {"method": "eagle3", "model": head, "quantization": "int4"},
        {"method": "ngram", "quantization": "fp8"},  # (no draft model to quantize)
    ):
        with pytest.raises(SpeculativeConfigError) as caught:
            SpeculativeConfig.parse(spec)
        assert caught.value.key == "quantization", caught.value
