"""The engine in bfloat16 on a GPU against Hugging Face transformers (bf16, and float32 as the truth)."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from checkpoints import (
    TWO_BF16_ENGINES,
    engine_logits,
    float32_spread,
    hf_greedy,
    hf_logits,
    make_checkpoint,
    record_result,
    teacher_forced_match,
)
from fastqwen import LLM, SamplingParams
from fastqwen.ops import _native

# Tolerances (issue 43), each measured in the test's own run: the spread is how far a bf16 reference's logits lie from
# float32's on the same contexts, teacher-forced, as a fraction of the largest |logit|; a bf16 engine is held within
# TWO_BF16_ENGINES times it of a bf16 reference (tests/checkpoints.py). Before, a fixed 2.5% of the largest |logit|
# (2% until the norm-in-GEMV change measured 2.1%). Measured on the H100 for this model (the parity test's prompts):
# HF bf16's spread 1.46 to 1.85% per prompt (0.60 to 0.71 of logits up to 43), ours against HF bf16 2.1%; the CPU's
# spread on the same prompts is 1.36 to 1.94%: for HF bf16 at least, the CPU's largest spread is the H100's within 5%.
# Minimum decisive steps: about half of what the CPU estimate of the spread leaves, so the GPU's own spread may differ
# without emptying the check. Measured on the CPU (same checkpoint and prompts, the reference against float32):
# - greedy test: spread 1.91%, 32 of 96 steps decisive; MIN_DECISIVE_GREEDY is reached at a spread of 2.99% (1.6x);
# - kernels against the reference ops: 1.86%, 42 of 96; MIN_DECISIVE_KERNELS reached at 3.52% (1.9x);
# - Hopper prefill (the reference-op engine standing in for the tensor-core one): 1.99%, 38 of 96; 3.42% (1.7x).
# A third of the steps is out of reach with room to spare: at a 2% spread a step is decisive only where its top-2
# margin exceeds 8% of the largest |logit|, and this model's median margin is 5.5%. The GPU counts go to
# engine_gpu.json (record_result); no GPU run has kept them yet.
MIN_DECISIVE_GREEDY = 16
MIN_DECISIVE_KERNELS = 20

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """Real Qwen3 head geometry (head_dim 128, 4 query heads per KV head); output layer scaled for large margins."""
    folder = str(tmp_path_factory.mktemp("bf16"))
    make_checkpoint(
        folder,
        tied=False,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        hidden=256,
        intermediate=512,
        layers=4,
        dtype=torch.bfloat16,
        logit_scale=8.0,
        seed=5,
    )
    from transformers import Qwen3ForCausalLM

    hf_bf16 = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    hf_fp32 = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    return folder, hf_bf16, hf_fp32


def test_bf16_logits_within_tolerance_of_hf(bf16_checkpoint):
    folder, hf_bf16, hf_fp32 = bf16_checkpoint
    llm = LLM(folder, dtype="bfloat16", device="cuda", page_size=16, num_pages=256, max_num_batched_tokens=64)
    rng = random.Random(0)
    rows = []
    for length in (7, 100, 300):
        prompt = [rng.randrange(0, 380) for _ in range(length)]
        tokens, ours = engine_logits(llm, prompt, 16)
        ref_bf16 = hf_logits(hf_bf16, prompt, tokens)
        truth = hf_logits(hf_fp32, prompt, tokens)
        scale = truth.abs().max().item()
        rows.append(
            {
                "prompt_tokens": length,
                "max_abs_logit": scale,
                "ours_vs_hf_bf16": (ours - ref_bf16).abs().max().item(),
                "ours_vs_fp32": (ours - truth).abs().max().item(),
                "hf_bf16_vs_fp32": (ref_bf16 - truth).abs().max().item(),
            }
        )
    # The spread: HF bf16's own distance to the float32 truth over these prompts (teacher-forced on our tokens).
    spread = max(row["hf_bf16_vs_fp32"] / row["max_abs_logit"] for row in rows)
    tolerance = TWO_BF16_ENGINES * spread
    results = {"device": torch.cuda.get_device_name(), "rows": rows, "spread": spread, "tolerance": tolerance}
    print(json.dumps(results, indent=1))
    if os.environ.get("FASTQWEN_RESULTS_DIR"):
        with open(os.path.join(os.environ["FASTQWEN_RESULTS_DIR"], "engine_bf16_parity.json"), "w") as f:
            json.dump(results, f, indent=1)
    for row in rows:
        # Our bf16 error against the float32 truth is at most twice HF's own on the same prompt (plus a bf16 ulp of
        # the largest logit), and we stay within the tolerance of HF's bf16 logits: two bf16 computations.
        ulp = row["max_abs_logit"] * 2**-8
        assert row["ours_vs_fp32"] <= 2 * row["hf_bf16_vs_fp32"] + ulp, row
        assert row["ours_vs_hf_bf16"] <= tolerance * row["max_abs_logit"], row


def test_bf16_greedy_tokens_match_hf(bf16_checkpoint):
    """Greedy tokens equal HF's wherever HF's top-1 margin exceeds twice the logit tolerance.

    The tolerance is TWO_BF16_ENGINES times the spread measured here: HF bf16's distance to HF float32 on the same
    sequences. With every logit within DELTA of HF's, the argmax can only differ at a step whose top-1 margin is under
    2 * DELTA. So: (1) teacher-forced on HF's greedy sequence, every decisive step gives HF's token (all prefixes in
    one batch); (2) free-running generation is identical to HF's up to the first near-tie; at least
    MIN_DECISIVE_GREEDY decisive steps.
    """
    folder, hf_bf16, hf_fp32 = bf16_checkpoint
    llm = LLM(folder, dtype="bfloat16", device="cuda", page_size=16, num_pages=512)
    rng = random.Random(1)
    cases, spread = [], 0.0
    for n in (5, 33, 128):
        prompt = [rng.randrange(0, 380) for _ in range(n)]
        expected = hf_greedy(hf_bf16, prompt, 32)
        reference = hf_logits(hf_bf16, prompt, expected)
        truth = hf_logits(hf_fp32, prompt, expected)
        spread = max(spread, (reference - truth).abs().max().item() / reference.abs().max().item())
        cases.append((prompt, expected, reference))
    tolerance = TWO_BF16_ENGINES * spread
    decisive_steps = identical_prefix = 0
    for prompt, expected, reference in cases:
        top2 = reference.topk(2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        threshold = 2 * tolerance * reference.abs().max().item()
        prefixes = [prompt + expected[:k] for k in range(len(expected))]
        one_step = llm.generate(prefixes, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        for k, out in enumerate(one_step):
            if margins[k] > threshold:
                decisive_steps += 1
                assert out.token_ids[0] == expected[k], f"step {k}: margin {margins[k]:.2f} > {threshold:.2f}"
        free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0]
        first_tie = next((k for k, m in enumerate(margins) if m <= threshold), len(margins))
        assert free.token_ids[:first_tie] == expected[:first_tie]
        identical_prefix += first_tie
    record_result(
        "engine_gpu.json",
        "greedy_vs_hf",
        {"spread": spread, "tolerance": tolerance, "decisive": decisive_steps, "identical_prefix": identical_prefix},
    )
    assert decisive_steps >= MIN_DECISIVE_GREEDY, (
        f"only {decisive_steps} of 96 steps were decisive: the test checks too little"
    )
    print(f"decisive steps {decisive_steps}/96, identical free-running prefix {identical_prefix} tokens")
    llm.engine.kv.allocator.check()


def test_kernel_engine_matches_reference_op_engine(bf16_checkpoint, monkeypatch):
    """The engine on its CUDA kernels (tensor-core prefill/extend and decode attention, norms, RoPE/KV, sampler, CUDA
    graphs) against the same engine on the PyTorch reference ops. The tolerance: TWO_BF16_ENGINES times the reference
    engine's spread, its distance to the same engine in float32, measured here. (1) Teacher-forced on the reference's
    greedy sequence (every prefix in one batch: a varlen prefill whose prefixes also hit the radix cache, so most rows
    extend a cached prefix that ends mid-page), logits within the tolerance at every step, and every step whose
    reference top-1 margin exceeds twice the tolerance gives the reference's token (at least MIN_DECISIVE_KERNELS).
    (2) Free-running, logits stay within the tolerance while the tokens agree."""
    if not _native.has_cuda_kernels():
        pytest.skip("needs the CUDA kernels")
    folder, _, _ = bf16_checkpoint
    rng = random.Random(7)
    prompts = [[rng.randrange(0, 380) for _ in range(n)] for n in (6, 150, 400)]  # the checkpoint holds 512
    kwargs = dict(dtype="bfloat16", device="cuda", page_size=16, num_pages=1024, max_num_batched_tokens=256)
    monkeypatch.setattr(_native, "_has_cuda", False)  # every op takes its reference path
    reference_llm = LLM(folder, disable_cuda_graph=True, allow_reference_on_gpu=True, **kwargs)
    references = [engine_logits(reference_llm, p, 32) for p in prompts]
    del reference_llm
    monkeypatch.undo()
    spread = float32_spread(folder, prompts, references, **kwargs)
    tolerance = TWO_BF16_ENGINES * spread
    kernel_llm = LLM(folder, **kwargs)
    assert kernel_llm.engine.runner.graphs is not None
    decisive, worst = teacher_forced_match(
        kernel_llm, prompts, references, tolerance, min_decisive=MIN_DECISIVE_KERNELS, bound_forced=True
    )
    record_result(
        "engine_gpu.json",
        "kernels_vs_reference_ops",
        {"spread": spread, "tolerance": tolerance, "worst": worst, "decisive": decisive},
    )
    kernel_llm.engine.kv.allocator.check()


def test_hopper_prefill_engine_matches_the_tensor_core_prefill_engine(bf16_checkpoint):
    """Issue 48: the engine with csrc/attention_prefill_hopper.cu against the same engine on csrc/attention_prefill.cu
    (ops.attention.set_hopper_prefill(False)), teacher-forced on the latter's greedy sequences: every prefix in one
    varlen batch (prefills, and extends over cached prefixes that end mid-page), then decode. Tolerance as in
    test_kernel_engine_matches_reference_op_engine: TWO_BF16_ENGINES times the reference's measured float32 spread."""
    from fastqwen.ops.attention import prefill_uses_hopper_kernel, set_hopper_prefill

    probe = torch.empty(1, 1, 128, dtype=torch.bfloat16, device="cuda")
    if not (
        _native.has_cuda_kernels()
        and prefill_uses_hopper_kernel(probe, torch.empty(1, 16, 1, 128, dtype=torch.bfloat16, device="cuda"))
    ):
        pytest.skip("needs the Hopper prefill kernel")
    folder, _, _ = bf16_checkpoint
    rng = random.Random(11)
    prompts = [[rng.randrange(0, 380) for _ in range(n)] for n in (9, 170, 420)]  # the checkpoint holds 512
    kwargs = dict(dtype="bfloat16", device="cuda", page_size=16, num_pages=1024, max_num_batched_tokens=256)
    previous = set_hopper_prefill(False)
    try:
        old_llm = LLM(folder, **kwargs)
        references = [engine_logits(old_llm, p, 32) for p in prompts]
        del old_llm
    finally:
        set_hopper_prefill(previous)
    tolerance = TWO_BF16_ENGINES * float32_spread(folder, prompts, references, **kwargs)
    new_llm = LLM(folder, **kwargs)
    decisive, worst = teacher_forced_match(
        new_llm, prompts, references, tolerance, min_decisive=MIN_DECISIVE_KERNELS, bound_forced=True
    )
    record_result(
        "engine_gpu.json",
        "hopper_prefill_vs_tensor_core_prefill",
        {"tolerance": tolerance, "worst": worst, "decisive": decisive},
    )


