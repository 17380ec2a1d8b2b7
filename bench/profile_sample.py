"""One sampler call at B=256, V=151,936, top_k=20, top_p=0.95, for a profiler (ncu --kernel-name regex:scan)."""

import torch

from fastqwen.ops.sampling import pack_sampler_rows, sample_on_gpu, sampler_workspace

B, V = 256, 151_936
logits = torch.randn(B, V, device="cuda") * 3
rows = pack_sampler_rows([0.7] * B, 20, 0.95, seed=list(range(B)), step=1).cuda()
tokens = torch.empty(B, dtype=torch.int64, device="cuda")
ws = sampler_workspace(B, V, torch.device("cuda"))
for _ in range(3):
    sample_on_gpu(logits, rows, tokens, ws)
torch.cuda.synchronize()
