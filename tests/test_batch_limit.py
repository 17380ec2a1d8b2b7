"""The default batch limit (engine/batch_limit.py): as many sequences as the KV pool holds at 1,024 tokens each (or the
context length when shorter), in steps of 16 from 256 to 512; and what follows it in the engine: the scheduler's limit,
the staging buffer, the GPU sampler's rows and the CUDA graphs' sizes, with batches above 256 replaying a graph on the
GPU's path (run on the CPU through tests/cpu_graphs.py). The GPU tests (test_cuda_graph_gpu.py) take the graphs at
the new sizes against eager decode, test_sampler_gpu.py the sampler at 512 rows against the reference sampler."""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import make_checkpoint
from cpu_graphs import graph_llm, plain_llm
from fastqwen import LLM, SamplingParams
from fastqwen.config import ModelConfig
from fastqwen.engine.batch_limit import default_max_num_seqs, estimated_pool_pages
from fastqwen.kvcache import KVPool
from fastqwen.ops import _native, decode_workspace, decode_workspace_bytes

K = 1024


@pytest.mark.parametrize(
    "pool_tokens, max_model_len, limit",
    [
        (0, 40960, 256),  # a pool too small for 256 sequences keeps the old default
        (256 * K - 1, 40960, 256),
        (300 * K, 40960, 288),  # 300 sequences of 1,024 tokens: down to a multiple of 16
        (352 * K + K - 1, 40960, 352),
        (511 * K, 40960, 496),
        (512 * K, 40960, 512),
        (10**9, 40960, 512),  # never above 512
        (400 * 300, 300, 400),  # a context shorter than 1,024: sequences of the whole context
        (400 * 300 - 1, 300, 384),
        (600 * 1024, 1025, 512),
    ],
)
def test_the_default_limit_follows_the_pool(pool_tokens, max_model_len, limit):
    assert default_max_num_seqs(pool_tokens, max_model_len) == limit


def test_the_documented_h100_example():
    """batch_limit's docstring: on an 80 GB H100 with Qwen3-8B at the default memory fraction, a bf16 pool gives
    about 352 sequences and an FP8 pool 512. About 68 GB are free after the 16.4 GB of weights (85 GB less the CUDA
    context); the decode workspace's row is 32 heads x 32 splits x 129 floats."""
    cfg = ModelConfig.from_preset("Qwen3-8B")
    workspace_row = 32 * 32 * 129 * 4
    limits = {}
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        page_bytes = KVPool.bytes_per_page(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, dtype)
        pages = estimated_pool_pages(68 * 10**9, 0.85, cfg, 8192, page_bytes, workspace_row)
        limits[str(dtype)] = (pages * 16, default_max_num_seqs(pages * 16, cfg.max_position_embeddings))
    tokens, limit = limits["torch.bfloat16"]
    assert 360_000 <= tokens <= 380_000 and limit == 352, limits
    assert limits["torch.float8_e4m3fn"][1] == 512, limits


@pytest.mark.skipif(_native.native() is None, reason="fastqwen._C is not built")
@pytest.mark.parametrize("batch, heads", [(1, 32), (7, 8), (512, 40)])
def test_decode_workspace_bytes_is_what_the_workspace_allocates(batch, heads):
    """The budget's price of the decode attention scratch against the bytes the scratch's tensors hold."""
    workspace = decode_workspace(batch, heads, torch.device("cpu"))
    held = sum(t.numel() * t.element_size() for t in (workspace.split_offsets, workspace.part_out, workspace.part_lse))
    assert decode_workspace_bytes(batch, heads) == held


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("batch_limit"))
    make_checkpoint(path, tied=False, seed=7, logit_scale=4.0)  # context 512 tokens
    return path


def test_the_engine_sizes_everything_from_the_limit(folder, monkeypatch):
    """With --num-pages holding 300 sequences of the context (512 tokens): limit 288, and the scheduler, the staging
    buffer, the GPU sampler and the graphs (capture sizes up to and including it) all follow; an explicit
    --max-num-seqs or --cuda-graph-max-bs still wins. The CPU's default pool (1 GiB) holds 512 of them."""
    small = LLM(folder, dtype="float32", device="cpu", num_pages=64)
    assert small.engine.scheduler.max_num_seqs == 256  # 1,024 tokens: the old default
    default = LLM(folder, dtype="float32", device="cpu")
    assert default.engine.kv.num_pages * default.engine.kv.page_size >= 512 * 512
    assert default.engine.scheduler.max_num_seqs == 512

    pages = 300 * 512 // 16
    llm = graph_llm(monkeypatch, folder, num_pages=pages, page_size=16, cuda_graph_max_bs=None)
    engine = llm.engine
    assert engine.max_num_seqs == engine.scheduler.max_num_seqs == 288
    assert engine.staging.max_seqs == 288 and engine.runner.sampler.max_rows == 288
    sizes = engine.runner.graphs.sizes
    assert sizes[-1] == engine.runner.graphs.max_bs == 288 and {256, 272, 288} <= set(sizes)
    assert sizes == sorted(set(sizes)) and all(s <= 64 or s % 16 == 0 for s in sizes)

    capped = graph_llm(monkeypatch, folder, num_pages=pages, page_size=16, cuda_graph_max_bs=100)
    assert capped.engine.max_num_seqs == 288 and capped.engine.runner.graphs.max_bs == 100
    explicit = graph_llm(monkeypatch, folder, num_pages=pages, page_size=16, max_num_seqs=40, cuda_graph_max_bs=None)
    assert explicit.engine.scheduler.max_num_seqs == 40 and explicit.engine.runner.graphs.max_bs == 40


def test_a_batch_above_256_replays_a_graph(folder, monkeypatch):
    """300 sequences decoding together on the GPU's path (tests/cpu_graphs.py), graphs following the default limit
    (512): the batch of 300 replays the graph of 304, and every sequence's tokens are the eager engine's."""
    rng = random.Random(5)
    prompts = [[rng.randrange(0, 380) for _ in range(rng.randint(2, 6))] for _ in range(300)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    kwargs = dict(num_pages=512 * 512 // 16, page_size=16)
    llm = graph_llm(monkeypatch, folder, cuda_graph_max_bs=None, **kwargs)
    graphs = llm.engine.runner.graphs
    assert graphs.max_bs == 512
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert 304 in graphs.forwards and 304 in graphs.sampler_replays, sorted(set(graphs.forwards))
    want = [o.token_ids for o in plain_llm(monkeypatch, folder, **kwargs).generate(prompts, params, use_tqdm=False)]
    assert got == want
