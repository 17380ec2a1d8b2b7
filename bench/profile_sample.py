"""One sampler call at B=256, V=151,936, top_k=20, top_p=0.95, for a profiler (ncu --kernel-name regex:scan).

With --time: the kernel alone (no references), timed as bench/sampling_bench.py times it (CUDA graph over rotating
logits larger than twice the L2, median per call), at B = 1, 8, 64, 256, 512: a quick check between full runs."""

import math
import sys

import torch

from fastqwen.ops.sampling import pack_sampler_rows, sample, sampler_workspace

V = 151_936


def one_call(b: int = 256) -> None:
    logits = torch.randn(b, V, device="cuda") * 3
    rows = pack_sampler_rows([0.7] * b, 20, 0.95, seed=list(range(b)), step=1).cuda()
    tokens = torch.empty(b, dtype=torch.int64, device="cuda")
    ws = sampler_workspace(b, V, torch.device("cuda"))
    for _ in range(3):
        sample(logits, rows, tokens, ws)
    torch.cuda.synchronize()


def time_ours(batches=(1, 8, 64, 256, 512), iters: int = 30) -> None:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from common import graph_of, time_fn

    for b in batches:
        nbuf = min(256, max(2, math.ceil(2 * 50 * 1024 * 1024 / (b * V * 4))))
        logits = torch.randn(nbuf, b, V, device="cuda") * 3
        rows = pack_sampler_rows([0.7] * b, 20, 0.95, seed=list(range(b)), step=1).cuda()
        tokens = torch.empty(nbuf, b, dtype=torch.int64, device="cuda")
        ws = sampler_workspace(b, V, torch.device("cuda"))
        g = graph_of(lambda: [sample(logits[i], rows, tokens[i], ws) for i in range(nbuf)])
        us = time_fn(g.replay, iters, queue_ahead=True) / nbuf * 1e3
        print(f"ours B={b:<4} {us:8.1f} us  {b * V * 4 / us / 1e3:6.0f} GB/s", flush=True)
        del g, logits, tokens
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if "--time" in sys.argv:
        time_ours()
    else:
        one_call()
