"""The rows of bench/ab_builds.sh's runs side by side: for each op, cache type and case of bench/kernels.py's JSON
files OUT/new_N.json and OUT/base_N.json (or, from bench/profile_step.py's, the decode step's engine time and graph
replay), the median over the rounds of the time with each build, and their ratio.

    python bench/ab_summary.py OUT [--json summary.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def rows_by_key(path: Path) -> dict[tuple[str, str, str], float]:
    """(op, kv_dtype, case) -> our time in us, from one bench/kernels.py JSON file; from a bench/profile_step.py one,
    the decode step's engine step and graph replay (case: batch x prompt tokens)."""
    data = json.loads(path.read_text())
    out = {}
    if "step_ms" in data and "gpu_ms" in data:  # bench/profile_step.py
        case = f"{data.get('batch')}x{data.get('prompt_tokens')}"
        out[("decode step (engine)", "", case)] = data["step_ms"] * 1e3
        out[("decode step (graph replay)", "", case)] = data["gpu_ms"] * 1e3
        return out
    for section in ("decode", "prefill"):
        for row in data.get(section, []):
            case = row.get("case") or f"{row['batch']}x{row['new_tokens']}+{row['prefix']}"  # (prefill rows)
            out[(row["op"], row.get("kv_dtype", ""), str(case))] = row["ours_us"]
    return out


def summarize(folder: Path) -> list[dict]:
    """One row per (op, kv_dtype, case) found in every run of both builds."""
    runs: dict[str, list[dict]] = {"new": [], "base": []}
    for which in runs:
        for path in sorted(folder.glob(f"{which}_*.json")):
            runs[which].append(rows_by_key(path))
    if not runs["new"] or not runs["base"]:
        raise SystemExit(f"ab_summary: no new_N.json or base_N.json in {folder}")
    keys = set.intersection(*(set(r) for r in runs["new"] + runs["base"]))
    table = []
    for key in sorted(keys):
        new = statistics.median(r[key] for r in runs["new"])
        base = statistics.median(r[key] for r in runs["base"])
        table.append(
            {
                "op": key[0],
                "kv_dtype": key[1],
                "case": key[2],
                "new_us": new,
                "base_us": base,
                "new_over_base": new / base,
            }
        )
    return table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    table = summarize(Path(args.folder))
    for row in table:
        print(
            f"{row['op']:24s} {row['kv_dtype']:5s} {row['case']:14s} new {row['new_us']:9.2f} us  "
            f"base {row['base_us']:9.2f} us  new/base {row['new_over_base']:.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
