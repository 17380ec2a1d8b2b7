"""Prompt logprobs on the GPU path (bf16, CUDA kernels, CUDA graphs and the overlap schedule for the requests decoding
beside them) against Hugging Face transformers: bf16 as the like-for-like reference, float32 as the truth."""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import make_checkpoint, record_result
from fastqwen import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("plp_gpu"))
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
        seed=7,
    )
    from transformers import Qwen3ForCausalLM

    hf_bf16 = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    hf_fp32 = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    return folder, hf_bf16, hf_fp32


def reference(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt], device="cuda")).logits[0].float()
    return torch.log_softmax(logits.double(), dim=-1).cpu()


def test_prompt_logprobs_on_gpu_equal_hf(checkpoint):
    folder, hf_bf16, hf_fp32 = checkpoint
    # Chunks of 64 tokens: the 300-token prompt is prefilled in 5 steps while the others decode in CUDA graphs.
    llm = LLM(folder, dtype="bfloat16", device="cuda", page_size=16, num_pages=512, max_num_batched_tokens=64)
    rng = random.Random(1)
    prompts = [[rng.randrange(0, 380) for _ in range(n)] for n in (300, 37, 5)]
    background = [[rng.randrange(0, 380) for _ in range(9)] for _ in range(6)]
    warm = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)  # fills the cache
    assert warm[0].num_cached_tokens == 0
    params = [SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=5)] * len(prompts)
    params += [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * len(background)
    outputs = llm.generate(prompts + background, params, use_tqdm=False)
    rows = []
    for prompt, out in zip(prompts, outputs):
        assert out.num_cached_tokens == 0 and out.prompt_logprobs[0] is None
        ref16, truth = reference(hf_bf16, prompt), reference(hf_fp32, prompt)
        positions = range(1, len(prompt))
        ours = torch.tensor([out.prompt_logprobs[p].logprob for p in positions], dtype=torch.float64)
        hf16 = torch.tensor([ref16[p - 1, prompt[p]].item() for p in positions], dtype=torch.float64)
        true = torch.tensor([truth[p - 1, prompt[p]].item() for p in positions], dtype=torch.float64)
        top_agree = sum(out.prompt_logprobs[p].top[0][0] == int(truth[p - 1].argmax()) for p in positions) / len(
            positions
        )
        rows.append(
            {
                "prompt_tokens": len(prompt),
                "ours_vs_hf_bf16": (ours - hf16).abs().max().item(),
                "ours_vs_fp32": (ours - true).abs().max().item(),
                "hf_bf16_vs_fp32": (hf16 - true).abs().max().item(),
                "top1_agreement_with_fp32": top_agree,
            }
        )
        # bf16 against bf16: within the engine's logit tolerance (2% of the largest |logit|, twice: log-softmax).
        scale = truth.abs().max().item()
        assert rows[-1]["ours_vs_hf_bf16"] < 0.04 * scale
        # Against the truth, no worse than HF's own bf16 run (plus a little room).
        assert rows[-1]["ours_vs_fp32"] <= 1.5 * rows[-1]["hf_bf16_vs_fp32"] + 0.02
        assert top_agree >= 0.9
    record_result("prompt_logprobs_gpu.json", "prompt_logprobs_vs_hf", rows)
