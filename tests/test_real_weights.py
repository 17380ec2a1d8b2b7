"""The real-weights smoke test: Qwen3-8B's greedy continuation of "The capital of France is", token for token, on the
GPU and on the CPU reference path, through the offline LLM and through the server. It runs whenever the weights are
here and skips otherwise:

    FASTQWEN_TEST_MODEL=/path/to/Qwen3-8B python -m pytest -q tests/test_real_weights.py

(or with Qwen/Qwen3-8B in the Hugging Face cache: `hf download Qwen/Qwen3-8B`, then no variable is needed). The CPU
reference path holds the model in bfloat16 (16 GiB of memory) and takes a few minutes.
"""

from __future__ import annotations

import os

import httpx
import pytest
import torch
from fastqwen import LLM, SamplingParams
from fastqwen.ops import _native
from server_process import ServerProcess

PROMPT = "The capital of France is"
# Greedy, 20 new tokens (" Paris. The capital of France is Paris. ..."), as issue 17 states them.
EXPECTED = [12095, 13, 576, 6722, 315, 9625, 374, 12095, 13, 576, 6722, 315, 9625, 374, 12095, 13, 576, 6722, 315, 9625]
GREEDY = SamplingParams(temperature=0.0, max_tokens=len(EXPECTED), ignore_eos=True)


def _weights() -> str | None:
    folder = os.environ.get("FASTQWEN_TEST_MODEL")
    if folder:
        return folder
    try:
        import huggingface_hub

        return huggingface_hub.snapshot_download("Qwen/Qwen3-8B", local_files_only=True)
    except Exception:  # not cached, or no huggingface_hub
        return None


WEIGHTS = _weights()
pytestmark = pytest.mark.skipif(WEIGHTS is None, reason="no Qwen3-8B weights (set FASTQWEN_TEST_MODEL to their folder)")
on_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and _native.has_cuda_kernels()), reason="needs a GPU and the CUDA kernels"
)


def _check(llm: LLM) -> None:
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert out.token_ids == EXPECTED, (out.token_ids, out.text)
    assert out.text.startswith(" Paris.")


@pytest.mark.gpu
@on_gpu
def test_offline_llm_on_the_gpu():
    _check(LLM(WEIGHTS, dtype="bfloat16", max_model_len=4096))


def test_offline_llm_on_the_cpu_reference_path():
    _check(LLM(WEIGHTS, device="cpu", dtype="bfloat16", max_model_len=256, num_pages=16, page_size=16))


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=[pytest.mark.gpu, on_gpu]), "cpu"])
def test_server(device, tmp_path):
    pages = ["--num-pages", "16", "--page-size", "16"] if device == "cpu" else []
    server = ServerProcess(
        WEIGHTS,
        "--device",
        device,
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "256",
        *pages,
        timeout=1800.0,
        log_dir=str(tmp_path),
    )
    try:
        r = httpx.post(
            server.url + "/v1/completions",
            timeout=1800.0,
            json={"prompt": PROMPT, "max_tokens": len(EXPECTED), "temperature": 0, "ignore_eos": True},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == EXPECTED
    finally:
        server.stop()
