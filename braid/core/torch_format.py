"""Plans in torch.distributed.pipelining's schedule CSV format, both ways.

torch's ``_PipelineScheduleRuntime`` reads a *compute-only* schedule from a CSV file
(``_load_csv``): one row per pipeline rank, one cell per action, written as
``_Action.__repr__`` writes it and read back with ``_Action.from_str``::

    0F3        forward of micro-batch 3 on (global) stage 0
    7I3        activation-gradient backward ("backward input") -- braid's B
    7W3        its weight gradient -- braid's W
    7B3        full backward -- braid's BW
    (0F7;7B3)OVERLAP_F_B   two actions run as one overlapped pair -- braid's braided block

torch numbers stages globally; braid names a rank's *local* chunk, and the plan's placement
maps one to the other (``loop``: rank r holds stages r, r+p, ...; ``v``: stages r and
2p-1-r). An empty cell is an idle step and is skipped. torch runs an overlap action's
sub-actions one after the other, so every braided block (F&F, F&W, F&B, F&BW, cross-chunk
or not) exports as one; braid imports an overlap pair as a braided block when braid can
braid it (a forward first, see :data:`braid.core.ir.BRAIDABLE`) and as consecutive ops otherwise.

The module is text only (no torch import): the exported file is what torch's loader reads,
and a file torch wrote (``schedule._dump_csv(path, format="compute_only")``, e.g. from
``ScheduleDualPipeV``) becomes a braid :class:`~braid.core.ir.Plan` that compiles and simulates.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from typing import Sequence


from braid.core.ir import BRAIDABLE, Braided, Compute, ComputeInstr, OpKind, Placement, Plan, ScheduleConfig, rank_chunk_of

# braid op kind <-> torch computation type
_TO_TORCH = {OpKind.F: "F", OpKind.B: "I", OpKind.W: "W", OpKind.BW: "B"}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}
_RE_ACTION = re.compile(r"^(\d+)(F|I|B|W)(\d+)$")
_RE_OVERLAP = re.compile(r"^\((.*)\)OVERLAP_F_B$")
OVERLAP = "OVERLAP_F_B"


class TorchFormatError(ValueError):
    """A torch schedule CSV braid cannot read; the message names the rank, the step and the cell."""


def _action(plan: Plan, rank: int, op: Compute) -> str:
    return f"{plan.stage_of(rank, op.chunk)}{_TO_TORCH[op.kind]}{op.mb}"


def to_torch_rows(plan: Plan) -> list[list[str]]:
    """One row of torch ``_Action`` strings per rank, in the plan's order."""
    rows = []
    for rank, instrs in enumerate(plan.ranks):
        row = []
        for ins in instrs:
            if isinstance(ins, Braided):
                row.append(f"({_action(plan, rank, ins.first)};{_action(plan, rank, ins.second)}){OVERLAP}")
            else:
                row.append(_action(plan, rank, ins))
        rows.append(row)
    return rows


