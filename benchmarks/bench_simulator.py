"""Simulator speed: every registered schedule at p=8, m=64 and p=32, m=256, unit-level events on.

Run: ``python benchmarks/bench_simulator.py``. Prints per-schedule compile and simulate
times and the number of trace events; the cost model is the analytic one for a model with
two layers per virtual stage (so every op has ~8 unit tasks) on H200 at TP=2.
"""

from __future__ import annotations

import sys
import time

import schedules
from braid.compiler import compile_plan
from braid.costs import Layout, analytic_costs
from braid.hardware import get_hardware
from braid.models_catalog import get_model
from simulator import simulate


def main() -> int:
    hw = get_hardware("h200")
    for p, m in ((8, 64), (32, 256)):
        model = get_model("qwen2-7b").with_(layers=4 * p + 2, name=f"qwen2-7b-{4 * p + 2}L")
        print(f"p={p} m={m} ({model.layers} layers, tp=2)")
        total = 0.0
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
            t2 = time.perf_counter()
            res = simulate(progs, costs, name=name)
            t3 = time.perf_counter()
            total += t3 - t2
            print(f"  {name:<18} compile {t1 - t0:7.3f} s  simulate {t3 - t2:7.3f} s  events {len(res.trace.events):>8}"
                  f"  step {res.report.step_time_s * 1e3:9.1f} ms")
        print(f"  all schedules simulated in {total:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
