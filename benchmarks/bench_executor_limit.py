"""The executor at the single-device limit: braid at pp=1 against plain loops of the same model.

One process, one device. The same model (seeded; ``--layers-per-stage`` layers on each of
two chunks, embedding and LM head) trains one step after another -- forward and backward
of ``--m`` micro-batches, then an AdamW step (``foreach``) -- under each contender:

* ``braid_<schedule>``: braid's executor at pp=1 (two V-placed chunks on the one rank) for
  ``braided_v``, ``1f1b_i``, ``zb_v`` (``--schedule``), with compiled units unless
  ``--no-compile`` (:mod:`braid.runtime.compiled`); with compiling on, ``braided_v`` is also
  run eager (``braid_braided_v_eager``) so the gain is visible;
* ``eager``: the plain loop over the single-device ``Qwen2Model`` (loss / m, backward per
  micro-batch);
* ``eager_compiled``: the same loop with the model under ``torch.compile``;
* ``torch_<schedule>``: ``torch.distributed.pipelining``'s schedules on the same two chunks
  (:mod:`braid.baselines.torch_pp`); the best of them is ``torch_pp_best``.

Contenders run one after another in one process (each builds its copy of the weights and
frees it after), warm-up steps first (compiling happens there), then the median of
``--steps`` step times. With ``--interleave`` all contenders are built at once and their
steps alternate (one step of each, ``--steps`` times), so a slow spell of a shared host
falls on all of them alike; it needs every contender's memory at once (small presets). ``--repeat R`` runs the whole list R times, round after round, so
that every contender sees the device in each of its states (an H100's clock drifts with its
temperature over a run); a contender's figure is the median over rounds, and every ratio is
taken within a round and printed as median [min, max] over the rounds. Printed: step time,
tokens/s, and every contender's speed as a ratio to braid's best schedule; written (atomically) to
``benchmarks/results/executor_limit_<gpu>.json`` (``--out`` overrides)::

    {"device": ..., "tokens_per_s": {"braid_braided_v": ..., "eager": ..., "eager_compiled": ...,
     "torch_pp_best": ..., ...}, "tokens_per_s_rounds": {...}, "ratios": {...}, "step_s": {...},
     "config": {...}}

The issue-20 setting on one GPU (4 Qwen2-7B-shaped layers, 32K vocabulary, seq 4096,
8 micro-batches of 1, bf16)::

    PYTHONPATH=. python benchmarks/bench_executor_limit.py --preset 7b-layer --layers-per-stage 2 --seq 4096 --m 8 --repeat 3

A CPU smoke run (seconds; compiled contenders off)::

    PYTHONPATH=. python benchmarks/bench_executor_limit.py --preset tiny --device cpu --seq 16 --m 4 --steps 2 \\
        --skip eager_compiled --out /tmp/limit.json
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from braid.measure.device_busy import compute_busy_s

SCHEDULES = ("braided_v", "1f1b_i", "zb_v")
KINDS = ("braid", "braid_eager", "braid_nograph", "eager", "eager_compiled", "torch_pp")


def gpu_slug(device: torch.device) -> str:
    """A short name for the results file: ``h100``, ``h200``, ``a100``... or ``cpu``."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    m = re.search(r"\b([a-z]\d{2,4}[a-z]?)\b", name)
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "_", name).strip("_")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _timed(step: Callable[[], Any], device: torch.device, warmup: int, steps: int) -> tuple[list[float], Any]:
    times, out = [], None
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        out = step()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, out


def _adamw(params: list[torch.nn.Parameter], device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-5, foreach=device.type == "cuda")


