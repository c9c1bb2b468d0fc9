"""Braided F&B blocks vs the same work as F then BW, one pipeline stage, TP=2 (paper Sec. 3, App. F).

Spawns two processes (NCCL on GPUs, gloo on CPU). Program, m micro-batches:
braided ``F0 F1&BW0 F2&BW1 ... BW(m-1)``; plain ``F0 F1 BW0 F2 BW1 ... BW(m-1)`` -- the
same units, without interleaving. Prints the step-time ratio and the all-reduce wait time
left exposed on the compute stream (from the measured trace) for both.

    python benchmarks/bench_braided_overlap.py                 # GPU: Qwen2-7B-sized layers, seq 4096, bf16
    python benchmarks/bench_braided_overlap.py --tiny          # CPU smoke test
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _spawn import spawn_two


def _programs(m: int) -> dict[str, str]:
    braided = ["F0c0"] + [f"F{i}c0&BW{i - 1}c0" for i in range(1, m)] + [f"BW{m - 1}c0"]
    plain = ["F0c0"] + [x for i in range(1, m) for x in (f"F{i}c0", f"BW{i - 1}c0")] + [f"BW{m - 1}c0"]
    return {"braided": "\n".join(braided), "plain": "\n".join(plain)}


def _worker(rank: int, args: argparse.Namespace, port: int, out) -> None:
    from braid.braiding import ChunkSpec
    from braid.ir import Plan, Program, ScheduleConfig
    from braid.models.chunk import build_chunk
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.runtime.distributed import Dist, ProcessGroups
    from braid.runtime.executor import Executor
    from braid.topology import Topology

    device = torch.device(f"cuda:{rank}" if torch.cuda.is_available() and not args.tiny else "cpu")
    d = Dist.init(rank, 2, master_port=port, device=device, timeout_s=300)
    groups = ProcessGroups.create(Topology(2, pp=1, tp=2), tp_max_ctas=None if args.tp_max_ctas == 0 else args.tp_max_ctas)
    if args.tiny:
        cfg = Qwen2Config(vocab_size=64, hidden=64, layers=args.layers, heads=4, kv_heads=2, ffn=128)
        dtype, seq = torch.float32, 16
    else:
        cfg = Qwen2Config(vocab_size=1024, hidden=3584, layers=args.layers, heads=28, kv_heads=4, ffn=18944)
        dtype, seq = torch.bfloat16, args.seq
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen2Model(cfg).to(dtype)
    spec = ChunkSpec(cfg.layers, embed=True, head=True)
    chunk = build_chunk(model, spec, 0, tp_rank=rank, tp_size=2, tp_group=groups.tp, num_microbatches=args.mbs).to(device)
    del model
    toks = [torch.randint(0, cfg.vocab_size, (1, seq), device=device) for _ in range(args.mbs)]
    results = {}
    progs = _programs(args.mbs)
    order = ["plain", "braided"] if args.plain_first else ["braided", "plain"]
    for name in order:
        text = progs[name]
        prog = Program.from_text(0, text)
        plan = Plan(name, ScheduleConfig(1, args.mbs), "loop", ((),))
        ex = Executor(plan, prog, {0: chunk}, pp_ranks=[rank], act_shape=(1, seq, cfg.hidden), dtype=dtype,
                      device=device, tp_group=groups.tp, abort=d.abort)
        times, exposed = [], []
        for it in range(args.warmup + args.iters):
            chunk.zero_grad(set_to_none=True)
            res = ex.run(toks, toks)
            if it >= args.warmup:
                times.append(res.trace.step_time)
                exposed.append(res.trace.meta["summary"]["exposed_ar_s"])
        results[name] = (statistics.median(times), statistics.median(exposed), res.counts)
        if args.profile and device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            chunk.zero_grad(set_to_none=True)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                ex.run(toks, toks)
                torch.cuda.synchronize(device)
            if rank == 0:
                table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
                print(f"== profile of one {name} step (rank 0) ==\n{table}", flush=True)
    if rank == 0:
        out.put(results)
    d.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 model on CPU (smoke test)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers in the stage (default 2)")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    ap.add_argument("--mbs", type=int, default=6, help="micro-batches (default 6)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--tp-max-ctas", type=int, default=4, help="NCCL CTA cap of the TP group (0: NCCL default; default 4)")
    ap.add_argument("--plain-first", action="store_true", help="measure the plain program first")
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler kernel table of one step of each (GPU)")
    args = ap.parse_args(argv)
    if not args.tiny and torch.cuda.device_count() < 2:
        ap.error("needs 2 GPUs (or --tiny for the CPU smoke test)")
    (res,) = spawn_two(_worker, args)
    (tb, eb, cb), (tp_, ep, _) = res["braided"], res["plain"]
    print(f"braided blocks per step: {cb['braided']}, all-reduces per step: {cb['AR']}")
    print(f"step time  plain {tp_ * 1e3:9.2f} ms   braided {tb * 1e3:9.2f} ms   ratio braided/plain {tb / tp_:.3f}")
    print(f"exposed AR plain {ep * 1e3:9.2f} ms   braided {eb * 1e3:9.2f} ms   "
          f"fraction of plain's exposed AR time hidden by braiding {1 - eb / ep if ep > 0 else float('nan'):.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
