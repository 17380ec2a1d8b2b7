"""One paged decode attention call (B=64, 4096 cached tokens, Qwen3-8B heads, page 16) for a profiler to look at:
    ncu --section SpeedOfLight --section WarpStateStats -k regex:decode_kernel python3 bench/profile_decode.py"""

import torch

from fastqwen.ops import paged_attention_decode

B, L, H, HKV, D, PAGE = 64, 4096, 32, 8, 128, 16
pages = B * L // PAGE
k = torch.randn(pages, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
table = torch.randperm(pages, device="cuda").to(torch.int32).view(B, L // PAGE)
lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
out = torch.empty_like(q)
for _ in range(3):
    paged_attention_decode(q, k, v, table, lens, D**-0.5, out)
torch.cuda.synchronize()
