"""What every braid command line shares: one line and exit code 2 for bad input, output
paths checked before the work, quiet ends when the reader of stdout goes away.

* :class:`Parser` -- an ``argparse`` parser whose errors are one line
  (``prog: error: ...``, exit 2) instead of the usage block.
* :func:`check_outputs` -- :func:`braid.io.files.check_output_path` on every output argument
  before any work; a bad one is a parser error.
* ``--sequence-parallel`` (:func:`add_seq_shard_arg`, :func:`resolve_seq_shard`) -- where
  sequence parallelism inside TP (:mod:`braid.tp.seq_shard`) runs, and one-line refusals where
  it does not (also read by the chunk builder and the cost model).
* :func:`run_main` -- runs a ``main(argv) -> int`` so that ``python -m braid.programs ... |
  head`` ends quietly (exit 0) instead of in a ``BrokenPipeError`` traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from braid.io.files import OutputPathError, check_output_path
from braid.io.limits import MAX_LAYERS, MAX_MBS, MAX_PM, MAX_PP, count_error


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def check_outputs(ap: argparse.ArgumentParser, outputs: Sequence[tuple[str, str | os.PathLike | None]],
                  inputs: Sequence[str | os.PathLike] = ()) -> None:
    """Check each ``(flag, path)`` output that is set (and that no two are the same file);
    the first bad one is a parser error (one line, exit 2)."""
    seen: dict[str, str] = {}
    for flag, path in outputs:
        if path is None:
            continue
        try:
            p = check_output_path(path, what=flag, inputs=tuple(inputs))
        except OutputPathError as err:
            ap.error(str(err))
        key = os.path.realpath(p)
        if key in seen:
            ap.error(f"{flag} and {seen[key]} name the same file {str(path)!r}; give each its own")
        seen[key] = flag


def check_output_dir(ap: argparse.ArgumentParser, flag: str, path: str | os.PathLike | None) -> None:
    """A parser error unless ``path`` (when given) is a directory that exists or can be created."""
    if path is None:
        return
    d = Path(path)
    if d.exists() and not d.is_dir():
        ap.error(f"{flag} {str(path)!r} exists and is not a directory")
    ancestor = d
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not os.access(ancestor if str(ancestor) else ".", os.W_OK | os.X_OK):
        ap.error(f"{flag} {str(path)!r}: directory {str(ancestor)!r} is not writable")


def layer_count(text: str) -> int | float:
    """``"2"`` -> 2, ``"1.5"`` -> 1.5: a whole or half number of layers in ``[0, MAX_LAYERS]`` (``argparse.ArgumentTypeError``
    otherwise, so argparse prints the message; an argparse ``type``). A half cuts a layer between attention and MLP (:func:`braid.core.partition.stage_halves`)."""
    try:
        n = float(text)
    except ValueError:
        n = math.nan
    if math.isfinite(n) and n > MAX_LAYERS:
        raise argparse.ArgumentTypeError(f"{text}: at most {MAX_LAYERS} layers (more than any real model)")
    if not math.isfinite(n) or n < 0 or n * 2 != int(n * 2):
        raise argparse.ArgumentTypeError(f"not a whole or half number of layers >= 0: {text!r}")
    return int(n) if n == int(n) else n


def check_range(ap: argparse.ArgumentParser, flag: str, value: float | None, lo: float | None = None,
                hi: float | None = None, *, what: str = "a number") -> None:
    """A parser error unless ``value`` (when given) is finite and in ``[lo, hi]``."""
    if value is None:
        return
    ok = value == value and value not in (float("inf"), float("-inf"))
    ok = ok and (lo is None or value >= lo) and (hi is None or value <= hi)
    if not ok:
        bounds = f">= {lo:g}" if hi is None else f"<= {hi:g}" if lo is None else f"in [{lo:g}, {hi:g}]"
        ap.error(f"{flag} must be {what} {bounds}, got {value:g}")


def check_counts(ap: argparse.ArgumentParser, args: argparse.Namespace, names: Sequence[str],
                 at_least_zero: Sequence[str] = ()) -> None:
    """A parser error (one line, exit 2) for the first count flag of ``names`` (``args`` attributes) that is
    below 1 (below 0 for those in ``at_least_zero``) or above its bound in :data:`braid.io.limits.COUNT_LIMITS`."""
    for name in names:
        value = getattr(args, name, None)
        for v in value if isinstance(value, list) else [value]:
            why = count_error(name, v, low=0 if name in at_least_zero else 1)
            if why:
                ap.error(why)


def check_plan_size(ap: argparse.ArgumentParser, pp: int | None, mbs: int | None) -> None:
    """A parser error (one line, exit 2) for a ``--pp`` / ``--mbs`` beyond what compiles in seconds."""
    if pp is not None and pp > MAX_PP:
        ap.error(f"--pp {pp}: at most {MAX_PP} pipeline ranks (each rank needs a layer of its own, and the programs "
                 f"grow as pp x mbs)")
    if mbs is not None and mbs > MAX_MBS:
        ap.error(f"--mbs {mbs}: at most {MAX_MBS} micro-batches per step (the programs grow as pp x mbs)")
    if pp is not None and mbs is not None and pp * mbs > MAX_PM:
        ap.error(f"--pp {pp} x --mbs {mbs} = {pp * mbs:,} micro-batch stages: at most {MAX_PM:,} (the programs grow as "
                 f"pp x mbs and would take minutes to compile); lower --mbs")


MAX_CPU_RANKS = 64  # gloo processes a CPU run spawns (one per rank): beyond this a spawn only exhausts the machine


def check_cpu_ranks(ap: argparse.ArgumentParser, world: int, what: str = "tp x pp") -> None:
    """A parser error for a CPU run that would spawn more than :data:`MAX_CPU_RANKS` processes (``what``: the degrees
    whose product ``world`` is)."""
    if world > MAX_CPU_RANKS:
        ap.error(f"{what} = {world} ranks on the CPU: at most {MAX_CPU_RANKS} processes (one per rank); lower "
                 + "/".join(f"--{d.strip()}" for d in what.split(" x ")))


# Where sequence sharding does not run, in one line each (the command lines refuse with these).
NO_SEQ_SHARD_WITH_CP = ("--sequence-parallel shards the sequence over the TP group and --cp > 1's 2D-Attention over its own "
                        "group; the two are not combined: leave --sequence-parallel out (or add --no-sequence-parallel)")
NO_SEQ_SHARD_VISION = ("--sequence-parallel covers the decoder LM's units; the vision tower and its merger keep whole "
                       "sequences under TP: leave --sequence-parallel out (or add --no-sequence-parallel) for a vision-language model")


class SeqShardError(ValueError):
    """A sequence that the TP group cannot shard, or a layout sequence sharding does not cover."""


def check_seq(seq: int, tp: int) -> None:
    """Refuse a sequence length that ``tp`` ranks cannot split evenly."""
    if tp > 1 and seq % tp:
        raise SeqShardError(seq_shard_refusal(tp, seq=seq)[1])


def local_seq(seq: int, tp: int, on: bool) -> int:
    """Tokens of a sequence of ``seq`` that one TP rank holds between units (all of them when off)."""
    if not on or tp == 1:
        return seq
    check_seq(seq, tp)
    return seq // tp


SEQ_SHARD_HELP = ("sequence parallelism inside tensor parallelism (Megatron's; not --cp): reduce-scatter and all-gather "
                  "over the sequence where TP all-reduces, norms and residual on s/t tokens, a layer's activations "
                  "34/t instead of 10 + 24/t bytes per s*b*h. Default: on at --tp > 1 where it runs (a decoder LM, --cp 1, "
                  "a sequence --tp divides; elsewhere off, and the run says why). On 2 H200s at tp=2 its graphed step is "
                  "level with or faster than the unsharded one and its activation peak 0.84-0.87x; an eager step "
                  "(--cuda-graph none) is host-bound and slower with it")


def add_seq_shard_arg(ap: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--sequence-parallel`` / ``--no-sequence-parallel`` (default None: :func:`resolve_seq_shard` decides)."""
    ap.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None, help=SEQ_SHARD_HELP)


