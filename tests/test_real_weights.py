"""The real-weights smoke test: the greedy continuation of "The capital of France is", on the GPU and on the CPU
reference path, through the offline LLM and through the server. It runs wherever a checkpoint is found and skips,
saying where it looked, otherwise (`pytest -rs` prints the reason):

    FASTQWEN_TEST_MODEL=/path/to/checkpoint python -m pytest -q -rs tests/test_real_weights.py

Without the variable it takes the first of Qwen/Qwen3-8B, Qwen/Qwen3-8B-FP8, Qwen/Qwen3-0.6B complete in the Hugging
Face hub cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub; `hf download Qwen/Qwen3-0.6B`).

What is asserted depends on the checkpoint (read from its config.json):
- Qwen3-8B (bf16): the 20 greedy tokens of DESIGN.md section 6, token for token. The CPU path holds it in bf16
  (16 GiB of memory) and takes a few minutes.
- Qwen3-0.6B: Hugging Face transformers' greedy tokens on the same checkpoint in fp32 on the CPU are the reference:
  fastqwen's fp32 CPU path must give them all; the bf16 GPU path must give them up to the first step whose reference
  top-2 logit margin is under DECISIVE_MARGIN (past that, bf16 rounding may pick the runner-up, and greedy outputs
  diverge after any difference).
- Qwen3-8B-FP8 (GPU only: the CPU path runs no FP8 projections): the text must name Paris; where transformers can load
  the checkpoint on the GPU, its greedy tokens are the reference as for 0.6B.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from fastqwen import LLM, SamplingParams
from fastqwen.ops import _native
from server_process import ServerProcess

PROMPT = "The capital of France is"
# Qwen3-8B (bf16), greedy, 20 new tokens (" Paris. The capital of France is Paris. ..."), as DESIGN.md section 6 states.
EXPECTED_8B = [
    12095,
    13,
    576,
    6722,
    315,
    9625,
    374,
    12095,
    13,
    576,
    6722,
    315,
    9625,
    374,
    12095,
    13,
    576,
    6722,
    315,
    9625,
]
NEW_TOKENS = len(EXPECTED_8B)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
# Not measured (no real weights here): a bf16 forward's logit error on these models is expected to be well under one
# logit, so a reference step whose top-2 margin is at least this is decisive. Revisit with a measured spread.
DECISIVE_MARGIN = 1.0
MIN_DECISIVE_STEPS = 4
HUB_MODELS = ("Qwen/Qwen3-8B", "Qwen/Qwen3-8B-FP8", "Qwen/Qwen3-0.6B")  # in order of preference


# ---- finding a checkpoint ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    path: str
    kind: str  # "Qwen3-8B", "Qwen3-8B-FP8", "Qwen3-0.6B" or "other"


def hub_cache_dir(environ: Mapping[str, str]) -> Path:
    """The hub cache folder huggingface_hub uses: HF_HUB_CACHE, else HF_HOME/hub, else XDG_CACHE_HOME (or ~/.cache)
    /huggingface/hub."""
    if environ.get("HF_HUB_CACHE"):
        return Path(environ["HF_HUB_CACHE"]).expanduser()
    home = environ.get("HF_HOME") or os.path.join(environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def is_complete(folder: Path) -> bool:
    """config.json and the weights are there: every shard the safetensors index names (a download cut short leaves
    some out), or a single model.safetensors."""
    if not (folder / "config.json").is_file():
        return False
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        return all((folder / shard).is_file() for shard in shards)  # is_file follows the snapshot's blob links
    return (folder / "model.safetensors").is_file()


def cached_snapshot(cache: Path, repo: str) -> Path | None:
    """The complete snapshot of a hub repository in the cache's layout (models--Org--Name/snapshots/<revision>),
    refs/main's revision first, then the newest."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshots = root / "snapshots"
    if not snapshots.is_dir():
        return None
    candidates = []
    main = root / "refs" / "main"
    if main.is_file():
        candidates.append(snapshots / main.read_text().strip())
    candidates += sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    return next((c for c in candidates if is_complete(c)), None)


def checkpoint_kind(folder: Path) -> str:
    cfg = json.loads((folder / "config.json").read_text())
    fp8 = (cfg.get("quantization_config") or {}).get("quant_method") == "fp8"
    shape = (cfg.get("hidden_size"), cfg.get("num_hidden_layers"), cfg.get("vocab_size"))
    if shape == (4096, 36, 151936):
        return "Qwen3-8B-FP8" if fp8 else "Qwen3-8B"
    if shape == (1024, 28, 151936) and not fp8:
        return "Qwen3-0.6B"
    return "other"


