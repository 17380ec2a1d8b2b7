"""The engine on its CUDA kernels at 8k, 16k and 32k tokens of context against the same engine on the PyTorch reference
ops (bf16, random weights with real head geometry): prefill in 2048-token chunks and in one piece, a prefix-cache hit
that extends a 32k-token cached prefix, and decode steps that cross the split limits of the decode kernel (8192 and
16384 keys). Logits within LOGIT_TOLERANCE of the largest reference logit at every step compared.

That tolerance can see a partial-context bug: each context first checks that the reference engine with its decode
attention skipping the first chunk of keys (1/32 of them, the decode kernel's chunk) moves the first decode step's
logits by more than twice the tolerance.
"""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import engine_logits, make_checkpoint, record_result
from fastqwen import LLM
from fastqwen.ops import _native
from fastqwen.ops import attention as attention_ops

LOGIT_TOLERANCE = 0.02  # of the largest |logit| of the reference, as in test_engine_gpu.py
NEW_TOKENS = 8
# Prompts end just below a split limit, so the decode steps cross it; 32760 + 8 tokens fill a 32768-token context.
PROMPT_LENS = {"8k": 8190, "16k": 16380, "32k": 32760}
MAX_LEN = 32768
HIT_PREFIX = 32600
PAGE = 16
PAGES_PER_CONTEXT = MAX_LEN // PAGE + 8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and _native.has_cuda_kernels()), reason="needs a CUDA GPU and the kernels"
    ),
]


def decode_skipping_first_chunk(
    q, k_cache, v_cache, page_table, kv_lens, scale, out, workspace=None, planned=False, k_scale=1.0, v_scale=1.0
):
    """The reference decode op with the bug the tests must see: each sequence's first 1/32 of keys is left out."""
    lens = kv_lens.tolist()
    skip = torch.tensor([max(256, -(-n // 32)) if n > 256 else 0 for n in lens], device=kv_lens.device)
    # Attend to keys [skip, n): the same pages from the skipped position on (a whole number of pages).
    skip = skip // PAGE * PAGE
    shifted = torch.zeros_like(page_table)
    for b, s in enumerate(skip.tolist()):
        rest = page_table[b, s // PAGE :]
        shifted[b, : rest.shape[0]] = rest
    out.copy_(
        attention_ops.paged_attention_decode_reference(
            q, k_cache, v_cache, shifted, kv_lens - skip.int(), scale, k_scale, v_scale
        )
    )
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The checkpoint, the prompts, and the reference engine's results: tokens and logits per case, and the first
    decode step's logits with the skipped chunk."""
    folder = str(tmp_path_factory.mktemp("long"))
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
        seed=21,
        max_positions=MAX_LEN,
    )
    rng = random.Random(8)
    prompts = {name: [rng.randrange(0, 380) for _ in range(n)] for name, n in PROMPT_LENS.items()}
    # A prefix-cache hit: the 32k prompt's first HIT_PREFIX tokens, then 150 new ones.
    prompts["32k-hit"] = prompts["32k"][:HIT_PREFIX] + [rng.randrange(0, 380) for _ in range(150)]
    reference, skipped = {}, {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_native, "_has_cuda", False)  # every op takes its reference path
        kwargs = dict(
            dtype="bfloat16",
            device="cuda",
            page_size=PAGE,
            num_pages=PAGES_PER_CONTEXT,
            max_num_batched_tokens=2048,
            max_num_seqs=4,
            disable_cuda_graph=True,
            enable_prefix_caching=False,
            allow_reference_on_gpu=True,
        )
        llm = LLM(folder, **kwargs)
        for name, prompt in prompts.items():
            reference[name] = engine_logits(llm, prompt, NEW_TOKENS)
        patch.setattr(
            attention_ops, "paged_attention_decode", decode_skipping_first_chunk
        )  # ops.paged_attention calls it
        for name in PROMPT_LENS:
            skipped[name] = engine_logits(llm, prompts[name], 2)[1][1]
        del llm
    torch.cuda.empty_cache()
    return folder, prompts, reference, skipped


def compare(name: str, got, want) -> tuple[int, float]:
    """Logits within the tolerance while the tokens agree; tokens may part only where the reference's top-1 margin
    is within twice the tolerance. Returns the number of steps compared and the largest difference seen (as a
    fraction of the largest reference logit)."""
    tokens, logits = got
    ref_tokens, ref_logits = want
    scale = ref_logits.abs().max().item()
    top2 = ref_logits.topk(2, dim=-1).values
    compared, worst = 0, 0.0
    for k in range(len(ref_tokens)):
        diff = (logits[k] - ref_logits[k]).abs().max().item()
        assert diff <= LOGIT_TOLERANCE * scale, f"{name} step {k}: logits differ by {diff / scale:.3%} of the largest"
        compared, worst = compared + 1, max(worst, diff / scale)
        if tokens[k] != ref_tokens[k]:
            margin = (top2[k, 0] - top2[k, 1]).item()
            assert margin <= 2 * LOGIT_TOLERANCE * scale, f"{name} step {k}: token differs at margin {margin:.2f}"
            break
    return compared, worst


def test_the_tolerance_sees_a_skipped_chunk(setup):
    _, _, reference, skipped = setup
    moves = {}
    for name in PROMPT_LENS:
        ref_logits = reference[name][1]
        moves[name] = round((skipped[name] - ref_logits[1]).abs().max().item() / ref_logits.abs().max().item(), 4)
    record_result("long_context.json", "skipped_first_chunk_moves_first_decode_logits", moves)
    for name, moved in moves.items():
        assert moved > 2 * LOGIT_TOLERANCE, f"{name}: a skipped chunk moves the logits by only {moved:.4f}"


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked-prefill", "whole-prefill"])
def test_long_context_matches_reference_engine(setup, chunked):
    folder, prompts, reference, _ = setup
    llm = LLM(
        folder,
        dtype="bfloat16",
        device="cuda",
        page_size=PAGE,
        num_pages=2 * PAGES_PER_CONTEXT,
        max_num_seqs=4,
        max_num_batched_tokens=2048 if chunked else MAX_LEN,
        cuda_graph_max_bs=4,
    )
    assert llm.engine.runner.graphs is not None  # decode steps replay CUDA graphs
    figures = {}
    for name in PROMPT_LENS:
        figures[name] = compare(name, engine_logits(llm, prompts[name], NEW_TOKENS), reference[name])
    # The 32k prompt is cached now (whole pages): the hit prompt takes the pages of its first 32592 tokens from it.
    output, logits = engine_logits(llm, prompts["32k-hit"], NEW_TOKENS, whole_output=True)
    assert output.num_cached_tokens == HIT_PREFIX // PAGE * PAGE, output.num_cached_tokens
    figures["32k-hit"] = compare("32k-hit", (output.token_ids, logits), reference["32k-hit"])
    record_result(
        "long_context.json",
        "chunked_prefill" if chunked else "whole_prefill",
        {
            name: {"steps_compared": n, "max_logit_diff_of_largest": round(worst, 4)}
            for name, (n, worst) in figures.items()
        },
    )
    total = sum(n for n, _ in figures.values())
    assert total >= 8, f"only {total} steps compared: the tokens parted too early to test decode"
    llm.engine.check_invariants()
