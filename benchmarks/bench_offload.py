"""Activation offload on a real pipeline: peak memory and step time vs alpha (paper Sec. 4.4).

Spawns two processes (pp=2, tp=1; NCCL on GPUs, gloo on CPU) and runs, side by side in
one run: ``braided_v``, ``braided_v_offload`` at alpha 0.25 / 0.5 / 1.0 (warm-up fraction
= alpha), and ``1f1b_i``. Per schedule and rank it prints the activation peak measured
(``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was
allocated before the step: weights, gradients, optimizer-free), the step time, the
throughput ratio vs ``braided_v``, the bytes offloaded per step, and the simulator's
predicted activation peak for the same program and model shape (analytic costs, H200
preset) with the relative error predicted vs measured.

    python benchmarks/bench_offload.py            # 2 GPUs: hidden 3584, 8 layers / 4 stages, seq 4096, m=8, bf16
    python benchmarks/bench_offload.py --tiny     # CPU smoke test (peaks are live saved bytes there)
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _spawn import spawn_two

RUNS: list[tuple[str, str, dict]] = [
    ("braided_v", "braided_v", {}),
    *[(f"offload a={a:g}", "braided_v_offload", {"offload_alpha": a, "offload_alpha_warmup": a}) for a in (0.25, 0.5, 1.0)],
    ("1f1b_i", "1f1b_i", {}),
]


def _model_config(args: argparse.Namespace):
    from braid.models_catalog import ModelConfig

    if args.tiny:
        return ModelConfig("tiny-offload", layers=8, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq=32, dtype_bytes=4)
    return ModelConfig("qwen2-7b-shaped", layers=args.layers, hidden=3584, heads=28, kv_heads=4, ffn=18944,
                       vocab=args.vocab, seq=args.seq, dtype_bytes=2)


def _plan(name: str, opts: dict, m: int):
    import schedules

    return schedules.build(name, 2, m, **opts)


def _stage_layers(mc, plan) -> tuple[int, ...]:
    from braid.costs import Layout, model_stage_layers

    return model_stage_layers(mc, Layout(1, plan.p, plan.v, plan.placement))


def _worker(rank: int, args: argparse.Namespace, port: int, out) -> None:
    from braid.compiler import compile_plan
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.runtime.distributed import Dist, ProcessGroups
    from braid.runtime.executor import Executor, build_rank_chunks
    from braid.topology import Topology

    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    d = Dist.init(rank, 2, master_port=port, device=device, timeout_s=600)
    groups = ProcessGroups.create(Topology(2, pp=2))
    mc = _model_config(args)
    dtype = torch.bfloat16 if mc.dtype_bytes == 2 else torch.float32
    cfg = Qwen2Config(vocab_size=mc.vocab, hidden=mc.hidden, layers=mc.layers, heads=mc.heads, kv_heads=mc.kv_heads, ffn=mc.ffn)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2Model(cfg).to(dtype)
    g = torch.Generator().manual_seed(1)
    toks = [torch.randint(0, mc.vocab, (1, mc.seq), generator=g).to(device) for _ in range(args.mbs)]
    results = {}
    for label, name, opts in RUNS:
        plan = _plan(name, opts, args.mbs)
        chunks = build_rank_chunks(model, plan, rank, _stage_layers(mc, plan))
        chunks = {c: ch.to(device) for c, ch in chunks.items()}
        ex = Executor.from_groups(plan, compile_plan(plan)[rank], chunks, groups, d.abort, act_shape=(1, mc.seq, mc.hidden),
                                  dtype=dtype, device=device)
        times, peak = [], 0
        for it in range(args.warmup + args.iters):
            for ch in chunks.values():
                ch.zero_grad(set_to_none=False)  # gradients stay allocated: the baseline includes them
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            res = ex.run(toks, toks)
            if cuda:
                torch.cuda.synchronize(device)
                step_peak = torch.cuda.max_memory_allocated(device) - base
            else:
                step_peak = max((b for _, b in res.trace.memory.get(rank, [])), default=0)
            if it >= args.warmup:
                times.append(res.trace.step_time)
                peak = max(peak, step_peak)
        results[label] = {"step_s": statistics.median(times), "peak": peak, "offloaded": res.counts.get("OFFLOAD_bytes", 0),
                          "host_pool_bytes": ex.offloader.pool.allocated_bytes}
        del ex, chunks
        if cuda:
            torch.cuda.empty_cache()
    out.put((rank, results))
    d.close()


def _predicted(args: argparse.Namespace) -> dict[str, list[int]]:
    from braid.compiler import compile_plan
    from braid.costs import Layout, analytic_costs
    from braid.hardware import get_hardware
    from simulator import simulate

    mc, hw = _model_config(args), get_hardware("h200")
    out = {}
    for label, name, opts in RUNS:
        plan = _plan(name, opts, args.mbs)
        costs = analytic_costs(mc, hw, Layout(1, plan.p, plan.v, plan.placement))
        rep = simulate(compile_plan(plan), costs, name=label, record=False).report
        out[label] = [r.peak_activation_bytes for r in rep.ranks]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 model on CPU with gloo (smoke test)")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers over the 4 virtual stages (default 8)")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    ap.add_argument("--vocab", type=int, default=32768, help="vocabulary size (default 32768)")
    ap.add_argument("--mbs", type=int, default=8, help="micro-batches per step (default 8)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args(argv)
    if not args.tiny and torch.cuda.device_count() < 2:
        ap.error("needs 2 GPUs (or --tiny for the CPU smoke test)")
    if args.mbs < 4:
        ap.error("--mbs must be at least 4 (braided_v needs m >= 2p)")
    got = dict(spawn_two(_worker, args, results=2))
    pred = _predicted(args)
    base = {r: got[r]["braided_v"]["step_s"] for r in got}
    unit = "GiB" if not args.tiny else "KiB"
    div = 2**30 if not args.tiny else 2**10
    print(f"pp=2 tp=1 m={args.mbs} seq={_model_config(args).seq} hidden={_model_config(args).hidden} "
          f"({'measured on CPU: live saved bytes' if args.tiny else 'max_memory_allocated - allocated before the step'})")
    print(f"{'schedule':<16}{'rank':>5}{'step ms':>10}{'thr vs bv':>10}{'peak ' + unit:>11}{'pred ' + unit:>11}"
          f"{'pred err':>10}{'offl ' + unit:>11}{'pool ' + unit:>11}")
    for label, _, _ in RUNS:
        for r in sorted(got):
            x = got[r][label]
            pk, pr = x["peak"], pred[label][r]
            err = (pr - pk) / pk if pk else float("nan")
            print(f"{label:<16}{r:>5}{x['step_s'] * 1e3:>10.2f}{base[r] / x['step_s']:>10.3f}{pk / div:>11.2f}"
                  f"{pr / div:>11.2f}{err:>+10.1%}{x['offloaded'] / div:>11.2f}{x['host_pool_bytes'] / div:>11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
