"""Summarize Nsight Compute's source page (`ncu -i R --page source --csv --print-source sass`): the columns, the
stall-sample totals, and the instructions with the most warp-stall samples with their stall columns.

    python bench/ncu_stalls.py prefill_stalls_sass.csv [--top 60]"""

from __future__ import annotations

import argparse
import csv
import sys


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=60)
    args = ap.parse_args()
    with open(args.csv, newline="") as f:
        rows = list(csv.reader(f))
    header_at = next((i for i, r in enumerate(rows) if any("Source" == c.strip() for c in r)), None)
    if header_at is None:
        print("no header with a Source column; first lines:")
        for r in rows[:5]:
            print(r)
        return 1
    header = [c.strip() for c in rows[header_at]]
    body = [r for r in rows[header_at + 1 :] if len(r) == len(header)]
    print("columns:", header)
    src = header.index("Source")
    addr = header.index("Address") if "Address" in header else None
    stall_cols = [i for i, c in enumerate(header) if "stall" in c.lower() or "Sampl" in c]
    main_col = next((i for i, c in enumerate(header) if c.startswith("Warp Stall Sampling (All")), None)
    if main_col is None and stall_cols:
        main_col = stall_cols[0]
    totals = {header[i]: sum(number(r[i]) or 0.0 for r in body) for i in stall_cols}
    print(f"{len(body)} instructions; totals:")
    for name, total in sorted(totals.items(), key=lambda kv: -kv[1]):
        if total:
            print(f"  {total:14.0f}  {name}")
    if main_col is None:
        return 0
    ranked = sorted(body, key=lambda r: -(number(r[main_col]) or 0.0))
    all_samples = totals[header[main_col]] or 1.0
    print(f"\ntop {args.top} by {header[main_col]}:")
    for r in ranked[: args.top]:
        parts = [
            f"{header[i]}={r[i]}"
            for i in stall_cols
            if i != main_col and (number(r[i]) or 0) > 0.05 * (number(r[main_col]) or 1)
        ]
        where = r[addr] if addr is not None else ""
        share = 100 * (number(r[main_col]) or 0) / all_samples
        print(f"{share:5.1f}% {where:>8} {r[src][:70]:<70} {' '.join(parts)[:400]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
