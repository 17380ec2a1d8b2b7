"""Scratch (not product): GPU kernel time per output token of one greedy request, speculation on/off."""
import argparse, json, sys, torch
from torch.profiler import ProfilerActivity, profile
from fastqwen import LLM, SamplingParams
from fastqwen.config import EngineConfig

p = argparse.ArgumentParser()
EngineConfig.add_cli_arguments(p, model="Qwen3-8B", load_format="dummy", max_model_len=4096)
p.add_argument("--tokens", type=int, default=128)
p.add_argument("--label", default="")
args = p.parse_args()
llm = LLM(EngineConfig.from_cli(args))
prompt = [[(7 * i + 1) % 1000 + 10 for i in range(128)]]
sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
for _ in range(2):
    llm.generate(prompt, sp, use_tqdm=False)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    llm.generate(prompt, sp, use_tqdm=False)
    torch.cuda.synchronize()
ev = [e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 0]
by = {}
for e in ev:
    t = by.setdefault(e.name, [0, 0.0]); t[0] += 1; t[1] += e.device_time
tot = sum(v[1] for v in by.values())
n = args.tokens
print(f"== {args.label}: busy {tot/n:.1f} us per output token, {len(ev)/n:.1f} kernels per token", file=sys.stderr)
for name, (c, us) in sorted(by.items(), key=lambda kv: -kv[1][1])[:22]:
    print(f"{us/n:9.1f} us/tok {c/n:7.2f} calls/tok {us/c:8.2f} us each  {name[:120]}", file=sys.stderr)
