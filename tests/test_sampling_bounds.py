"""The validated ranges of every sampling field and the ranges the samplers accept agree (issue 23).

Anything SamplingParams accepts runs through the engine and the sampler without an error and draws a valid token
(in the vocabulary, never a banned one before min_tokens): fuzzed with hypothesis over the whole accepted range,
extremes included, on the reference path (CPU); the GPU test runs the same draws through the CUDA sampler with
graphs. Anything just outside is refused with the field named. Clamping top_k >= vocabulary to "off" keeps exactly
the tokens the reference keeps for that k.
"""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import EOS_IDS, VOCAB, make_checkpoint
from fastqwen import LLM, InvalidRequestError, SamplingParams
from fastqwen.ops.sampling import top_k_top_p_min_p_mask
from fastqwen.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_TEMPERATURE, REPETITION_PENALTY_RANGE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

INT64_MAX = 2**63 - 1


def accepted_params(draw_int, draw_float, draw_choice, draw_ids) -> dict:
    """One request's sampling fields, anywhere in the accepted range (extremes likely)."""
    min_tokens = draw_int(0, 3)
    return dict(
        temperature=draw_choice([0.0, 1e-30, 1e-5, 0.7, 2.0, MAX_TEMPERATURE, draw_float(0.0, MAX_TEMPERATURE)]),
        top_k=draw_choice([-1, 0, 1, VOCAB - 1, VOCAB, 2**31 - 1, 2**31, 2**32, INT64_MAX, draw_int(-1, INT64_MAX)]),
        top_p=draw_choice([1e-300, 1e-6, 0.5, 1.0, draw_float(1e-9, 1.0)]),
        min_p=draw_choice([0.0, 1.0, draw_float(0.0, 1.0)]),
        repetition_penalty=draw_choice([*REPETITION_PENALTY_RANGE, 1.0, draw_float(*REPETITION_PENALTY_RANGE)]),
        presence_penalty=draw_float(-2.0, 2.0),
        frequency_penalty=draw_float(-2.0, 2.0),
        seed=draw_choice([None, -(2**63), INT64_MAX, draw_int(-(2**63), INT64_MAX)]),
        logprobs=draw_choice([None, 0, MAX_LOGPROBS]),
        min_tokens=min_tokens,
        max_tokens=min_tokens + draw_int(1, 2),
        stop_token_ids=draw_ids(),  # any length: duplicates dropped, so never wider than the vocabulary
    )


def check_output(output, params: dict) -> None:
    assert output.finish_reason in ("stop", "length"), (output.finish_reason, output.error, params)
    assert all(0 <= t < VOCAB for t in output.token_ids)
    banned = set(params["stop_token_ids"]) | set(EOS_IDS)
    early = output.token_ids[: params["min_tokens"]]
    assert not banned & set(early), "a banned token came out before min_tokens"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("bounds"))
    make_checkpoint(path, tied=True, max_positions=64)
    return path


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder, dtype="float32", device="cpu", num_pages=64, page_size=4)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_accepted_value_samples_on_the_reference_path(llm, data):
    params = accepted_params(
        lambda lo, hi: data.draw(st.integers(lo, hi)),
        lambda lo, hi: data.draw(st.floats(lo, hi, allow_nan=False)),
        lambda options: data.draw(st.sampled_from(options)),
        lambda: data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=600)),
    )
    prompt = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8))
    output = llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]
    check_output(output, params)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", MAX_TEMPERATURE * 1.01),
        ("temperature", 1e300),
        ("top_k", 2**63),
        ("top_k", -2),
        ("top_p", 0.0),
        ("repetition_penalty", REPETITION_PENALTY_RANGE[0] / 2),
        ("repetition_penalty", REPETITION_PENALTY_RANGE[1] * 2),
        ("presence_penalty", 2.0001),
        ("seed", 2**63),
        ("max_tokens", 2**63),
        ("min_tokens", 2**63),
        ("logprobs", MAX_LOGPROBS + 1),
        ("stop", [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]),
        ("stop", ["x" * 1025]),
        ("stop_token_ids", "12"),
    ],
)
def test_just_outside_the_range_is_refused(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field


def test_top_k_past_the_vocabulary_keeps_what_the_reference_keeps():
    """The frontend runs top_k >= vocabulary as off: the reference mask for such a k is the mask with top_k off."""
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(6, VOCAB, dtype=torch.float64) * 3, dim=-1)
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0, 0.99, 0.3], dtype=torch.float64)
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.5, 0.0, 0.0], dtype=torch.float64)
    for k in (VOCAB, VOCAB + 1, 2**31, INT64_MAX):
        huge = top_k_top_p_min_p_mask(probs, torch.full((6,), k, dtype=torch.int64), top_p, min_p)
        off = top_k_top_p_min_p_mask(probs, torch.zeros(6, dtype=torch.int64), top_p, min_p)
        assert torch.equal(huge, off), k


def test_the_frontend_runs_a_vocabulary_wide_top_k_as_off(llm):
    for k in (VOCAB, 2**31, INT64_MAX):
        _, params = llm.frontend.prepare([1, 2], SamplingParams(top_k=k))
        assert params.top_k == 0
    _, params = llm.frontend.prepare([1, 2], SamplingParams(top_k=VOCAB - 1))
    assert params.top_k == VOCAB - 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ban_lengths", [(0, 1, 4), (8, 64, 600)], ids=["short bans", "long bans"])
def test_every_accepted_value_samples_on_the_cuda_sampler_with_graphs(tmp_path, ban_lengths):
    """The same draws through the CUDA sampler, decode steps in CUDA graphs, in one batch. Ban lists (min_tokens x
    stop_token_ids) longer than 7 with graphs need the sampler of the `contracts` branch."""
    folder = str(tmp_path)  # the decode kernel (and so graph capture) needs head_dim 128 and a half dtype
    make_checkpoint(
        folder,
        tied=False,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        hidden=256,
        intermediate=512,
        layers=2,
        dtype=torch.bfloat16,
        max_positions=64,
    )
    llm = LLM(folder, dtype="bfloat16", device="cuda", num_pages=256, page_size=16)
    assert llm.engine.runner.graphs is not None, "this test is about the graph path"
    rng = random.Random(23)
    all_params = [
        accepted_params(
            rng.randint, rng.uniform, rng.choice, lambda: [rng.randrange(VOCAB) for _ in range(rng.choice(ban_lengths))]
        )
        for _ in range(96)
    ]
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))] for _ in all_params]
    outputs = llm.generate(prompts, [SamplingParams(**p) for p in all_params], use_tqdm=False)
    for output, params in zip(outputs, all_params):
        check_output(output, params)
