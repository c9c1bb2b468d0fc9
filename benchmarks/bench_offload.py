"""Activation offload on a real pipeline: peak memory and step time vs alpha (paper Sec. 4.4).

Spawns two processes (pp=2, tp=1; NCCL on GPUs, gloo on CPU) and runs, side by side in
one run: ``braided_v``, ``braided_v_offload`` at alpha 0.25 / 0.5 / 1.0 (warm-up fraction
= alpha) and with the ``auto`` policy (:func:`braid.planner.offload_tune.tune_offload` on the prediction's
cost model), and ``1f1b_i``. Per schedule and rank it prints the step time (and the
predicted one), the throughput ratio vs ``braided_v``, the bytes offloaded per step,
``max_memory_allocated``, and two peaks:

* ``act``: the *activation* peak, what the simulator models -- the chunks' live saved
  bytes (``ModelChunk.live_bytes``: saved-tensor boxes plus weight-gradient stashes, each
  storage once) plus the offloaded storages whose copy has not released them yet,
  sampled after every instruction, on CPU and CUDA alike;
* ``alloc`` (CUDA only): ``max_memory_allocated`` during the step minus what was
  allocated at its start (weights and gradients, which stay allocated): adds what the
  simulator does not model -- temporaries, logits, P2P buffers, D2H copies in flight.

next to the simulator's predicted activation peak for the same program (analytic costs,
H200 preset, ``activations="runtime"``: the bytes this runtime's units save) and its
relative error vs ``act``. On CPU the copies run synchronously, freeing memory when
issued, so ``--tiny`` predicts with instant copies.

    python benchmarks/bench_offload.py            # 2 GPUs: hidden 3584, 8 layers / 4 stages, seq 4096, m=8, bf16
    python benchmarks/bench_offload.py --shape 72b  # the same with Qwen2-72B-shaped layers (hidden 8192)
    python benchmarks/bench_offload.py --tiny     # CPU smoke test (peaks are live saved bytes there)
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _spawn import spawn_two


def _sampling_executor():
    """The executor, also sampling the chunks' live saved bytes after every instruction."""
    from braid.runtime.executor import Executor

    class Sampling(Executor):
        act_peak = 0

        def _sample_memory(self) -> None:
            super()._sample_memory()
            live = sum(c.live_bytes() for c in self.chunks.values()) + self.offloader.pending_bytes()
            self.act_peak = max(self.act_peak, live)

    return Sampling

FIXED: list[tuple[str, str, dict]] = [
    ("braided_v", "braided_v", {}),
    *[(f"offload a={a:g}", "braided_v_offload", {"offload_alpha": a, "offload_alpha_warmup": a}) for a in (0.25, 0.5, 1.0)],
    ("1f1b_i", "1f1b_i", {}),
]


# Decoder-layer shapes (hidden, heads, KV heads, FFN) of Qwen2-7B and Qwen2-72B. What offload can
# hide scales with compute per saved byte, which grows with the hidden size: a 72B-shaped
# layer computes about twice as long per activation byte as a 7B-shaped one.
SHAPES: dict[str, tuple[int, int, int, int]] = {"7b": (3584, 28, 4, 18944), "72b": (8192, 64, 8, 29568)}