def to_torch_csv(plan: Plan) -> str:
    """The plan as torch's compute-only schedule CSV (what ``_PipelineScheduleRuntime._load_csv`` reads)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for row in to_torch_rows(plan):
        writer.writerow(row)
    return buf.getvalue()


def _parse_action(text: str, rank: int, step: int) -> tuple[int, OpKind, int]:
    m = _RE_ACTION.match(text.strip())
    if m is None:
        raise TorchFormatError(
            f"rank {rank}, step {step}: cannot read {text!r}: expected a compute action such as 0F3, 7I3, 7W3, 7B3 "
            "or (0F7;7B3)OVERLAP_F_B (export the schedule with format='compute_only')")
    return int(m[1]), _FROM_TORCH[m[2]], int(m[3])


def _placement(stages_of: list[set[int]], p: int, num_stages: int) -> Placement:
    for placement in ("loop", "v"):
        if placement == "v" and num_stages != 2 * p:
            continue
        if all(rank_chunk_of(placement, p, s)[0] == r for r, stages in enumerate(stages_of) for s in stages):
            return placement  # type: ignore[return-value]
    raise TorchFormatError(
        "the stage-to-rank mapping is neither braid's loop placement (rank r holds stages r, r+p, ...) nor its "
        f"V placement (rank r holds stages r and 2p-1-r): {[sorted(s) for s in stages_of]}")


@dataclass(frozen=True, slots=True)
class PlanLimits:
    """The largest plan a schedule file may describe (the command lines pass braid.io.limits' values)."""

    ranks: int
    micro_batches: int
    product: int  # ranks x micro-batches: the programs grow as their product
    stages_per_rank: int


def from_torch_rows(rows: Sequence[Sequence[str]], name: str = "torch", limits: PlanLimits | None = None) -> Plan:
    """A braid plan from torch compute-only action rows (one per rank; empty cells are idle steps), within
    ``limits`` when given."""
    p = len(rows)
    if p == 0:
        raise TorchFormatError("the schedule has no rows (one row per pipeline rank expected)")
    parsed: list[list[list[tuple[int, OpKind, int]]]] = []  # rank -> step -> actions (2 for an overlap)
    for rank, row in enumerate(rows):
        steps = []
        for step, cell in enumerate(row):
            cell = cell.strip()
            if not cell:
                continue
            if m := _RE_OVERLAP.match(cell):
                subs = [s for s in m[1].split(";") if s.strip()]
                if len(subs) != 2:
                    raise TorchFormatError(f"rank {rank}, step {step}: {cell!r}: braid reads overlap actions of two sub-actions")
                steps.append([_parse_action(s, rank, step) for s in subs])
            else:
                steps.append([_parse_action(cell, rank, step)])
        parsed.append(steps)
    acts = [a for steps in parsed for step in steps for a in step]
    if not acts:
        raise TorchFormatError("the schedule has no compute actions")
    num_stages = max(s for s, _, _ in acts) + 1
    m = max(mb for _, _, mb in acts) + 1
    if limits is not None and (m > limits.micro_batches or p * m > limits.product):
        raise TorchFormatError(f"{p} ranks x {m:,} micro-batches: at most {limits.micro_batches:,} micro-batches and "
                               f"{limits.product:,} in product (the programs grow as their product)")
    if limits is not None and num_stages > limits.stages_per_rank * p:
        raise TorchFormatError(f"stage {num_stages - 1:,} on {p} ranks: at most {limits.stages_per_rank} stages per rank")
    if num_stages % p:
        raise TorchFormatError(f"{num_stages} stages do not divide over {p} ranks")
    stages_of = [{s for step in steps for s, _, _ in step} for steps in parsed]
    placement = _placement(stages_of, p, num_stages)
    ranks: list[list[ComputeInstr]] = []
    for rank, steps in enumerate(parsed):
        out: list[ComputeInstr] = []
        for step in steps:
            ops = [Compute(kind, mb, rank_chunk_of(placement, p, stage)[1]) for stage, kind, mb in step]
            if len(ops) == 2 and (ops[0].kind, ops[1].kind) not in BRAIDABLE and (ops[1].kind, ops[0].kind) in BRAIDABLE:
                ops.reverse()  # braid names the forward first
            if len(ops) == 2 and (ops[0].kind, ops[1].kind) in BRAIDABLE:
                try:
                    out.append(Braided(ops[0], ops[1]))
                    continue
                except ValueError:
                    pass  # e.g. a same-chunk pair with the backward later: run one after the other
            out.extend(ops)
        ranks.append(out)
    cfg = ScheduleConfig(p, m, num_stages // p)
    return Plan(name, cfg, placement, tuple(tuple(r) for r in ranks))


def from_torch_csv(text: str, name: str = "torch", limits: PlanLimits | None = None) -> Plan:
    """A braid plan from the text of a torch compute-only schedule CSV; with ``limits``, at most
    ``limits.ranks`` rows, counted before they are parsed."""
    if limits is not None:
        rows = len(text.splitlines()) if text.count("\n") <= limits.ranks + 1 else text.count("\n")
        if rows > limits.ranks:
            raise TorchFormatError(f"{rows:,} rows: at most {limits.ranks} (one row per pipeline rank)")
    return from_torch_rows(list(csv.reader(io.StringIO(text))), name=name, limits=limits)