def find_checkpoint(environ: Mapping[str, str]) -> tuple[Checkpoint | None, str]:
    """The checkpoint to test and where it came from, or None and where the search looked."""
    folder = environ.get("FASTQWEN_TEST_MODEL")
    if folder:
        path = Path(folder).expanduser()
        if not is_complete(path):
            return None, f"FASTQWEN_TEST_MODEL={folder}: no config.json and complete safetensors weights there"
        return Checkpoint(str(path), checkpoint_kind(path)), f"FASTQWEN_TEST_MODEL={folder}"
    cache = hub_cache_dir(environ)
    for repo in HUB_MODELS:
        snapshot = cached_snapshot(cache, repo)
        if snapshot is not None:
            return Checkpoint(str(snapshot), checkpoint_kind(snapshot)), f"{repo} in the hub cache {cache}"
    return None, (
        f"FASTQWEN_TEST_MODEL is not set and none of {', '.join(HUB_MODELS)} is complete in the hub cache {cache} "
        "(HF_HUB_CACHE, else HF_HOME/hub)"
    )


CHECKPOINT, FOUND = find_checkpoint(os.environ)
needs_weights = pytest.mark.skipif(CHECKPOINT is None, reason=f"no checkpoint: {FOUND}")
on_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and _native.has_cuda_kernels()), reason="needs a GPU and the CUDA kernels"
)


# ---- references ----------------------------------------------------------------------------------------------------


@dataclass
class Reference:
    tokens: list[int]
    margins: list[float] | None  # the reference's top-2 logit margin at each step; None: exact tokens (DESIGN.md)


@functools.cache
def hf_reference(path: str, device: str) -> Reference | None:
    """Transformers' greedy tokens on the checkpoint (fp32 on the CPU; the checkpoint's dtype on the GPU), or None
    where transformers cannot load it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        dtype = torch.float32 if device == "cpu" else "auto"
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device).eval()
    except Exception as error:  # e.g. an FP8 checkpoint transformers cannot place on this device
        print(f"transformers cannot load {path} on {device}: {error!r}")
        return None
    ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt").input_ids.to(device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            output_scores=True,
            return_dict_in_generate=True,
        )
    top2 = [s[0].float().topk(2).values for s in out.scores]
    del model
    return Reference(out.sequences[0, ids.shape[1] :].tolist(), [float(v[0] - v[1]) for v in top2])


def reference_for(device: str) -> Reference | None:
    kind = CHECKPOINT.kind
    if kind == "Qwen3-8B":
        return Reference(EXPECTED_8B, None)
    if kind == "Qwen3-0.6B":  # cheap: fp32 on the CPU, exact math against fastqwen's fp32 CPU path
        return hf_reference(CHECKPOINT.path, "cpu")
    if kind == "Qwen3-8B-FP8" and device == "cuda":
        return hf_reference(CHECKPOINT.path, "cuda")
    return None


def check_tokens(tokens: list[int], text: str, device: str) -> None:
    ref = reference_for(device)
    if CHECKPOINT.kind in ("Qwen3-8B", "Qwen3-8B-FP8"):
        assert "Paris" in text, text
    if ref is None:
        return
    if ref.margins is None or (device == "cpu" and CHECKPOINT.kind == "Qwen3-0.6B"):
        assert tokens == ref.tokens, (tokens, text)
        return
    decisive = next((i for i, m in enumerate(ref.margins) if m < DECISIVE_MARGIN), len(ref.margins))
    assert decisive >= MIN_DECISIVE_STEPS, f"only {decisive} decisive reference steps: {ref.margins}"
    assert tokens[:decisive] == ref.tokens[:decisive], (tokens, ref.tokens, decisive, text)


def engine_dtype(device: str) -> str:
    return "float32" if device == "cpu" and CHECKPOINT.kind == "Qwen3-0.6B" else "bfloat16"


def skip_unsupported(device: str) -> None:
    if device == "cpu" and CHECKPOINT.kind == "Qwen3-8B-FP8":
        pytest.skip("the CPU reference path runs no FP8 projections")
    if CHECKPOINT.kind == "other":
        pytest.skip(f"{CHECKPOINT.path} is none of {', '.join(HUB_MODELS)}: no reference for its tokens")


# ---- the engine and the server on the checkpoint -----------------------------------------------------------------


@needs_weights
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=[pytest.mark.gpu, on_gpu]), "cpu"])
def test_offline_llm(device):
    skip_unsupported(device)
    small = {"max_model_len": 256, "num_pages": 16, "page_size": 16} if device == "cpu" else {"max_model_len": 4096}
    llm = LLM(CHECKPOINT.path, device=device, dtype=engine_dtype(device), **small)
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    check_tokens(out.token_ids, out.text, device)
    if CHECKPOINT.kind == "Qwen3-8B":
        assert out.text.startswith(" Paris.")


@needs_weights
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=[pytest.mark.gpu, on_gpu]), "cpu"])
def test_server(device, tmp_path):
    skip_unsupported(device)
    pages = ["--num-pages", "16", "--page-size", "16"] if device == "cpu" else []
    server = ServerProcess(
        CHECKPOINT.path,
        "--device",
        device,
        "--dtype",
        engine_dtype(device),
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
            json={"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        check_tokens(choice["token_ids"], choice["text"], device)
    finally:
        server.stop()


# ---- the search itself, on a fake cache (runs everywhere) ----------------------------------------------------------


def fake_snapshot(cache: Path, repo: str, revision: str, config: dict, shards: int = 2, missing: int = 0) -> Path:
    """A hub-cache snapshot as huggingface_hub lays it out: files are links into blobs/; `missing` shards absent."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / revision
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(revision)
    names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    index = {"weight_map": {f"w{i}": name for i, name in enumerate(names)}}
    files = {"config.json": json.dumps(config), "model.safetensors.index.json": json.dumps(index)}
    files.update({n: "weights" for n in names[: shards - missing]})
    for name, content in files.items():
        blob = root / "blobs" / f"{revision}-{name}"
        blob.write_text(content)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


