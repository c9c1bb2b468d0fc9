"""The SM clock and power each bench run ran at: a ``braid.bench --json`` file lined up with an
``nvidia-smi`` log taken beside the job.

Every braid run in the JSON carries the epoch seconds of its measured steps per round
(``timed_wall_rounds``), the calibration probe its own (``meta.calibration.probe_runs.timed_wall``).
Log the clocks beside the job, then read both:

    nvidia-smi --query-gpu=index,timestamp,clocks.sm,power.draw --format=csv,nounits -lms 50 > smi.csv &
    python -m braid.bench ... --json run.json; kill %1
    python benchmarks/clocks_by_run.py run.json smi.csv

Prints per run its step time, its prediction's error and, per GPU, the mean SM clock (MHz) and
power (W) over its measured steps (each round), and the probe's the same way. nvidia-smi
writes local time: ``--smi-utc-offset-h`` gives the logging machine's offset from UTC.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gzip
import json
import statistics
import sys
from typing import Any


def _number(cell: str) -> float:
    """A logged figure, with or without its unit (``--format=csv`` writes "1530 MHz", ``csv,nounits`` "1530")."""
    return float(cell.strip().split()[0])


def read_smi(path: str, utc_offset_h: float) -> list[tuple[int, float, float, float]]:
    """(gpu index, epoch s, SM MHz, W) per logged line (plain or gzipped CSV, header skipped; units allowed)."""
    opener = gzip.open if path.endswith(".gz") else open
    tz = datetime.timezone(datetime.timedelta(hours=utc_offset_h))
    rows = []
    with opener(path, "rt") as f:
        for r in csv.reader(f):
            if len(r) < 4 or not r[0].strip().isdigit():
                continue
            when = datetime.datetime.strptime(r[1].strip(), "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=tz)
            rows.append((int(r[0]), when.timestamp(), _number(r[2]), _number(r[3])))
    return rows


def window(rows, start: float, end: float) -> list[tuple[int, int]]:
    """Per GPU seen in the log: (mean SM MHz, mean W) of its lines in [start, end]."""
    out = []
    for g in sorted({r[0] for r in rows}):
        got = [(c, p) for gg, t, c, p in rows if gg == g and start <= t <= end]
        out.append((round(statistics.mean(c for c, _ in got)), round(statistics.mean(p for _, p in got))) if got else (0, 0))
    return out


def fmt(per_gpu: list[tuple[int, int]]) -> str:
    return " ".join(f"{c:5d} MHz {p:4d} W" for c, p in per_gpu)


def report(summary: dict[str, Any], rows) -> list[str]:
    lines = ["run               m   step ms   err %   per GPU: mean SM clock, power over the measured steps (each round)"]
    probe = summary.get("profile", {}).get("meta", {}).get("calibration", {})
    wall = probe.get("probe_runs", {}).get("timed_wall")
    if wall:
        lines.append(f"{probe['probe']:<16}     {1e3 * probe['measured_step_s']:8.2f}       -   {fmt(window(rows, *wall))}")
    for r in summary["runs"]:
        walls = r.get("timed_wall_rounds") or []
        err = r.get("step_err")
        cells = " | ".join(fmt(window(rows, *w)) for w in walls if w)
        lines.append(f"{r['schedule']:<16} {r['m']:2d} {1e3 * r['step_s']:8.2f} {'' if err is None else f'{100 * err:+7.1f}'}   {cells}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench_json", help="a braid.bench --json file")
    ap.add_argument("smi_csv", help="nvidia-smi --query-gpu=index,timestamp,clocks.sm,power.draw --format=csv,nounits log (.gz too)")
    ap.add_argument("--smi-utc-offset-h", type=float, default=0.0, help="the logging machine's offset from UTC in hours (default 0)")
    args = ap.parse_args(argv)
    try:
        with open(args.bench_json) as f:
            summary = json.load(f)
        rows = read_smi(args.smi_csv, args.smi_utc_offset_h)
    except (OSError, ValueError) as err:
        print(f"clocks_by_run: {err}", file=sys.stderr)
        return 2
    if "runs" not in summary:
        print(f"clocks_by_run: {args.bench_json}: not a braid.bench --json file (no 'runs')", file=sys.stderr)
        return 2
    if not any(r.get("timed_wall_rounds") for r in summary["runs"]):
        print(f"clocks_by_run: {args.bench_json}: its runs carry no timed_wall_rounds (a bench from before they were kept)",
              file=sys.stderr)
        return 2
    if not rows:
        print(f"clocks_by_run: {args.smi_csv}: no nvidia-smi lines (index, timestamp, clocks.sm, power.draw)", file=sys.stderr)
        return 2
    print("\n".join(report(summary, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
