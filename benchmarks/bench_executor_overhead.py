"""Host overhead of the executor per unit task: a model so small that dispatch is all there is.

One process (world 1): gloo on CPU, NCCL with ``--device cuda``. A hidden-64 Qwen2 model
on the two V-shaped chunks of one rank runs the braided_v program of ``p=1`` (forwards,
braided F&BW blocks, full backwards), so every unit task costs mostly Python: the loop
in :class:`braid.runtime.executor.Executor`, :meth:`braid.models.chunk.ModelChunk.run`
and autograd's per-call setup. Prints unit tasks per second and microseconds per unit
task for each trace-recording mode, measured side by side in one run (modes
interleaved step by step, median over steps).

    python benchmarks/bench_executor_overhead.py                    # CPU, every recording mode
    python benchmarks/bench_executor_overhead.py --device cuda      # one GPU (CUDA-event clock)
    python benchmarks/bench_executor_overhead.py --profile 25       # cProfile: top 25 functions (cumulative)

With an executor that has no ``record`` argument (an older checkout) only ``units`` runs,
so the same command gives a before/after figure.
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import pstats
import statistics
import time

import torch
import torch.distributed as dist

MODES = ("units", "instructions", "off")


def _setup(args: argparse.Namespace):
    from braid import schedules
    from braid.compiler import compile_plan
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.runtime.executor import build_rank_chunks

    device = torch.device(args.device)
    cfg = Qwen2Config(vocab_size=128, hidden=64, layers=2 * args.layers, heads=4, kv_heads=2, ffn=128)
    plan = schedules.build("braided_v", 1, args.m)
    program = compile_plan(plan)[0]
    torch.manual_seed(0)
    model = Qwen2Model(cfg)
    chunks = build_rank_chunks(model, plan, 0, (args.layers, args.layers))
    chunks = {c: ch.to(device) for c, ch in chunks.items()}
    g = torch.Generator().manual_seed(1)
    toks = [torch.randint(0, cfg.vocab_size, (1, args.seq), generator=g).to(device) for _ in range(args.m)]
    return cfg, plan, program, chunks, toks


def _units(program, chunks) -> int:
    from braid.braiding import steps
    from braid.ir import Braided, Compute

    return sum(len(steps(i, lambda c: chunks[c].spec)) for i in program.instructions if isinstance(i, (Compute, Braided)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU)")
    ap.add_argument("--m", type=int, default=8, help="micro-batches")
    ap.add_argument("--layers", type=int, default=2, help="layers per chunk (2 chunks)")
    ap.add_argument("--seq", type=int, default=16, help="tokens per micro-batch")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile one mode's steps, print the top N functions")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.exit(2, "--device cuda: no CUDA device here\n")
    torch.set_num_threads(1)

    from braid.runtime.executor import Executor

    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg, plan, program, chunks, toks = _setup(args)
        has_record = "record" in inspect.signature(Executor).parameters
        modes = args.modes if has_record else ["units"]
        kw = dict(pp_ranks=[0], act_shape=(1, args.seq, cfg.hidden), device=args.device)
        exs = {m: Executor(plan, program, chunks, **kw, **({"record": m} if has_record else {})) for m in modes}
        n = _units(program, chunks)
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

        def step(mode: str) -> float:
            for ch in chunks.values():
                ch.zero_grad(set_to_none=True)
            sync()
            t0 = time.perf_counter()
            exs[mode].run(toks, toks)
            sync()
            return time.perf_counter() - t0

        for _ in range(args.warmup):
            for mode in modes:
                step(mode)
        times: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.steps):
            for mode in modes:
                times[mode].append(step(mode))
        print(f"device {args.device}, braided_v p=1 m={args.m}, 2 chunks x {args.layers} layers, hidden {cfg.hidden}, "
              f"seq {args.seq}: {n} unit tasks per step, median of {args.steps} steps")
        base = statistics.median(times[modes[0]])
        for mode in modes:
            t = statistics.median(times[mode])
            print(f"  record={mode:<13} {t * 1e3:8.2f} ms/step  {n / t:9.0f} unit tasks/s  {t / n * 1e6:7.1f} us/unit task"
                  f"  ({base / t:.2f}x of {modes[0]})")
        if args.profile:
            mode = modes[-1]
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                step(mode)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile)
            print(f"cProfile, record={mode}, {args.steps} steps, by own time:\n{s.getvalue()}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
