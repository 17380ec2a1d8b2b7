"""The last decoder layer of a prefill step runs its attention, o_proj and MLP only for the rows whose logits are read
(model/qwen3.py, _last_layer_takes_only): the K/V of every row still reach the cache, and the logits equal Hugging
Face's. On the CPU reference path, float32."""

from __future__ import annotations

import pytest
from checkpoints import engine_logits, hf_logits, make_checkpoint
from fastqwen import LLM, SamplingParams, ops


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("last-layer"))
    return folder, make_checkpoint(folder, tied=False, num_heads=4, num_kv_heads=2, layers=3)


def test_a_chunked_prompt_runs_the_last_layer_for_its_sampling_row_only(checkpoint, monkeypatch):
    folder, hf = checkpoint
    # chunks of 8 + 8 + 5 tokens: the first two sample nothing, the third samples its last row
    llm = LLM(folder, dtype="float32", device="cpu", page_size=4, num_pages=64, max_num_batched_tokens=8)
    last_down = llm.engine.runner.model.weights.layers[-1].down
    rows_of_last_down = []
    linear = ops.linear

    def recording_linear(x, weight, *args, **kwargs):
        if weight is last_down:
            rows_of_last_down.append(x.shape[0])
        return linear(x, weight, *args, **kwargs)

    monkeypatch.setattr(ops, "linear", recording_linear)
    prompt = [(7 * i + 3) % 380 for i in range(21)]
    tokens, logits = engine_logits(llm, prompt, max_tokens=4)
    # the prompt's three chunks: only the last one's sampling row, then one row per decode step
    assert rows_of_last_down == [1, 1, 1, 1], rows_of_last_down
    reference = hf_logits(hf, prompt, tokens)
    # float32 on both sides: measured 9e-7 of the largest logit; a row attended over a kv length one short: 1.2e-2
    error = (logits - reference).abs().max().item() / reference.abs().max().item()
    assert error <= 1e-4, error


def test_rows_of_a_mixed_batch_find_their_sequences(checkpoint):
    """A batch of decode rows and prefill chunks, some finishing and some not: each sampled row is attended to over its
    own sequence's cache (a decode row is the first row of its sequence in the batch, the case a search for the
    sequence gets wrong when it takes the sequence before), token for token with HF's greedy logits."""
    folder, hf = checkpoint
    llm = LLM(folder, dtype="float32", device="cpu", page_size=4, num_pages=256, max_num_batched_tokens=16)
    prompts = [[(5 * i + 11 * p) % 380 for i in range(length)] for p, length in enumerate([3, 30, 9, 17, 1])]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        reference = hf_logits(hf, prompt, out.token_ids)
        assert out.token_ids == reference.argmax(-1).tolist()
