"""Experiment: what the sampler graph adds to a batch-1 decode step (GPU time, queued ahead)."""
import statistics, sys, torch
sys.path.insert(0, "bench")
from fastqwen import LLM, SamplingParams
from fastqwen.config import EngineConfig
from fastqwen.engine.cuda_graph import DecodeGraphs
from common import time_fn
import argparse
p = argparse.ArgumentParser()
EngineConfig.add_cli_arguments(p, model="Qwen3-8B", load_format="dummy", max_model_len=8192)
args = p.parse_args()
args.cuda_graph_max_bs = 1
llm = LLM(EngineConfig.from_cli(args))
engine = llm.engine; runner, model = engine.runner, engine.runner.model
for plen in (128, 1024):
    prompt = [(7 * i + 3) % engine.config.vocab_size for i in range(plen)]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    saved = runner.staging.dev.clone()
    g = DecodeGraphs(model, runner.kv, runner.staging, 1, runner.sampler.graph_hook).capture()
    res = {}
    for rnd in range(3):
        for name, fn in (("both", lambda: g.replay(1)), ("forward", lambda: g.replay_forward(1)),
                         ("sample", lambda: g.sample_graphs[1].replay()),
                         ("both_x4", lambda: [g.replay(1) for _ in range(4)]),
                         ("forward_x4", lambda: [g.replay_forward(1) for _ in range(4)])):
            runner.staging.dev.copy_(saved)
            res.setdefault(name + "_q", []).append(time_fn(fn, 40, queue_ahead=True))
            runner.staging.dev.copy_(saved)
            res.setdefault(name + "_h", []).append(time_fn(fn, 40))
    print(plen, {k: round(statistics.median(v), 4) for k, v in res.items()}, flush=True)
    g.close()