def seq_shard_refusal(tp: int, *, seq: int | None = None, cp: int = 1, vision: bool = False) -> tuple[str, str] | None:
    """Why sequence parallelism inside TP does not run at this layout -- (the reason, the one-line refusal
    of ``--sequence-parallel``) -- or None where it does (or tp = 1, where it has no effect)."""
    if tp == 1:
        return None
    if cp > 1:
        return "--cp > 1 shards the sequence over its own group (2D-Attention)", NO_SEQ_SHARD_WITH_CP
    if vision:
        return "the vision tower and its merger keep whole sequences under TP", NO_SEQ_SHARD_VISION
    if seq is not None and seq % tp:
        return (f"sequence length {seq} is not divisible by tp={tp}",
                f"--sequence-parallel: sequence length {seq} is not divisible by tp={tp}; "
                "pick a --seq divisible by tp or use --no-sequence-parallel")
    return None


# An MoE model at tp > 1 steps eagerly (its routing counts are read on the host: braid.runtime.graphs), and an
# eager step is host-bound: sequence parallelism's added launches (a reduce-scatter, the norm on the rank's
# tokens, an all-gather where one all-reduce was) made a dense one 1.4x slower (sp_tp2_pp1_h100_eager_host.txt).
MOE_SEQ_SHARD_EAGER = "an MoE model at tp > 1 steps eagerly (host-bound), where its added launches cost more than it saves"


