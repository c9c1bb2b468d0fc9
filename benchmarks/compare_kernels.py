"""Where two schedules' compute differs: the kernels of a ``braid.bench --compute-busy`` JSON side by side.

For one m and one rank, each kernel kept in the runs' profiled steps (the most time first, per
run) with its time and calls under every schedule (and baseline row) asked for:

    python benchmarks/compare_kernels.py bench.json --m 8 --rank 1 --schedule braided_v zb_v
"""

from __future__ import annotations

import argparse
import json
import sys


def table(doc: dict, m: int, rank: int, names: list[str] | None, rows: int) -> list[str]:
    """The side-by-side lines; ``names`` None: every run and baseline row at ``m`` that was profiled."""
    got = {r["schedule"]: r["compute_kernels"] for r in doc.get("runs", []) + doc.get("external", [])
           if r.get("m") == m and r.get("compute_kernels")}
    if not got:
        raise ValueError(f"no run at m={m} was profiled (braid.bench --compute-busy)")
    names = names or list(got)
    missing = [n for n in names if n not in got]
    if missing:
        raise ValueError(f"{missing[0]!r} has no profiled kernels at m={m}; profiled: {', '.join(got)}")
    if not 0 <= rank < len(got[names[0]]):
        raise ValueError(f"rank {rank} outside 0..{len(got[names[0]]) - 1}")
    per = {n: {k: (t, c) for k, t, c in got[n][rank]} for n in names}
    kernels = sorted(set().union(*per.values()), key=lambda k: -max(per[n].get(k, (0.0, 0))[0] for n in names))
    w = max(14, *(len(n) + 2 for n in names))
    lines = ["".join(f"{n:>{w}}" for n in names) + "  kernel (ms, calls; at m=" + f"{m}, rank {rank})"]
    for k in kernels[:rows]:
        cells = [per[n].get(k) for n in names]
        lines.append("".join(f"{f'{c[0] * 1e3:.2f} x{c[1]}' if c else '-':>{w}}" for c in cells) + f"  {k[:100]}")
    totals = [sum(t for t, _ in per[n].values()) for n in names]
    lines.append("".join(f"{t * 1e3:>{w}.2f}" for t in totals) + "  sum of the kernels listed per run")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_json", help="a braid.bench --json file written with --compute-busy")
    ap.add_argument("--m", type=int, required=True, help="micro-batches of the runs to compare")
    ap.add_argument("--rank", type=int, default=0, help="global rank (default 0)")
    ap.add_argument("--schedule", nargs="+", help="runs or baseline rows to compare (default: every profiled one)")
    ap.add_argument("--rows", type=int, default=25, help="kernels shown (default 25)")
    args = ap.parse_args(argv)
    try:
        with open(args.bench_json) as f:
            doc = json.load(f)
        print("\n".join(table(doc, args.m, args.rank, args.schedule, args.rows)))
    except (OSError, ValueError) as err:
        print(f"{ap.prog}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
