"""Activation bytes a chunk holds per micro-batch on the GPU: braided_v against zb_v (issue #51).

The paper reports braided blocks holding 20% more than ZB-V from its unit implementation. This
runs both schedules on two GPUs with the same chunks and data and counts, per (chunk, micro-batch),
the bytes of every tensor storage made by that micro-batch's tasks and still alive after its
forward (``F``), after an activation backward whose W comes later (``B``) and after its last weight
gradient (``W``) (:func:`braid.measure.held_bytes.held_per_microbatch`; the units run uncompiled, so
every storage is seen by the ledger). Prints each point's MiB for both and where braided_v holds more::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=. python benchmarks/bench_held_bytes.py \\
        --tp 2 --pp 1 --seq 4096 --mbs 4 --json held_tp2.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _spawn import spawn_two  # noqa: E402

SCHEDULES = ("braided_v", "zb_v")


def _worker(rank: int, args: argparse.Namespace, port: int, out) -> None:
    import torch

    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.core.topology import Topology
    from braid.measure.config import DTYPES, PRESETS, ProfileConfig, build_chunks
    from braid.measure.held_bytes import held_per_microbatch
    from braid.runtime.distributed import Dist, ProcessGroups
    from braid.runtime.executor import Executor

    device = "cuda" if torch.cuda.is_available() else "cpu"
    d = Dist.init(rank, 2, master_port=port, device=f"cuda:{rank}" if device == "cuda" else "cpu", timeout_s=300)
    failed: BaseException | None = None
    try:
        dev = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
        groups = ProcessGroups.create(Topology(2, pp=args.pp, tp=args.tp), timeout_s=300, seq_shard=args.sequence_parallel)
        dtype = "bfloat16" if device == "cuda" else "float32"
        got = {}
        for name in SCHEDULES:
            plan = schedules.build(name, args.pp, args.mbs)
            pc = ProfileConfig(PRESETS[args.preset], (args.layers,) * (args.pp * plan.v), seq=args.seq, tp=args.tp,
                               pp=args.pp, v=plan.v, placement=plan.placement, dtype=dtype, device=device,
                               compile=False, seq_shard=args.sequence_parallel)
            chunks = build_chunks(pc, groups, dev, m=args.mbs, plan=plan)
            program = compile_plan(plan)[groups.coords.pp]
            ex = Executor.from_groups(plan, program, chunks, groups, d.abort, act_shape=pc.act_shape(),
                                      dtype=DTYPES[dtype], device=dev, compile=False)
            toks, labs = pc.micro_batches(args.mbs, dev)
            got[name] = {f"{c},{mb},{p}": n for (c, mb, p), n in held_per_microbatch(ex, toks, labs).held.items()}
            del ex, chunks
            if device == "cuda":
                torch.cuda.empty_cache()
        out.put((rank, got))
    except BaseException as err:  # noqa: BLE001 - reported, then the rank ends
        failed = err
        import traceback

        out.put((rank, {"error": traceback.format_exc()}))
    finally:
        d.close(failed)


def compare(by_rank: dict[int, dict]) -> tuple[list[str], int]:
    """The table's lines and the number of points where braided_v holds more than zb_v."""
    lines, over = [], 0
    for rank in sorted(by_rank):
        b, z = by_rank[rank]["braided_v"], by_rank[rank]["zb_v"]
        lines.append(f"rank {rank}: chunk,mb,point  braided_v MiB  zb_v MiB  ratio")
        for key in sorted(set(b) & set(z), key=lambda k: (k.split(",")[2], int(k.split(",")[0]), int(k.split(",")[1]))):
            ratio = f"{b[key] / z[key]:.3f}" if z[key] else "-"
            over += b[key] > z[key]
            lines.append(f"  {key:14s} {b[key] / 2**20:13.1f} {z[key] / 2**20:9.1f}  {ratio}" + ("  more" if b[key] > z[key] else ""))
    return lines, over


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="7b-layer", choices=("tiny", "small", "7b-layer"))
    ap.add_argument("--tp", type=int, default=2, choices=(1, 2))
    ap.add_argument("--pp", type=int, default=1, choices=(1, 2))
    ap.add_argument("--layers", type=int, default=1, help="decoder layers per virtual stage (default 1)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.tp * args.pp != 2:
        ap.error(f"--tp {args.tp} x --pp {args.pp}: this runs on two processes (tp x pp must be 2)")
    if args.sequence_parallel and args.tp == 1:
        ap.error("--sequence-parallel shards inside TP: it needs --tp 2")
    by_rank = dict(spawn_two(_worker, args, results=2, timeout_s=900))
    errors = [f"rank {r}:\n{g['error']}" for r, g in sorted(by_rank.items()) if "error" in g]
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 1
    lines, over = compare(by_rank)
    print(f"# {args.preset}, tp={args.tp} pp={args.pp}, {args.layers} layer(s) per virtual stage, seq {args.seq}, m={args.mbs}"
          + (", sequence-parallel" if args.sequence_parallel else ""))
    print("\n".join(lines))
    print(f"points where braided_v holds more than zb_v: {over}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k != "json"}, "held_bytes": {str(r): g for r, g in by_rank.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
