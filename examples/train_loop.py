"""The training loop shared by ``examples/qwen2.py`` (LLM) and ``examples/qwen2_vl.py`` (VLM): the launcher.

One process per rank (torchrun) or a single process (world size 1). Every rank builds the
same single-device model from ``--seed``, keeps only its pipeline/TP shards, compiles the
schedule, and runs ``--steps`` steps of: executor program (forward + backward of all
micro-batches in the schedule's order), gradient all-reduce over data-parallel replicas,
optimizer update. A :class:`Task` says what differs between the two scripts (model, data,
chunks). The roles live in their own files:

* ``train_cli.py`` -- flags (and ``--config`` run files), every check made before any
  process group exists;
* ``train_step.py`` -- the runners, the optimizer (:func:`train_step.make_optimizer`),
  one step (:func:`train_step.train_step`), the unsplit reference;
* ``train_checkpoint.py`` -- checkpoints under global parameter names (any layout resumes);
* ``train_report.py`` -- banner, progress, metrics (JSON lines, TensorBoard), table, trace;
* this file -- :func:`run` (process groups, every schedule), the step loop, :func:`main`.

Outputs: a start-up banner and one log line per step on rank 0, ``--metrics`` (JSON
lines), ``--tensorboard``, ``--trace`` (the last step's measured trace, all ranks merged),
``--save``/``--resume`` (``DIR/step_N`` folders, see ``train_checkpoint.py``; resuming
reproduces the uninterrupted run's losses, exactly at the same layout). Exit codes: 2 for
bad flags, layouts, input files or checkpoints, 1 for a non-finite loss, a failed
``--reference``, a checkpoint that could not be written (a full disk), or a rank that
failed, was lost or stayed silent. Such a failure is one line on stderr per job, and under
torchrun the line is every rank's recorded error, the root cause of torchrun's summary
(:func:`braid.runtime.ending.end_run`).

Real data: give :func:`main` a ``source`` -- any :class:`data.SampleSource` returning
``tokens``/``labels`` (and ``pixels`` for the VLM) per global sample index; the loop
draws samples ``pos .. pos + global_batch - 1`` each step, so the position is all a
resumed run needs.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from braid.training.checkpoint import CheckpointError
from train_checkpoint import TrainState, describe_resume, verify_resume
from train_cli import Run, RunError, Setup, Task, UsageError, prepare
from train_report import (MetricsLog, Progress, RunStats, banner, format_comparison, max_norm_diff, max_rel_diff,  # noqa: E501
                          reference_norm_rtol, reference_rtol, write_trace)
from train_step import (Prefetcher, compute_dtype, local_tensors, make_optimizer, make_runner, peak_flops, pick_device,
                        train_reference, train_step)

__all__ = ["Task", "main", "run"]

log = logging.getLogger("braid.examples")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(task: Task, setup: Setup, source: Any = None, joined: Any = None
        ) -> tuple[dict[str, RunStats], tuple[list[float], list[float]] | None]:
    """Train every schedule of the job from the same weights and data.

    ``joined``: this rank's :func:`braid.runtime.store.join`, made before the preparation (or None).
    Returns the stats by schedule name and, with ``--reference``, the unsplit model's
    per-step losses and gradient norms (both on every rank).
    """
    from braid.runtime.distributed import Dist, ProcessGroups

    args = setup.args
    device = pick_device(args)
    dtype = compute_dtype(device)
    if "RANK" in os.environ:
        d = Dist.from_env(device=device, timeout_s=args.timeout, joined=joined)
    else:
        d = Dist.init(0, 1, master_port=_free_port(), device=device, timeout_s=args.timeout)
    failed: BaseException | None = None
    try:
        # a raw communication failure anywhere inside (a collective of a library call) leaves as the
        # executor's would: PeerLost naming the lost rank, PeerFailure naming the first failing one
        with d.abort.collective():
            groups = ProcessGroups.create(setup.topo, timeout_s=args.timeout,
                                          seq_shard=args.sequence_parallel)
            source = source if source is not None else setup.source
            ref = train_reference(task, setup, source, device, dtype, d.abort) if args.reference else None
            stats = {r.name: train_schedule(task, setup, r, d, groups, source, device, dtype) for r in setup.runs}
        if setup.rank == 0 and (len(stats) > 1 or ref is not None):
            print(format_comparison(task, setup, stats, ref, dtype), flush=True)
        return stats, ref
    except (RunError, CheckpointError):
        raise  # a verdict every rank reached together: nobody to abort
    except BaseException as err:
        failed = err  # collectives may be in flight that no peer joins: close aborts them
        if isinstance(err, Exception):
            d.abort.fail(err)  # first failing rank wins the record; a report of another rank's failure is not recorded
        raise
    finally:
        d.close(failed)


def train_schedule(task: Task, setup: Setup, run: Run, d: Any, groups: Any, source: Any, device: torch.device,
                   dtype: torch.dtype) -> RunStats:
    """``--steps`` steps of one schedule; per-step log line, metrics, checkpoints and trace as asked."""
    args, topo = setup.args, setup.topo
    c = groups.coords
    runner = make_runner(task, setup, run, d, groups, device, dtype)
    opt = make_optimizer(args, runner)
    _banner(task, setup, run, runner, dtype)
    state = None
    if args.save or setup.resume_dir is not None:
        state = TrainState(task, runner, opt, groups)
        state.check_against(setup.model)
    per_step = args.dp * args.mbs * args.micro_batch_size
    step, pos = 0, 0
    if setup.resume_dir is not None:
        verify_resume(setup.resume_dir, setup.rank, setup.world)
        step, pos = state.load(setup.resume_dir)
        if hasattr(opt, "resume_at"):
            opt.resume_at(step)  # the learning-rate schedule continues where the run stopped
        if setup.rank == 0:
            log.info("%s", describe_resume(setup.resume_dir, setup, run, step, pos))
            if step >= args.steps:
                log.info("nothing to train: the checkpoint is at step %d, --steps is %d", step, args.steps)
    seq = task.seq_len(setup.model, args)
    flops = task.flops_per_sample(setup.model, args)
    peak = peak_flops(args, device)
    bar = Progress(args.steps, setup.rank == 0)
    metrics = MetricsLog(args, step if args.resume else None) if setup.rank == 0 else None  # step 0: a fresh start
    if setup.rank == 0 and args.save:
        _write_config(setup, Path(args.save) / "config.toml")
    stats = RunStats(run.name, [], [], [0] * setup.world)
    prof = None
    if args.profile:
        from train_profile import StepProfiler

        prof = StepProfiler(args.profile, args.profile_step or args.steps, device, setup.rank)
    shot = None
    if args.memory_snapshot:
        from train_profile import StepSnapshot

        shot = StepSnapshot(args.memory_snapshot, args.profile_step or args.steps, device, setup.rank, setup.world)
    data = Prefetcher(task, setup, source, c.dp, per_step, device, dtype)  # the next step's samples drawn beside this one
    try:
        while step < args.steps:
            fetch = lambda: data.take(pos, more=step + 1 < args.steps)  # noqa: E731
            toks, labs = fetch() if prof is None else prof.time_data(fetch)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                torch.cuda.synchronize(device)
            lr = float(getattr(opt, "lr", args.lr))  # this step's learning rate (the schedule advances in the step)
            t0 = time.perf_counter()
            one = lambda: train_step(runner, opt, toks, labs, traced=bool(args.trace) and step + 1 == args.steps,  # noqa: E731
                                     step=step + 1, topo=topo, rank=setup.rank, device=device)
            with prof.step(step + 1) if prof is not None else contextlib.nullcontext():
                out = one() if shot is None else shot.run(step + 1, one, local_tensors(runner.params), opt)
            mem = out.mem
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                mem = torch.cuda.max_memory_allocated(device)
            dt = time.perf_counter() - t0
            loss = out.loss
            mems = torch.zeros(setup.world, dtype=torch.int64, device=device)
            mems[setup.rank] = mem
            d.abort.all_reduce(mems)
            step += 1
            pos += per_step
            stats.losses.append(loss)
            stats.grad_norms.append(out.grad_norm)
            stats.step_times.append(dt)
            stats.peak_bytes = [max(a, int(b)) for a, b in zip(stats.peak_bytes, mems.tolist())]
            samples = per_step / dt
            tokens = samples * seq
            mfu = flops * samples / (setup.world * peak) if peak else 0.0
            gn = "" if out.grad_norm is None else f"  grad norm {out.grad_norm:.3f}"
            bar.update(step, f"{run.name}  step {step:>4}/{args.steps}  loss {loss:.4f}{gn}  {dt * 1e3:7.1f} ms  {tokens:,.0f} tok/s  "
                             f"mfu {mfu:.3f}  peak mem {max(mems.tolist()) / 2**20:,.1f} MiB")
            if metrics is not None:
                metrics.write({"step": step, "loss": loss, "grad_norm": out.grad_norm, "lr": lr, "step_time_s": dt, "samples_per_s": samples,
                               "tokens_per_s": tokens, "mfu": mfu, "peak_memory_bytes": mems.tolist(),
                               "schedule": run.name, "tp": topo.tp, "pp": topo.pp, "dp": topo.dp,
                               "model": args.hf or args.model, "device": str(device), "dtype": str(dtype).replace("torch.", "")})
            if state is not None and args.save and (step == args.steps or (args.save_every and step % args.save_every == 0)):
                folder = state.save(task, setup, run, step, pos, {"config.toml": _config_text(setup)})
                if setup.rank == 0:
                    log.info("checkpoint: %s", folder)
    finally:
        data.close()
        bar.close()
        if metrics is not None:
            metrics.close()
    if args.save_hf:
        import braid.hf
        from braid.models.registry import family_of

        braid.hf.save_chunks(runner.chunks, setup.model.cfg, family_of(setup.model), args.save_hf, groups,
                             experts=getattr(runner, "experts", None))
        if setup.rank == 0:
            log.info("saved a Hugging Face checkpoint to %s", args.save_hf)
    if prof is not None:
        from train_profile import gather_and_write

        with d.abort.collective():
            gather_and_write(prof, setup.world, f"{run.name} step {prof.at} of {args.steps}, tp={topo.tp} pp={topo.pp} "
                                                f"dp={topo.dp} cp={topo.cp}, m={args.mbs}, {getattr(runner.graph, 'mode', 'torch')}")
    if shot is not None:
        with d.abort.collective():
            shot.gather_and_print(setup.world, f"{run.name} step {shot.at} of {args.steps}, tp={topo.tp} pp={topo.pp} "
                                               f"dp={topo.dp}, m={args.mbs}, {getattr(runner.graph, 'mode', 'torch')}")
    if args.trace and runner.res is not None:
        with d.abort.collective():
            write_trace(runner.res.trace, setup.rank, setup.world, args)
    del runner, opt, state
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return stats


def _banner(task: Task, setup: Setup, run: Run, runner: Any, dtype: torch.dtype) -> None:
    import torch.distributed as dist

    mine = (sum(p.numel() for p in local_tensors(runner.params)), runner.state_bytes)
    every: list[Any] = [None] * setup.world
    with runner.abort.collective():
        dist.all_gather_object(every, mine)
    if setup.rank == 0:
        log.info("%s", banner(task, setup, run.name, [n for n, _ in every], [b for _, b in every], dtype))


def _config_text(setup: Setup) -> str:
    from braid.io.runconfig import dump_config

    prog = setup.parser.prog if setup.parser is not None else "train"
    launch = f"torchrun --nproc-per-node {setup.world}" if setup.world > 1 else "python"
    args = setup.args
    if args.global_batch_size is not None:  # the micro-batch count follows it (and dp, when a replay changes it)
        args = argparse.Namespace(**{**vars(args), "mbs": None})
    return dump_config(setup.parser, args, header=f"effective configuration of a {prog} run; "
                                                       f"replay: {launch} examples/{prog} --config FILE")


def _write_config(setup: Setup, path: Path) -> None:
    """The run file of the effective configuration (atomically)."""
    from braid.io.files import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, _config_text(setup))


def main(task: Task, argv: Sequence[str] | None = None, source: Any = None) -> int:
    """Entry point of the example scripts; returns the exit code (2 for bad flags, layouts or checkpoints, 1 for a failed run)."""
    from braid.runtime.distributed import CommTimeout, PeerFailure, PeerLost
    from braid.runtime.ending import end_run

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    joined = None
    try:
        if world > 1 and "RANK" in os.environ:
            from braid.runtime.store import join

            joined = join(rank, world)  # reach the store first: a rank that dies while preparing is then named at once
        setup = prepare(task, argv)  # every check that needs no process group: bad input ends here, on every rank
        if rank == 0 and setup.args.metrics:
            _write_config(setup, Path(setup.args.metrics).with_suffix(".toml"))
        stats, ref = run(task, setup, source, joined)
    except (RunError, CheckpointError, UsageError) as err:
        # 2 for bad input, 1 for a failed run (RunError, a save that could not be written)
        return end_run(f"{task.prog}: error: {err}", getattr(err, "exit_code", 2), rank, world)
    except (PeerFailure, CommTimeout) as err:
        # another rank failed first (its own report names it), was lost, or stayed silent: one line per job
        lost = err.lost if isinstance(err, PeerLost) else []
        return end_run(f"{task.prog}: error: {str(err).splitlines()[0]}", 1, rank, world, leaving=world - len(lost), lost=lost)
    except OSError as err:
        if err.filename is None:  # not a file's
            raise
        from braid.io.files import write_failure

        return end_run(f"{task.prog}: error: {write_failure(err)}", 1, rank, world)  # a full disk, a file size limit
    if ref is None:
        return 0
    dtype = compute_dtype(pick_device(setup.args))
    tol = reference_rtol(setup.args, dtype)
    ref_losses, ref_norms = ref
    bad = [f"{st.name} ({max_rel_diff(st.losses, ref_losses):.2e})" for st in stats.values() if max_rel_diff(st.losses, ref_losses) > tol]
    norm_tol = reference_norm_rtol(setup.args, dtype)
    bad_norm = [f"{st.name} ({max_norm_diff(st.grad_norms, ref_norms):.2e})" for st in stats.values()
                if (max_norm_diff(st.grad_norms, ref_norms) or 0.0) > norm_tol]
    if rank == 0:
        if bad:
            print(f"{task.prog}: losses differ from the unsplit model by more than {tol:.0e}: {', '.join(bad)}", file=sys.stderr, flush=True)
        if bad_norm:
            print(f"{task.prog}: gradient norms differ from the unsplit model by more than {norm_tol:.0e}: {', '.join(bad_norm)}",
                  file=sys.stderr, flush=True)
    return 1 if bad or bad_norm else 0