def test_dummy_preset_runs_on_gpu():
    llm = LLM("Qwen3-0.6B", load_format="dummy", device="cuda", num_pages=64, max_model_len=1024)
    out = llm.generate(
        [[1, 2, 3, 4]] * 3, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    assert [len(o.token_ids) for o in out] == [8, 8, 8]
    assert out[0].token_ids == out[1].token_ids == out[2].token_ids


def test_sampling_features_on_gpu(bf16_checkpoint):
    """Seeded top-k/top-p/min-p sampling with penalties, stops and logprobs, on GPU tensors."""
    folder, _, _ = bf16_checkpoint
    rng = random.Random(3)
    prompt = [rng.randrange(0, 380) for _ in range(20)]
    others = [[rng.randrange(0, 380) for _ in range(rng.randint(3, 40))] for _ in range(4)]
    seeded = SamplingParams(
        temperature=0.9,
        top_k=50,
        top_p=0.9,
        min_p=0.02,
        repetition_penalty=1.1,
        presence_penalty=0.3,
        seed=77,
        max_tokens=16,
        ignore_eos=True,
        logprobs=3,
    )
    alone = LLM(folder, dtype="bfloat16", device="cuda", num_pages=256).generate([prompt], seeded, use_tqdm=False)[0]
    crowd = LLM(folder, dtype="bfloat16", device="cuda", num_pages=256, seed=5).generate(
        others[:2] + [prompt] + others[2:],
        [SamplingParams(temperature=1.0, max_tokens=16)] * 2
        + [seeded]
        + [SamplingParams(temperature=0.0, max_tokens=16)] * 2,
        use_tqdm=False,
    )[2]
    assert crowd.token_ids == alone.token_ids
    assert len(alone.logprobs) == 16
    for entry in alone.logprobs:
        assert entry.logprob <= 0 and len(entry.top) == 3
        assert entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]