def _runs(args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    """The fixed runs plus ``offload auto``: the policy :func:`braid.planner.offload_tune.tune_offload` picks
    on the prediction's cost model."""
    from braid.planner.offload_tune import tune_offload

    plan = _plan("braided_v_offload", {}, args.mbs)
    choice = tune_offload(plan, _costs(args, plan), max_slowdown=args.budget)
    return FIXED[:4] + [("offload auto", "braided_v_offload", choice.options())] + FIXED[4:]


def _costs(args: argparse.Namespace, plan):
    import dataclasses

    from braid.cost.costs import Layout, analytic_costs
    from braid.cost.hardware import get_hardware

    costs = analytic_costs(_model_config(args), get_hardware("h200"), Layout(1, plan.p, plan.v, plan.placement),
                           activations="runtime")
    if getattr(args, "link", None):  # measured on this machine (see measure)
        costs = dataclasses.replace(costs, pcie_bytes_per_s=args.link[0], copy_duplex_slowdown=args.link[1])
    if args.tiny:  # CPU copies are synchronous: memory is freed when the offload is issued
        costs = dataclasses.replace(costs, pcie_bytes_per_s=float("inf"))
    return costs


def _model_config(args: argparse.Namespace):
    from braid.cost.catalog import ModelConfig

    if args.tiny:
        return ModelConfig("tiny-offload", layers=8, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq=32, dtype_bytes=4)
    hidden, heads, kv_heads, ffn = SHAPES[args.shape]
    return ModelConfig(f"qwen2-{args.shape}-shaped", layers=args.layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                       ffn=ffn, vocab=args.vocab, seq=args.seq, dtype_bytes=2)


def _plan(name: str, opts: dict, m: int):
    from braid import schedules

    return schedules.build(name, 2, m, **opts)


def _stage_layers(mc, plan) -> tuple[int, ...]:
    from braid.cost.costs import Layout, model_stage_layers

    return model_stage_layers(mc, Layout(1, plan.p, plan.v, plan.placement))


def _worker(rank: int, args: argparse.Namespace, port: int, out) -> None:
    from braid.core.compiler import compile_plan
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.runtime.distributed import Dist, ProcessGroups
    from braid.models.build import build_rank_chunks
    from braid.core.topology import Topology

    Executor = _sampling_executor()
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    d = Dist.init(rank, 2, master_port=port, device=device, timeout_s=600)
    groups = ProcessGroups.create(Topology(2, pp=2))
    mc = _model_config(args)
    dtype = torch.bfloat16 if mc.dtype_bytes == 2 else torch.float32
    cfg = Qwen2Config(vocab_size=mc.vocab, hidden=mc.hidden, layers=mc.layers, heads=mc.heads, kv_heads=mc.kv_heads, ffn=mc.ffn)
    g = torch.Generator().manual_seed(1)
    toks = [torch.randint(0, mc.vocab, (1, mc.seq), generator=g).to(device) for _ in range(args.mbs)]
    results = {}
    for label, name, opts in args.runs:
        plan = _plan(name, opts, args.mbs)
        torch.manual_seed(0)  # the same weights for every run; only this rank's chunks stay allocated
        with torch.device(device):
            model = Qwen2Model(cfg).to(dtype)
        chunks = build_rank_chunks(model, plan, rank, _stage_layers(mc, plan))
        chunks = {c: ch.to(device) for c, ch in chunks.items()}
        del model
        ex = Executor(plan, compile_plan(plan)[rank], chunks, pp_ranks=groups.pp_ranks, abort=d.abort,  # tp=1, no SP
                      act_shape=(1, mc.seq, mc.hidden), dtype=dtype, device=device)
        times, peak, alloc, max_alloc = [], 0, 0, 0
        for it in range(args.warmup + args.iters):
            for ch in chunks.values():
                ch.zero_grad(set_to_none=False)  # gradients stay allocated: the baseline includes them
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            ex.act_peak = 0
            res = ex.run(toks, toks)
            if cuda:
                torch.cuda.synchronize(device)
                max_alloc = max(max_alloc, torch.cuda.max_memory_allocated(device))
                alloc = max(alloc, max_alloc - base)
            if it >= args.warmup:
                times.append(res.trace.step_time)
                peak = max(peak, ex.act_peak)
        results[label] = {"step_s": statistics.median(times), "peak": peak, "alloc": alloc, "max_alloc": max_alloc,
                          "offloaded": res.counts.get("OFFLOAD_bytes", 0),
                          "host_pool_bytes": ex.offloader.pool.allocated_bytes}
        del ex, chunks
        if cuda:
            torch.cuda.empty_cache()
    out.put((rank, results))
    d.close()


def _predicted(args: argparse.Namespace) -> dict[str, tuple[list[int], float]]:
    """Predicted activation peak per rank and step time, per run label."""
    from braid.core.compiler import compile_plan
    from braid.simulator import simulate

    out = {}
    for label, name, opts in args.runs:
        plan = _plan(name, opts, args.mbs)
        rep = simulate(compile_plan(plan), _costs(args, plan), name=label, record=False).report
        out[label] = ([r.peak_activation_bytes for r in rep.ranks], rep.step_time_s)
    return out


def measure(args: argparse.Namespace) -> tuple[dict[int, dict[str, dict]], dict[str, tuple[list[int], float]]]:
    """Measured figures per rank and run label; predicted activation peak per rank and step time per label.

    Sets ``args.runs`` (the runs, ``offload auto`` tuned once here) for the workers and the caller,
    and on GPUs ``args.link``: this machine's host-copy bandwidth and duplex slowdown
    (:func:`braid.measure.units.measure_host_link`), which the predictions and ``auto`` use."""
    if not args.tiny:
        from braid.measure.units import measure_host_link

        args.link = measure_host_link(torch.device("cuda:0"))
    args.runs = _runs(args)
    return dict(spawn_two(_worker, args, results=2)), _predicted(args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return _parser().parse_args(argv)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 model on CPU with gloo (smoke test)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="7b",
                    help="decoder-layer shape: Qwen2-7B's or Qwen2-72B's (default 7b)")
    ap.add_argument("--budget", type=float, default=0.01,
                    help="offload auto: step-time slowdown allowed for a lower peak (default 0.01 = 1%%)")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers over the 4 virtual stages (default 8)")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    ap.add_argument("--vocab", type=int, default=32768, help="vocabulary size (default 32768)")
    ap.add_argument("--mbs", type=int, default=8, help="micro-batches per step (default 8)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if not args.tiny and torch.cuda.device_count() < 2:
        ap.error("needs 2 GPUs (or --tiny for the CPU smoke test)")
    if args.mbs < 4:
        ap.error("--mbs must be at least 4 (braided_v needs m >= 2p)")
    if not 0.0 <= args.budget < 1.0:
        ap.error(f"--budget must be a fraction in [0, 1), e.g. 0.03 for 3%, got {args.budget}")
    got, pred = measure(args)
    print("\n".join(report(args, got, pred)))
    return 0


def report(args: argparse.Namespace, got: dict, pred: dict) -> list[str]:
    """The printed table of :func:`measure`'s figures: per schedule and rank, step time (measured
    and predicted), throughput and memory against braided_v's, and the predicted activation peak."""
    base = {r: got[r]["braided_v"]["step_s"] for r in got}
    unit = "GiB" if not args.tiny else "KiB"
    div = 2**30 if not args.tiny else 2**10
    runs = args.runs
    auto = next(opts for label, _, opts in runs if label == "offload auto")
    lines = [f"pp=2 tp=1 m={args.mbs} seq={_model_config(args).seq} {_model_config(args).name} layers={args.layers}; offload auto = "
             + ", ".join(f"{k.removeprefix('offload_')} {v:g}" for k, v in auto.items())]
    if getattr(args, "link", None):
        lines.append(f"host link (measured): {args.link[0] / 1e9:.1f} GB/s per direction, x{args.link[1]:.2f} with both at once")
    lines.append(f"(act: live saved bytes; alloc: max_memory_allocated - allocated at step start; max: max_memory_allocated"
                 f"{'; CUDA only' if args.tiny else ''}; pred: simulated activation peak and step time)")
    lines.append(f"{'schedule':<14}{'rank':>5}{'step ms':>9}{'pred ms':>9}{'thr vs bv':>10}{'max ' + unit:>9}{'vs bv':>8}{'alloc':>8}"
                 f"{'vs bv':>8}{'act':>8}{'vs bv':>8}{'pred':>8}{'err':>8}{'offl':>8}{'pool':>8}")
    for label, _, _ in runs:
        for r in sorted(got):
            x, bv = got[r][label], got[r]["braided_v"]
            pk, (pr, pstep) = x["peak"], pred[label]
            err = (pr[r] - pk) / pk if pk else float("nan")
            al = f"{x['alloc'] / bv['alloc'] - 1:+.1%}" if bv["alloc"] else "-"
            mx = f"{x['max_alloc'] / bv['max_alloc'] - 1:+.1%}" if bv["max_alloc"] else "-"
            lines.append(f"{label:<14}{r:>5}{x['step_s'] * 1e3:>9.1f}{pstep * 1e3:>9.1f}{base[r] / x['step_s']:>10.3f}"
                         f"{x['max_alloc'] / div:>9.2f}{mx:>8}{x['alloc'] / div:>8.2f}{al:>8}{pk / div:>8.2f}"
                         f"{pk / bv['peak'] - 1:>+8.1%}{pr[r] / div:>8.2f}{err:>+8.1%}{x['offloaded'] / div:>8.2f}"
                         f"{x['host_pool_bytes'] / div:>8.2f}")
    return lines

if __name__ == "__main__":
    raise SystemExit(main())
