"""Structured output's cost: output throughput of a JSON-schema request mix against the same requests unconstrained,
in one run, on one engine, through LLM.generate (random weights, the real Qwen3 tokenizer).

Both runs keep --in-flight requests running (max_num_seqs) over --num-prompts requests of --input-len random prompt
tokens. The unconstrained run generates --output-len tokens per request (ignore_eos); the constrained run gives each
request one of four JSON schemas that need more than --output-len tokens, so it too decodes --output-len tokens
(finish "length"), and the tokens it generated are counted. A constrained output that finished with "stop" is
checked to parse as JSON. Throughput = output tokens / wall time of the generate call.

    python bench/make_dummy_checkpoint.py --preset Qwen3-8B --out /tmp/qwen3-8b-dummy
    python bench/structured.py --model /tmp/qwen3-8b-dummy --load-format dummy --in-flight 64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch
from fastqwen import LLM, SamplingParams
from fastqwen.config import EngineConfig
from fastqwen.sampling_params import StructuredOutput


def plain_schemas(output_len: int) -> list[dict]:
    """The same four shapes with free strings (no exact lengths): llguidance's fast path for JSON string bodies
    (bench/results/current/structured-output.md)."""
    n = output_len
    return [
        {"type": "array", "items": {"type": "integer"}, "minItems": n},
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "body": {
                    "type": "object",
                    "properties": {"lang": {"enum": ["en", "fr", "de"]}, "text": {"type": "string"}},
                    "required": ["lang", "text"],
                },
            },
            "required": ["title", "body"],
        },
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"k": {"enum": ["alpha", "beta"]}, "v": {"type": "string"}},
                "required": ["k", "v"],
            },
            "minItems": n,
        },
        {
            "type": "object",
            "properties": {"notes": {"type": "array", "items": {"type": "string"}, "minItems": n}},
            "required": ["notes"],
        },
    ]


def schemas(output_len: int) -> list[dict]:
    """Four shapes, each with more required content than output_len tokens, so every request decodes its full
    output_len under its grammar (steady-state decode with masks, what the bar is about): integer arrays, long
    strings in nested objects, arrays of objects with enums, arrays of short strings."""
    n = output_len
    return [
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": n, "maxItems": n},
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "minLength": 4, "maxLength": 16},
                "body": {
                    "type": "object",
                    "properties": {
                        "lang": {"enum": ["en", "fr", "de"]},
                        "text": {"type": "string", "minLength": 8 * n, "maxLength": 8 * n},
                    },
                    "required": ["lang", "text"],
                    "additionalProperties": False,
                },
            },
            "required": ["title", "body"],
            "additionalProperties": False,
        },
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "k": {"enum": ["alpha", "beta", "gamma"]},
                    "v": {"type": "string", "minLength": 2, "maxLength": 12},
                },
                "required": ["k", "v"],
                "additionalProperties": False,
            },
            "minItems": n,
            "maxItems": n,
        },
        {
            "type": "object",
            "properties": {
                "notes": {
                    "type": "array",
                    "items": {"type": "string", "minLength": 3, "maxLength": 20},
                    "minItems": n,
                    "maxItems": n,
                },
                "ok": {"type": "boolean"},
            },
            "required": ["notes", "ok"],
            "additionalProperties": False,
        },
    ]


class MaskClock:
    """Host time the samplers spend taking the step's grammar masks (engine.sampler.copy_masks, timed in place: the
    masks are computed ahead, so this is the wait for any not yet done plus the copy)."""

    def __init__(self):
        import fastqwen.engine.sampler as sampler_module

        self.seconds, self.calls, self.rows = 0.0, 0, 0
        fill = sampler_module.copy_masks

        def timed(rows, out):
            start = time.perf_counter()
            fill(rows, out)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            self.rows += len(rows)

        sampler_module.copy_masks = timed

    def take(self) -> dict:
        taken = {
            "mask_seconds": self.seconds,
            "mask_calls": self.calls,
            "mask_ms_per_call": 1e3 * self.seconds / max(1, self.calls),
            "mask_rows_per_call": self.rows / max(1, self.calls),
        }
        self.seconds, self.calls, self.rows = 0.0, 0, 0
        return taken


def run(llm: LLM, prompts, params) -> tuple[float, list]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start, outs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineConfig.add_cli_arguments(p, load_format="dummy", max_model_len=4096)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--in-flight", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument(
        "--mix",
        choices=["exact", "plain"],
        default="exact",
        help="exact: strings and arrays of exact lengths (measured); plain: free strings",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.max_num_seqs = args.in_flight
    llm = LLM(EngineConfig.from_cli(args))
    vocab = llm.engine.config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    mix = schemas if args.mix == "exact" else plain_schemas
    specs = [StructuredOutput("json_schema", json.dumps(s)) for s in mix(args.output_len)]
    plain = [
        SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True, seed=i)
        for i in range(args.num_prompts)
    ]
    constrained = [
        SamplingParams(temperature=1.0, max_tokens=args.output_len, seed=i, structured=specs[i % len(specs)])
        for i in range(args.num_prompts)
    ]
    # Warm-up: graphs, the grammar compiles (cached from here on), the allocator.
    run(llm, prompts[: args.in_flight], [SamplingParams(max_tokens=8, ignore_eos=True)] * args.in_flight)
    run(llm, prompts[: len(specs)], [SamplingParams(max_tokens=8, structured=s) for s in specs])
    clock = MaskClock()
    results = {}
    for name, params in (("unconstrained", plain), ("json_schema", constrained), ("unconstrained_again", plain)):
        ahead0 = llm.engine.num_ahead_steps
        clock.take()
        seconds, outs = run(llm, prompts, params)
        tokens = sum(len(o.token_ids) for o in outs)
        entry = {
            "seconds": seconds,
            "output_tokens": tokens,
            "tokens_per_s": tokens / seconds,
            "ahead_steps": llm.engine.num_ahead_steps - ahead0,
            **clock.take(),
        }
        if name == "json_schema":
            finished = [o for o in outs if o.finish_reason == "stop"]
            bad = 0
            for o in finished:
                try:
                    json.loads(o.text)
                except ValueError:
                    bad += 1
            entry.update(
                stopped=len(finished), length=len(outs) - len(finished), invalid_json=bad, sample=outs[0].text[:300]
            )
        results[name] = entry
        print(name, json.dumps(entry, ensure_ascii=False), flush=True)
    base = (results["unconstrained"]["tokens_per_s"] + results["unconstrained_again"]["tokens_per_s"]) / 2
    cost = 1.0 - results["json_schema"]["tokens_per_s"] / base
    summary = {
        "device": torch.cuda.get_device_name(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "model": args.model,
        "vocab": vocab,
        "in_flight": args.in_flight,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "runs": results,
        "structured_cost": cost,
    }
    print(f"structured output costs {100 * cost:.1f}% of the unconstrained output throughput ({base:.0f} tok/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2, ensure_ascii=False)
    return 1 if results["json_schema"].get("invalid_json") else 0


if __name__ == "__main__":
    sys.exit(main())
