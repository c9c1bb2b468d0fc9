"""Compile + validate every registered schedule at p=8, m=64 and p=32, m=256; print the times.

    python benchmarks/bench_compile.py
    python benchmarks/bench_compile.py --tiny    # p=2, m=4 only: a smoke run

Target (issue 2): the p=32, m=256 case under 5 s per schedule on a 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import time

from braid import schedules
from braid.core.compiler import compile_plan


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="p=2, m=4 only (a smoke run)")
    args = ap.parse_args(argv)
    print(f"{'schedule':<18}{'p':>4}{'m':>5}{'instructions':>14}{'generate s':>12}{'compile+validate s':>20}")
    for p, m in ((2, 4),) if args.tiny else ((8, 64), (32, 256)):
        for name in schedules.names():
            t0 = time.perf_counter()
            try:
                plan = schedules.build(name, p, m)
            except ValueError as err:
                print(f"{name:<18}{p:>4}{m:>5}  skipped: {err}")
                continue
            t1 = time.perf_counter()
            programs = compile_plan(plan)
            t2 = time.perf_counter()
            n = sum(len(prog) for prog in programs)
            print(f"{name:<18}{p:>4}{m:>5}{n:>14}{t1 - t0:>12.3f}{t2 - t1:>20.3f}")


if __name__ == "__main__":
    main()
