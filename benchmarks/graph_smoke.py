"""Smoke run of whole-step CUDA graphs on two GPUs: each case, step by step, replay == eager?

No torchrun: spawns two ranks (NCCL) itself and runs the cases of ``tests/graph_cases.py``
one after another, simplest first (P2P only; the V schedules; offload; TP all-reduces;
compiled units), printing for every case what each step was (eager warm-up, capture with
what it captured, replay), the graph's memory and whether the graphed loss, gradients and
parameters equal the eager run's bitwise. A failing case prints every rank's traceback and
the run goes on with the next case (unless the ranks died)::

    PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python benchmarks/graph_smoke.py
    PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python benchmarks/graph_smoke.py --case p2p tp2
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch  # noqa: E402

import graph_cases  # noqa: E402
from distributed_utils import DistPool  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="graph_smoke.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", nargs="+", default=list(graph_cases.SMOKE_CASES), choices=list(graph_cases.SMOKE_CASES),
                    help="cases to run (default: all, in order)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per case before the ranks are dumped and stopped")
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print(f"graph_smoke.py: needs 2 CUDA devices, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
          f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}", flush=True)
    failed = []
    pool = DistPool(2, timeout_s=120, device="cuda")
    try:
        for case in args.case:
            print(f"== {case}: {graph_cases.SMOKE_CASES[case][0]}", flush=True)
            t0 = time.perf_counter()
            try:
                lines = pool.run(graph_cases.smoke, case, timeout_s=args.timeout)
            except AssertionError as err:
                failed.append(case)
                print(f"FAIL {case} ({time.perf_counter() - t0:.1f} s):\n{err}", flush=True)
                if any(not p.is_alive() for p in pool.procs):
                    print("ranks are gone: stopping here", flush=True)
                    break
                continue
            for rank_lines in lines:
                print("\n".join(rank_lines), flush=True)
            print(f"OK {case} ({time.perf_counter() - t0:.1f} s)", flush=True)
    finally:
        pool.close()
    print(f"{len(args.case) - len(failed)} of {len(args.case)} cases passed" + (f"; failed: {'; '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