CONFIG_8B = {"hidden_size": 4096, "num_hidden_layers": 36, "vocab_size": 151936}
CONFIG_FP8 = {**CONFIG_8B, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
CONFIG_06B = {"hidden_size": 1024, "num_hidden_layers": 28, "vocab_size": 151936}


def test_hub_cache_dir_follows_huggingface_hub():
    import huggingface_hub.constants

    assert hub_cache_dir(os.environ) == Path(huggingface_hub.constants.HF_HUB_CACHE).expanduser()
    assert hub_cache_dir({"HF_HUB_CACHE": "/a", "HF_HOME": "/b"}) == Path("/a")
    assert hub_cache_dir({"HF_HOME": "/b"}) == Path("/b/hub")
    assert hub_cache_dir({"XDG_CACHE_HOME": "/c"}) == Path("/c/huggingface/hub")


def test_finds_each_hub_model_and_says_where_it_looked(tmp_path):
    env = {"HF_HUB_CACHE": str(tmp_path)}
    found, why = find_checkpoint(env)
    assert found is None and str(tmp_path) in why and "FASTQWEN_TEST_MODEL" in why
    fake_snapshot(tmp_path, "Qwen/Qwen3-0.6B", "r06", CONFIG_06B)
    assert find_checkpoint(env) == (
        Checkpoint(str(tmp_path / "models--Qwen--Qwen3-0.6B/snapshots/r06"), "Qwen3-0.6B"),
        f"Qwen/Qwen3-0.6B in the hub cache {tmp_path}",
    )
    fake_snapshot(tmp_path, "Qwen/Qwen3-8B-FP8", "rfp8", CONFIG_FP8)
    assert find_checkpoint(env)[0].kind == "Qwen3-8B-FP8"  # preferred to 0.6B
    fake_snapshot(tmp_path, "Qwen/Qwen3-8B", "r8", CONFIG_8B)
    assert find_checkpoint(env)[0] == Checkpoint(str(tmp_path / "models--Qwen--Qwen3-8B/snapshots/r8"), "Qwen3-8B")


def test_skips_a_download_cut_short(tmp_path):
    fake_snapshot(tmp_path, "Qwen/Qwen3-8B", "partial", CONFIG_8B, shards=5, missing=1)
    found, why = find_checkpoint({"HF_HUB_CACHE": str(tmp_path)})
    assert found is None and "none of" in why
    fake_snapshot(tmp_path, "Qwen/Qwen3-0.6B", "whole", CONFIG_06B, shards=1)
    assert find_checkpoint({"HF_HUB_CACHE": str(tmp_path)})[0].kind == "Qwen3-0.6B"


def test_the_variable_wins_and_a_bad_one_says_so(tmp_path):
    cached = fake_snapshot(tmp_path / "hub", "Qwen/Qwen3-8B", "r8", CONFIG_8B)
    mine = fake_snapshot(tmp_path / "mine", "x/y", "r", {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 9})
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "FASTQWEN_TEST_MODEL": str(mine)}
    assert find_checkpoint(env) == (Checkpoint(str(mine), "other"), f"FASTQWEN_TEST_MODEL={mine}")
    assert find_checkpoint({**env, "FASTQWEN_TEST_MODEL": str(cached)})[0].kind == "Qwen3-8B"
    found, why = find_checkpoint({**env, "FASTQWEN_TEST_MODEL": str(tmp_path / "nowhere")})
    assert found is None and why.startswith(f"FASTQWEN_TEST_MODEL={tmp_path / 'nowhere'}:")


def test_prefers_the_revision_refs_main_names(tmp_path):
    pinned = fake_snapshot(tmp_path, "Qwen/Qwen3-0.6B", "pinned", CONFIG_06B)
    newer = fake_snapshot(tmp_path, "Qwen/Qwen3-0.6B", "newer", CONFIG_06B)
    (tmp_path / "models--Qwen--Qwen3-0.6B" / "refs" / "main").write_text("pinned\n")
    os.utime(newer, (pinned.stat().st_mtime + 60,) * 2)
    assert find_checkpoint({"HF_HUB_CACHE": str(tmp_path)})[0].path == str(pinned)