def resolve_seq_shard(flag: bool | None, tp: int, *, seq: int | None = None, cp: int = 1, vision: bool = False,
                      moe: bool = False, note: Callable[[str], None] | None = None) -> bool:
    """Whether a run shards the sequence over TP (:mod:`braid.tp.seq_shard`). None (not asked for) is on at
    ``tp > 1`` where it runs, and off where it does not (``cp > 1``, ``vision``, a ``seq`` that ``tp`` does
    not divide) or an MoE model's eager step would pay for it (:data:`MOE_SEQ_SHARD_EAGER`), the reason passed
    to ``note`` in one line. It matches the single-process model (gloo and NCCL, eager and graphed, dense and
    MoE); on 2 H200s at tp=2 a graphed step with it is level with or faster than without, its activation peak
    0.84-0.87x (benchmarks/results/sp_tp2_pp1_h200x2_r5.txt). ``True`` where it cannot run raises
    :class:`SeqShardError`, a one-line refusal; ``False`` is off."""
    if flag is False or tp == 1:
        return False
    why = seq_shard_refusal(tp, seq=seq, cp=cp, vision=vision)
    if why is None and moe and flag is None:
        why = (MOE_SEQ_SHARD_EAGER, "")
    if why is None:
        return True
    if flag:
        raise SeqShardError(why[1])
    if note is not None:
        note(f"sequence parallelism inside TP off: {why[0]}")
    return False


# --moe-dispatch: braid.runtime.expert_parallel's AllToAllDispatch, PaddedAllToAllDispatch
MOE_DISPATCHERS: tuple[str, ...] = ("splits", "padded")
MOE_DISPATCH_HELP = ("how --ep's all-to-alls move the rows: 'splits' sends each peer exactly its rows (their counts read on "
                     "the host every MoE layer: the step runs eager), 'padded' a block of T*min(k, E/ep) rows, zeros after "
                     "the real ones (nothing read on the host: the step can be a CUDA graph; ep times the rows on the wire "
                     "and in the experts' buffers; tp=1) (default: splits)")


def check_moe_dispatch(name: str, *, ep: int, tp: int = 1) -> None:
    """``ValueError`` (one line) unless ``name`` is one of :data:`MOE_DISPATCHERS` and runs at this layout."""
    if name not in MOE_DISPATCHERS:
        raise ValueError(f"--moe-dispatch {name}: unknown; valid: {', '.join(MOE_DISPATCHERS)}")
    if name == "padded" and ep < 2:
        raise ValueError(f"--moe-dispatch padded pads expert parallelism's all-to-all; it needs --ep 2 or more (got --ep {ep})")
    if name == "padded" and tp > 1:
        raise ValueError(f"--moe-dispatch padded runs at tp=1 only (the TP slice of the experts reads its rows on the host); "
                         f"got --tp {tp}")


def add_moe_dispatch_arg(ap: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--moe-dispatch`` (one help text for every command line; checked by :func:`check_moe_dispatch`)."""
    ap.add_argument("--moe-dispatch", default="splits", metavar="{splits,padded}", help=MOE_DISPATCH_HELP)


def run_main(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """``main(argv)``, with a closed stdout (``| head``) ending the command quietly, exit 0."""
    try:
        rc = main(argv)
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        # Python flushes stdout again at exit; point it at /dev/null so that flush is silent.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
