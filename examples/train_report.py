"""What the example loop reports: the progress line, the comparison table, the merged trace.

Rank 0 reports; :func:`write_trace` gathers every rank's measured trace of the last step
and merges them into one file (events and memory keyed by global rank).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from train_cli import Setup, Task
from train_step import peak_flops, pick_device

log = logging.getLogger("braid.examples")


@dataclass
class RunStats:
    """What one schedule's run measured: per-step losses and times, peak memory per rank (bytes, 0 = not measured)."""

    name: str
    losses: list[float]
    step_times: list[float]
    peak_bytes: list[int]
    grad_norms: list[float | None] = field(default_factory=list)  # before clipping; None where not measured


class Progress:
    """Rank 0's progress: a carriage-return bar on a terminal, plain log lines otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.tty = enabled and sys.stderr.isatty()

    def update(self, step: int, line: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            done = int(30 * step / self.total)
            sys.stderr.write(f"\r\033[K{line}\n[{'#' * done}{'.' * (30 - done)}] {step}/{self.total}")
            sys.stderr.flush()
        else:
            log.info(line)

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")



def reference_rtol(args: argparse.Namespace, dtype: torch.dtype) -> float:
    """``--reference-rtol``, or the default for the dtype."""
    if args.reference_rtol is not None:
        return args.reference_rtol
    return 2e-2 if dtype == torch.bfloat16 else 1e-4


def max_rel_diff(losses: Sequence[float], ref: Sequence[float]) -> float:
    """The largest per-step relative difference of ``losses`` from ``ref``."""
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref))


def max_norm_diff(norms: Sequence[float | None], ref: Sequence[float]) -> float | None:
    """The largest per-step relative difference of the gradient norms from the reference's (None: not measured)."""
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(norms, ref) if a is not None]
    return max(diffs) if diffs else None


def format_comparison(task: Task, setup: Setup, stats: dict[str, RunStats], ref: tuple[list[float], list[float]] | None,
                      dtype: torch.dtype) -> str:
    """The side-by-side table: throughput, MFU, peak memory per rank, losses and gradient norms vs the unsplit model."""
    args = setup.args
    device = pick_device(args)
    seq = task.seq_len(setup.model, args)
    per_step = args.dp * args.mbs * args.micro_batch_size
    flops = task.flops_per_sample(setup.model, args)
    peak = peak_flops(args, device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    lines = [f"# {task.prog} --model {args.model}: tp={args.tp} pp={args.pp} dp={args.dp} m={args.mbs} "
             f"micro-batch {args.micro_batch_size} x {seq} tokens, {args.steps} steps on {setup.world} x {where} "
             f"({str(dtype).replace('torch.', '')}); step time = median after the first step"]
    head = f"{'schedule':<18} {'step ms':>9} {'tokens/s':>11} {'MFU':>6} {'last loss':>10}"
    if ref is not None:
        head += f" {'max rel diff':>13} {'norm diff':>10}"
    lines += [head + "  peak MiB per rank", "-" * (len(head) + 40)]
    for st in stats.values():
        times = st.step_times[1:] or st.step_times
        dt = statistics.median(times)
        tok = per_step * seq / dt
        mfu = f"{flops * per_step / dt / (setup.world * peak):6.3f}" if peak else f"{'-':>6}"
        row = f"{st.name:<18} {dt * 1e3:9.1f} {tok:11,.0f} {mfu} {st.losses[-1]:10.4f}"
        if ref is not None:
            nd = max_norm_diff(st.grad_norms, ref[1])
            row += f" {max_rel_diff(st.losses, ref[0]):13.2e} {'-' if nd is None else f'{nd:.2e}':>10}"
        mem = " ".join(f"{b / 2**20:,.1f}" if b else "-" for b in st.peak_bytes)
        lines.append(f"{row}  {mem}")
    if ref is not None:
        lines.append(f"reference (unsplit model on one device): last loss {ref[0][-1]:.4f}; tolerance {reference_rtol(args, dtype):.0e} "
                     "relative, for losses and gradient norms (- : not measured)")
    return "\n".join(lines)

def write_trace(trace: Any, rank: int, world: int, args: argparse.Namespace) -> None:
    """Gather every rank's trace to rank 0 and merge them (events and memory keyed by global rank)."""
    import torch.distributed as dist

    from braid.trace import Trace, dump_traces

    d = trace.to_dict()
    for e in d["events"]:
        e["rank"] = rank
    d["memory"] = {str(rank): s for s in d["memory"].values()}
    got: list[Any] = [None] * world if rank == 0 else None
    dist.gather_object(d, got, dst=0)
    if rank != 0:
        return
    merged = Trace.from_dict({"meta": {**got[0]["meta"], "rank": None, "ranks": world, "tp": args.tp, "pp": args.pp, "dp": args.dp},
                              "events": [e for t in got for e in t["events"]],
                              "memory": {r: s for t in got for r, s in t["memory"].items()}})
    dump_traces([merged], args.trace)
    log.info("trace of the last step: %s (%d events, %d ranks)", args.trace, len(merged.events), world)

