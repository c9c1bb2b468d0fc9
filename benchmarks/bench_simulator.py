"""Simulator speed: every registered schedule at p=8, m=64 and p=32, m=256, unit-level events on.

Run: ``python benchmarks/bench_simulator.py`` (``--tiny``: p=2, m=4 only, a smoke run).
Prints per-schedule compile and simulate times and the number of trace events; the cost
model is the analytic one for a model with two layers per virtual stage (so every op has ~8
unit tasks) on H200 at TP=2. The totals are wall-clock and process CPU time (the CPU figure
is the steadier one on a shared machine).
Targets: p=8, m=64 under 1 s and p=32, m=256 under 10 s for all schedules together.
"""

from __future__ import annotations

import argparse
import sys
import time

from braid import schedules
from braid.core.compiler import compile_plan
from braid.cost.costs import Layout, analytic_costs
from braid.cost.hardware import get_hardware
from braid.cost.catalog import get_model
from braid.simulator import simulate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="p=2, m=4 only (a smoke run)")
    args = ap.parse_args(argv)
    hw = get_hardware("h200")
    for p, m in ((2, 4),) if args.tiny else ((8, 64), (32, 256)):
        model = get_model("qwen2-7b").with_(layers=4 * p + 2, name=f"qwen2-7b-{4 * p + 2}L")
        print(f"p={p} m={m} ({model.layers} layers, tp=2)")
        total = cpu = 0.0
        for name in schedules.names():
            try:
                plan = schedules.build(name, p, m)
                t0 = time.perf_counter()
                progs = compile_plan(plan)
                t1 = time.perf_counter()
            except ValueError as err:
                print(f"  {name:<18} skipped: {str(err)[:70]}")
                continue
            costs = analytic_costs(model, hw, Layout(2, p, plan.v, plan.placement))
            c2, t2 = time.process_time(), time.perf_counter()
            res = simulate(progs, costs, name=name)
            t3, c3 = time.perf_counter(), time.process_time()
            total += t3 - t2
            cpu += c3 - c2
            print(f"  {name:<18} compile {t1 - t0:7.3f} s  simulate {t3 - t2:7.3f} s  events {len(res.trace.events):>8}"
                  f"  step {res.report.step_time_s * 1e3:9.1f} ms")
            # Drop this schedule's programs and trace (~1M objects at p=32) before the next one, so
            # the garbage collector's full passes during the next run do not rescan them.
            del progs, res
        print(f"  all schedules simulated in {total:.3f} s (CPU {cpu:.3f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
