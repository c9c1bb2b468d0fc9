"""Host overhead of the executor per unit task: a model so small that dispatch is all there is.

One process (world 1): gloo on CPU, NCCL with ``--device cuda``. A hidden-64 Qwen2 model
on the two V-shaped chunks of one rank runs the braided_v program of ``p=1`` (forwards,
braided F&BW blocks, full backwards), so every unit task costs mostly Python: the loop
in :class:`braid.runtime.executor.Executor`, :meth:`braid.models.chunk.ModelChunk.run`
and autograd's per-call setup.

Next to it runs the *floor*: the same unit tasks (every unit's forward, activation
backward with the weight gradients split off, weight backward) as direct autograd calls
of the same unit functions on the same modules, with no executor and no chunk
bookkeeping (:func:`_floor_step`; its gradients are checked against the executor's
first). Printed per recording mode: microseconds per unit task and the ratio to the
floor, by wall clock and by this process's CPU time (steadier on a shared machine),
measured side by side in one run (runs interleaved step by step, median over steps).

At tp=1 the executor runs its chunks fused (one backward call per op, and with
``record`` other than ``units`` one chunk call per op); the floor's one autograd call per
unit piece is what the *cut* chunks (``fuse=False``, as at tp > 1) are measured against
like for like. ``--chunks both`` (the default) runs the executor on both, on copies of the
same modules.

    PYTHONPATH=. python benchmarks/bench_executor_overhead.py                 # CPU, every recording mode
    PYTHONPATH=. python benchmarks/bench_executor_overhead.py --device cuda   # one GPU (CUDA-event clock)
    PYTHONPATH=. python benchmarks/bench_executor_overhead.py --profile 25    # cProfile: top 25 functions (own time)

With an executor that has no ``record`` argument (an older checkout) only ``units`` runs.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import inspect
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

MODES = ("units", "instructions", "off")
FLOOR = "floor"


def _setup(args: argparse.Namespace):
    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.models.build import build_rank_chunks

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
    from braid.core.braiding import steps
    from braid.core.ir import Braided, Compute

    return sum(len(steps(i, lambda c: chunks[c].spec)) for i in program.instructions if isinstance(i, (Compute, Braided)))


def _floor_step(chunks, toks, labs, m: int) -> None:
    """The floor: the same unit tasks as direct autograd calls of the same unit functions.

    Per micro-batch, chunk by chunk in stage order: each unit's forward on detached leaf
    inputs; then in reverse each unit's activation backward (``torch.autograd.grad``, weight
    gradients split off as the executor does) followed by its weight backward. No executor,
    no chunk bookkeeping, no saved-tensor hooks: what any unit-granular runtime must pay.
    """
    from braid.models.chunk_parts import _masked_mean
    from braid.core.braiding import Unit
    from braid.tp.embedding import vocab_parallel_cross_entropy
    from braid.tp.layers import split_weight_grads

    grad = torch.autograd.grad
    leaf = lambda t: t.detach().requires_grad_()  # noqa: E731

    def weights(mods, mb):
        for mod in mods:
            mod.weight_backward(mb)

    def norm_bw(x, h, w, dh, extra):
        dx, dw = grad(h, (x, w), dh)
        w.grad = dw if w.grad is None else w.grad.add_(dw)
        return dx if extra is None else dx + extra

    for mb in range(m):
        back = []  # closures, run in reverse: (input grad -> input grad)
        x = None
        for ch in chunks:
            if ch.embed is not None:
                e = ch.embed(toks[mb])
                x = e.detach()

                def bw(g, e=e, ch=ch, mb=mb):
                    with split_weight_grads((ch.embed,), mb):
                        torch.autograd.backward(e, g, inputs=[ch.embed.weight])
                    weights((ch.embed,), mb)
                back.append(bw)
            for lay in ch.layers:
                # the units' weights as the layer declares them (a joined Q/K/V or gate/up group
                # where it pays, else the separate projections)
                for norm, proj, core, mods_pre, mods_core in (
                    (lay.input_layernorm, lambda hl, lay=lay: lay.qkv(hl), lambda a, r, lay=lay: lay.attn(*a, r),
                     lay.unit_weights(Unit.PRE_ATTN), lay.unit_weights(Unit.ATTN)),
                    (lay.post_attention_layernorm, lambda hl, lay=lay: lay.gate_up(hl), lambda a, r, lay=lay: lay.mlp(*a, r),
                     lay.unit_weights(Unit.PRE_MLP), lay.unit_weights(Unit.MLP)),
                ):
                    x0 = leaf(x)
                    h = norm(x0)
                    hl = leaf(h)
                    acts = proj(hl)
                    ins = tuple(leaf(a) for a in acts)
                    out = core(ins, x0)
                    x = out.detach()

                    def bw(g, x0=x0, h=h, hl=hl, acts=acts, ins=ins, out=out, norm=norm, mods_pre=mods_pre,
                           mods_core=mods_core, mb=mb):
                        with split_weight_grads(mods_core, mb):
                            da = grad(out, ins, g)
                        weights(mods_core, mb)
                        with split_weight_grads(mods_pre, mb):
                            (dh,) = grad(acts, hl, da)
                        weights(mods_pre, mb)
                        return norm_bw(x0, h, norm.weight, dh, g)
                    back.append(bw)
            if ch.lm_head is not None:
                x0 = leaf(x)
                h = ch.norm(x0)
                hl = leaf(h)
                loss = _masked_mean(vocab_parallel_cross_entropy(ch.lm_head(hl), labs[mb]), labs[mb]) / m

                def bw(g, x0=x0, h=h, hl=hl, loss=loss, ch=ch, mb=mb):
                    with split_weight_grads((ch.lm_head,), mb):
                        (dh,) = grad(loss, hl)
                    weights((ch.lm_head,), mb)
                    return norm_bw(x0, h, ch.norm.weight, dh, None)
                back.append(bw)
        g = None
        for bw in reversed(back):
            g = bw(g)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU)")
    ap.add_argument("--m", type=int, default=8, help="micro-batches")
    ap.add_argument("--layers", type=int, default=2, help="layers per chunk (2 chunks)")
    ap.add_argument("--seq", type=int, default=16, help="tokens per micro-batch")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--chunks", choices=("both", "fused", "cut"), default="both",
                    help="run the executor on fused chunks (tp=1's default), cut chunks (fuse=False, as at tp > 1) or both")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile one mode's steps, print the top N functions")
    ap.add_argument("--compile", action="store_true", help="compiled units (executor and floor alike; default: eager)")
    ap.add_argument("--json", metavar="FILE", help="also write the medians as JSON: microseconds per unit task, wall and "
                    "CPU, of the floor and of every (chunks, record) run")
    args = ap.parse_args(argv)
    if args.json and not Path(args.json).resolve().parent.is_dir():
        ap.exit(2, f"--json {args.json}: its directory does not exist\n")
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
        if "compile" in inspect.signature(Executor).parameters:
            kw["compile"] = args.compile
        sets = {"fused": chunks, "cut": {c: copy.deepcopy(ch) for c, ch in chunks.items()}}
        for ch in sets["cut"].values():
            ch.fuse = False
        kinds = ("fused", "cut") if args.chunks == "both" else (args.chunks,)
        exs = {(k, m): Executor(plan, program, sets[k], **kw, **({"record": m} if has_record else {}))
               for k in kinds for m in modes}
        for k in kinds:
            if has_record and any(exs[(k, m)].fused.get(0) is not (k == "fused") for m in modes):
                raise SystemExit(f"--chunks {k}: the executor chose the other mode for these chunks (is this an older checkout?)")
        n = _units(program, chunks)
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

        ordered = [chunks[c] for c in sorted(chunks, key=lambda c: plan.stage_of(0, c))]

        def step(run) -> tuple[float, float]:
            """(wall seconds, CPU seconds of this process) of one step of run FLOOR or (chunks, mode)."""
            for chs in sets.values():
                for ch in chs.values():
                    ch.zero_grad(set_to_none=True)
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            if run == FLOOR:
                _floor_step(ordered, toks, toks, args.m)
            else:
                exs[run].run(toks, toks)
            sync()
            return time.perf_counter() - t0, time.process_time() - c0

        # The floor computes what the executor computes (same gradients, to rounding).
        step(FLOOR)
        want = [p.grad.clone() for ch in chunks.values() for p in ch.parameters()]
        for k in kinds:
            step((k, modes[0]))
            for a, b in zip(want, [p.grad for ch in sets[k].values() for p in ch.parameters()]):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        runs = [FLOOR, *exs]
        for _ in range(args.warmup):
            for mode in runs:
                step(mode)
        times: dict[str, list[tuple[float, float]]] = {m: [] for m in runs}
        for _ in range(args.steps):
            for mode in runs:
                times[mode].append(step(mode))
        print(f"device {args.device}, braided_v p=1 m={args.m}, 2 chunks x {args.layers} layers, hidden {cfg.hidden}, "
              f"seq {args.seq}: {n} unit tasks per step, median of {args.steps} steps (runs interleaved)")
        print("  wall: elapsed time; cpu: this process's CPU time (steadier on a shared machine; one torch thread)")
        med = {mode: [statistics.median(t[i] for t in times[mode]) for i in (0, 1)] for mode in runs}
        (fw, fc) = med[FLOOR]
        print(f"  {'floor':<26} {fw * 1e3:8.2f} ms/step  {fw / n * 1e6:7.1f} us/unit task wall  {fc / n * 1e6:7.1f} us cpu"
              f"  (direct autograd calls of the unit functions)")
        for k, mode in exs:
            w, c = med[(k, mode)]
            label = f"{k} record={mode}"
            print(f"  {label:<26} {w * 1e3:8.2f} ms/step  {w / n * 1e6:7.1f} us/unit task wall  {c / n * 1e6:7.1f} us cpu"
                  f"  {w / fw:5.2f}x the floor (wall), {c / fc:5.2f}x (cpu)")
        if args.json:
            per_task = {"floor" if run == FLOOR else f"{run[0]} record={run[1]}": {"wall_us": w / n * 1e6, "cpu_us": c / n * 1e6}
                        for run, (w, c) in med.items()}
            doc = {"device": args.device, "torch": torch.__version__, "unit_tasks": n, "us_per_unit_task": per_task,
                   "config": {"schedule": "braided_v", "p": 1, "m": args.m, "layers_per_chunk": args.layers, "hidden": cfg.hidden,
                              "seq": args.seq, "steps": args.steps, "warmup": args.warmup, "compile": args.compile}}
            Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        if args.profile:
            mode = (kinds[0], modes[-1])
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
