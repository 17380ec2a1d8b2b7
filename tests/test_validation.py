"""Every bad request raises InvalidRequestError naming the field, and leaves the engine untouched."""

from __future__ import annotations

import pytest
from checkpoints import make_checkpoint
from fastqwen import LLM, InvalidRequestError, SamplingParams
from fastqwen.config import GenerationDefaults


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.5}, "min_p"),
        ({"min_p": 1.01}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"seed": 2**64}, "seed"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop_token_ids": ["x"]}, "stop_token_ids"),
    ],
)
def test_bad_sampling_params(kwargs, param):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param
    assert param in str(err.value)


def test_defaults_come_from_generation_config():
    defaults = GenerationDefaults(eos_token_ids=[1], temperature=0.6, top_k=20, top_p=0.95, min_p=0.0)
    filled = SamplingParams().with_defaults(defaults)
    assert (filled.temperature, filled.top_k, filled.top_p, filled.min_p, filled.repetition_penalty) == (
        0.6,
        20,
        0.95,
        0.0,
        1.0,
    )
    explicit = SamplingParams(temperature=0.0, top_k=-1, top_p=1.0).with_defaults(defaults)
    assert (explicit.temperature, explicit.top_k, explicit.top_p) == (0.0, -1, 1.0)
    assert SamplingParams().with_defaults(GenerationDefaults()).temperature == 1.0


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("validation"))
    make_checkpoint(folder, tied=True, max_positions=128)
    return LLM(folder, dtype="float32", device="cpu", num_pages=64, page_size=4)


@pytest.mark.parametrize(
    "prompt,kwargs,param,message",
    [
        ([], {}, "prompt", "empty"),
        ("", {}, "prompt", "empty"),
        ([1, 2, 384], {}, "prompt", "vocabulary"),
        ([1, -1], {}, "prompt", "vocabulary"),
        ([1, "2"], {}, "prompt", "token ids"),
        ([1, True], {}, "prompt", "token ids"),  # a bool is an int to Python, not a token id
        ([1, 2.0], {}, "prompt", "token ids"),
        ([1] * 100, {"max_tokens": 29}, "max_tokens", "maximum context length"),
        ([1] * 128, {"max_tokens": 1}, "prompt", "maximum context length"),
        ([1, 2], {"stop_token_ids": [1000]}, "stop_token_ids", "vocabulary"),
    ],
)
def test_bad_requests_leave_the_engine_untouched(llm, prompt, kwargs, param, message):
    with pytest.raises(InvalidRequestError, match=message) as err:
        llm.generate([[5, 6, 7], prompt], SamplingParams(**kwargs), use_tqdm=False)
    assert err.value.param == param
    assert not llm.engine.has_unfinished(), "a rejected batch must queue nothing"
    allocator = llm.engine.kv.allocator
    assert allocator.num_free() == allocator.num_total()


def test_unknown_model_or_preset():
    with pytest.raises(InvalidRequestError, match="Qwen3-8B") as err:
        LLM("Qwen3-3B", load_format="dummy", device="cpu")
    assert err.value.param == "model"
    with pytest.raises(InvalidRequestError, match="unknown model"):
        LLM("/no/such/folder", device="cpu")


def test_stop_strings_need_a_tokenizer(tmp_path):
    make_checkpoint(str(tmp_path), tied=True)
    (tmp_path / "tokenizer.json").unlink()
    llm = LLM(str(tmp_path), device="cpu", num_pages=8)
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([[1, 2]], SamplingParams(stop=["x"]), use_tqdm=False)
    assert err.value.param == "stop"
    with pytest.raises(InvalidRequestError) as err:
        llm.generate("text", use_tqdm=False)
    assert err.value.param == "prompt"