def braid_step(model, schedule: str, args, device, dtype, compile: bool, cuda_graph: str | None = None) -> Callable[[], Any]:
    """braid's executor at pp=1 over two V-placed chunks of ``model``; one step = program + AdamW
    (the program as a whole-step CUDA graph under ``cuda_graph``, :mod:`braid.runtime.graphs`)."""
    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.runtime.executor import Executor
    from braid.models.build import build_rank_chunks
    from braid.runtime.graphs import step_runner

    plan = schedules.build(schedule, 1, args.m)
    chunks = build_rank_chunks(model, plan, 0, (args.layers_per_stage,) * plan.num_stages)
    chunks = {c: ch.to(device=device, dtype=dtype) for c, ch in chunks.items()}
    ex = Executor(plan, compile_plan(plan)[0], chunks, pp_ranks=[0], act_shape=(args.micro_batch_size, args.seq, model.cfg.hidden),
                  dtype=dtype, device=device, record="off", compile=compile)
    params = [p for ch in chunks.values() for p in ch.parameters()]
    opt = _adamw(params, device)
    toks, labs = args.data
    runner = step_runner(ex, cuda_graph)

    def step() -> float | None:
        res = runner.run(toks, labs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return res.loss

    return step


def loop_step(model, args, device, dtype, compiled: bool) -> Callable[[], Any]:
    """The plain training loop of the single-device model (optionally under ``torch.compile``)."""
    import copy

    ref = copy.deepcopy(model).to(device=device, dtype=dtype)
    fwd = torch.compile(ref) if compiled else ref
    opt = _adamw(list(ref.parameters()), device)
    toks, labs = args.data

    def step() -> float:
        total = torch.zeros((), device=device)
        for t, lab in zip(toks, labs):
            loss = fwd(t, lab) / args.m
            loss.backward()
            total += loss.detach().float()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(total)

    return step


def torch_pp_step(model, name: str, args, device, dtype, groups) -> Callable[[], Any]:
    """A ``torch.distributed.pipelining`` schedule on the same two chunks (:class:`braid.baselines.torch_pp.TorchPipeline`)."""
    from braid.baselines.torch_pp import TorchPipeline

    pipe = TorchPipeline(name, model, (args.layers_per_stage,) * 2, args.m, groups=groups, device=device, dtype=dtype)
    opt = _adamw(pipe.parameters(), device)
    toks, labs = args.data
    x, y = torch.cat(toks), torch.cat(labs)

    def step() -> float | None:
        loss = pipe.step((x,), y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def _error(err: Exception) -> str:
    """A contender that could not run, in one line."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def _interleaved(makers: list[tuple[str, Callable[[], Callable[[], Any]]]], device, warmup: int, steps: int
                 ) -> dict[str, dict[str, Any]]:
    """Every contender built at once, warmed up, then timed one step each in turn, ``steps`` times:
    a slow spell of the host or the device falls on all of them alike."""
    built: dict[str, Callable[[], Any]] = {}
    results: dict[str, dict[str, Any]] = {}
    for name, make in makers:
        try:
            step = make()
            for _ in range(warmup):
                step()
        except Exception as err:  # noqa: BLE001 - a contender that cannot run is reported, not fatal
            results[name] = {"error": _error(err)}
        else:
            built[name] = step
    times: dict[str, list[float]] = {name: [] for name in built}
    losses: dict[str, Any] = {}
    for _ in range(steps):
        for name, step in built.items():
            t, losses[name] = _timed(step, device, 0, 1)
            times[name] += t
    for name in built:
        results[name] = {"step_s_all": times[name], "loss": losses[name]}
    return results


def _speeds(results: dict[str, dict[str, Any]]) -> tuple[dict[str, float], str | None]:
    """One round's tokens/s per contender (plus ``torch_pp_best``) and the name of braid's best schedule."""
    from braid.baselines.torch_pp import TORCH_SCHEDULES

    tps = {k: v["tokens_per_s"] for k, v in results.items() if "tokens_per_s" in v}
    torch_runs = [tps[k] for k in TORCH_SCHEDULES if k in tps]
    if torch_runs:
        tps["torch_pp_best"] = max(torch_runs)
    braid_runs = [k for k in tps if k.startswith("braid_") and not k.endswith("_eager")]
    return tps, max(braid_runs, key=tps.get, default=None)


def main(argv: list[str] | None = None) -> int:
    from braid.baselines.torch_pp import TORCH_SCHEDULES
    from braid.io.files import OutputPathError, atomic_write_text, check_output_path
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.measure.config import PRESETS
    from braid.runtime import compiled as compiled_units

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("::", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="7b-layer", choices=sorted(PRESETS), help="layer shape (default 7b-layer)")
    ap.add_argument("--layers-per-stage", type=int, default=2, help="decoder layers per chunk; 2 chunks (default 2)")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per sample (default 4096)")
    ap.add_argument("--m", type=int, default=8, help="micro-batches per step (default 8)")
    ap.add_argument("--micro-batch-size", type=int, default=1, help="samples per micro-batch (default 1)")
    ap.add_argument("--schedule", nargs="+", default=list(SCHEDULES), help=f"braid schedules (default {' '.join(SCHEDULES)})")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="braid's compiled units (default: on with CUDA, off on CPU)")
    ap.add_argument("--skip", nargs="+", default=[], choices=KINDS, help="contenders to leave out")
    ap.add_argument("--cuda-graph", choices=["none", "step"], default=None,
                    help="braid's steps as whole-step CUDA graphs (step) or eager (none); default: step on CUDA. "
                         "With graphs on, braided_v also runs without them (braid_braided_v_nograph; --skip braid_nograph leaves it out)")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps per contender (default 3)")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per contender; the median is reported (default 10)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds over all contenders; ratios are taken per round (default 1)")
    ap.add_argument("--interleave", action="store_true",
                    help="hold every contender at once and time their steps in turn (robust to a host whose speed "
                         "drifts; needs the memory of all contenders together: small presets)")
    ap.add_argument("--compute-busy", action="store_true",
                    help="profile one more step of every contender (CUDA, not with --interleave): its compute "
                         "(braid.measure.device_busy) and kernels, and braid's best compute over each loop's step")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/executor_limit_<gpu>.json)")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    bad = [s for s in args.schedule if s not in SCHEDULES]
    if bad:
        ap.error(f"--schedule {bad[0]!r}: pp=1 runs {', '.join(SCHEDULES)}")
    if min(args.seq, args.m, args.micro_batch_size, args.layers_per_stage, args.steps, args.repeat) < 1 or args.warmup < 0:
        ap.error("--seq, --m, --micro-batch-size, --layers-per-stage, --steps and --repeat must be >= 1, --warmup >= 0")
    from braid.runtime.graphs import WARMUP_STEPS, config_reason

    graphs_on = args.cuda_graph != "none" and config_reason(device) is None
    if args.cuda_graph == "step" and not graphs_on:
        ap.error(f"--cuda-graph step: {config_reason(device)}")
    if args.compute_busy and (device.type != "cuda" or args.interleave):
        ap.error("--compute-busy reads the CUDA profiler of one contender at a time: it needs CUDA and no --interleave")
    if graphs_on and args.warmup < WARMUP_STEPS + 1:
        ap.error(f"--warmup must be >= {WARMUP_STEPS + 1} with CUDA graphs ({WARMUP_STEPS} eager steps, then the capture)")
    try:
        compile_units = compiled_units.resolve(args.compile, device)
        out = check_output_path(args.out or f"benchmarks/results/executor_limit_{gpu_slug(device)}.json", what="--out")
    except (ValueError, OutputPathError) as err:
        ap.error(str(err))
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True

    from dataclasses import asdict

    cfg = Qwen2Config(**{**asdict(PRESETS[args.preset]), "layers": 2 * args.layers_per_stage})
    from braid.models.build import materialize, meta_model

    # the master copy, on the host, initialised by name in one pass (not Qwen2Model(cfg): its linear
    # layers' default init, overwritten at once, was most of a 7B-shaped model's seconds); every contender copies it
    model = materialize(meta_model(Qwen2Model, cfg, seed=1234, dtype=dtype))
    g = torch.Generator().manual_seed(7)
    shape = (args.micro_batch_size, args.seq)
    args.data = tuple([torch.randint(0, cfg.vocab_size, shape, generator=g).to(device) for _ in range(args.m)] for _ in range(2))

    from braid.runtime.distributed import ProcessGroups
    from braid.core.topology import Topology

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)
    rounds: list[dict[str, dict[str, Any]]] = []
    try:
        groups = ProcessGroups.create(Topology(1, pp=1, tp=1))
        makers: list[tuple[str, Callable[[], Callable[[], Any]]]] = []
        if "braid" not in args.skip:
            makers += [(f"braid_{s}", lambda s=s: braid_step(model, s, args, device, dtype, compile_units, args.cuda_graph))
                       for s in args.schedule]
            if graphs_on and "braided_v" in args.schedule and "braid_nograph" not in args.skip:
                makers.append(("braid_braided_v_nograph", lambda: braid_step(model, "braided_v", args, device, dtype, compile_units, "none")))
        if compile_units and "braid_eager" not in args.skip and "braided_v" in args.schedule:
            makers.append(("braid_braided_v_eager", lambda: braid_step(model, "braided_v", args, device, dtype, False, args.cuda_graph)))
        if "eager" not in args.skip:
            makers.append(("eager", lambda: loop_step(model, args, device, dtype, False)))
        if "eager_compiled" not in args.skip:
            makers.append(("eager_compiled", lambda: loop_step(model, args, device, dtype, True)))
        if "torch_pp" not in args.skip:
            makers += [(n, lambda n=n: torch_pp_step(model, n, args, device, dtype, groups)) for n in TORCH_SCHEDULES]
        for r in range(args.repeat):
            if args.interleave:
                print(f"round {r + 1}/{args.repeat}: all contenders, steps interleaved ...", file=sys.stderr, flush=True)
                results = _interleaved(makers, device, args.warmup, args.steps)
                _free(device)
            else:
                results = {}
                for name, make in makers:
                    print(f"round {r + 1}/{args.repeat}: running {name} ...", file=sys.stderr, flush=True)
                    try:
                        step = make()
                        times, loss = _timed(step, device, args.warmup, args.steps)
                        busy = compute_busy_s(step, device, 20) if args.compute_busy and r == 0 else None
                    except Exception as err:  # noqa: BLE001 - a contender that cannot run is reported, not fatal
                        results[name] = {"error": _error(err)}
                    else:
                        results[name] = {"step_s_all": times, "loss": loss}
                        if busy is not None:
                            results[name].update(compute_s=busy[0], compute_kernels=busy[2])
                    _free(device)
            for res in results.values():
                if "step_s_all" in res:
                    res["step_s"] = statistics.median(res["step_s_all"])
                    res["tokens_per_s"] = args.m * args.micro_batch_size * args.seq / res["step_s"]
            rounds.append(results)
    finally:
        dist.destroy_process_group()

    per_round = [_speeds(res) for res in rounds]
    names = list(dict.fromkeys(k for tps_r, _ in per_round for k in tps_r))
    tps = {k: statistics.median([t[k] for t, _ in per_round if k in t]) for k in names}
    tps_rounds = {k: [t[k] for t, _ in per_round if k in t] for k in names}
    ref_name = max((k for k in tps if k.startswith("braid_") and not k.endswith("_eager")), key=tps.get, default=None)
    # ratios within each round: braid's best schedule of that round over each baseline
    ratios: dict[str, list[float]] = {}
    for t, best in per_round:
        if best is None:
            continue
        for other in ("eager", "eager_compiled", "torch_pp_best"):
            if other in t:
                ratios.setdefault(other, []).append(t[best] / t[other])
    results = rounds[-1]
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"# {dev_name}, torch {torch.__version__}, {args.preset} x {2 * args.layers_per_stage} layers, seq {args.seq}, "
          f"m={args.m} x {args.micro_batch_size}, {str(dtype).removeprefix('torch.')}, braid compiled units: {compile_units}, "
          f"{args.repeat} round(s) of {args.steps} steps")
    head = f"{'contender':<26}{'step ms':>10}{'tokens/s':>12}{'vs braid best':>15}{'tokens/s min-max over rounds':>32}"
    print(head + "\n" + "-" * len(head))
    for name in names:
        ratio = f"{tps[name] / tps[ref_name]:.3f}" if ref_name else "-"
        lo, hi = min(tps_rounds[name]), max(tps_rounds[name])
        step_ms = args.m * args.micro_batch_size * args.seq / tps[name] * 1e3
        print(f"{name:<26}{step_ms:>10.2f}{tps[name]:>12.0f}{ratio:>15}{f'{lo:.0f} - {hi:.0f}':>32}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<26}  could not run: {r['error']}")
    for other, rs in ratios.items():
        print(f"braid best / {other}: {statistics.median(rs):.3f}x  [{min(rs):.3f}, {max(rs):.3f}] over {len(rs)} round(s)")
    compute = {k: v["compute_s"] for k, v in rounds[0].items() if "compute_s" in v}
    if compute:
        print("compute per step (ms, one profiled step, first round): " + "; ".join(f"{k} {v * 1e3:.1f}" for k, v in compute.items()))
        ours = min(((v, k) for k, v in compute.items() if k.startswith("braid_") and not k.endswith("_eager")), default=None)
        for other in ("eager", "eager_compiled") if ours else ():
            if other in rounds[0] and "step_s" in rounds[0][other]:
                print(f"ceiling: braid's least compute ({ours[1]}, {ours[0] * 1e3:.1f} ms) is "
                      f"{rounds[0][other]['step_s'] / ours[0]:.3f}x {other}'s step in that round: no braid step of these kernels gets past it")
    doc = {"device": dev_name, "torch": torch.__version__, "tokens_per_s": tps, "tokens_per_s_rounds": tps_rounds,
           "ratios": {f"braid_best/{k}": {"median": statistics.median(v), "min": min(v), "max": max(v), "rounds": v}
                      for k, v in ratios.items()},
           "step_s": {k: args.m * args.micro_batch_size * args.seq / v for k, v in tps.items()},  # of the median tokens/s
           "errors": {k: v["error"] for k, v in results.items() if "error" in v},
           "compute_s": {k: v["compute_s"] for k, v in rounds[0].items() if "compute_s" in v},
           "compute_kernels": {k: v["compute_kernels"] for k, v in rounds[0].items() if "compute_kernels" in v},
           "losses": {k: v["loss"] for k, v in results.items() if "loss" in v},
           "config": {"preset": args.preset, "layers": cfg.layers, "hidden": cfg.hidden, "ffn": cfg.ffn, "vocab": cfg.vocab_size,
                      "seq": args.seq, "m": args.m, "micro_batch_size": args.micro_batch_size, "dtype": str(dtype),
                      "compiled_units": compile_units, "warmup": args.warmup, "steps": args.steps, "repeat": args.repeat,
                      "interleave": args.interleave}}
    atomic_write_text(out, json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
