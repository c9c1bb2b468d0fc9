"""braid plans in torch.distributed.pipelining's schedule CSV format, both ways.

Exports are loaded by torch's own ``_PipelineScheduleRuntime._load_csv`` (which validates
the schedule and lowers it to send/recv actions); torch's multi-stage schedules
(``ScheduleDualPipeV``, ``ScheduleZBVZeroBubble``, ``ScheduleInterleaved1F1B``, ...) are
dumped by torch and imported, compiled and simulated by braid. torch builds its orders from
stage objects; a stand-in stage gives it the rank, stage index and group size it reads.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining import schedules as tsched
from torch.distributed.pipelining.stage import _PipelineStageBase

from braid import schedules
from braid.core.braiding import ChunkSpec
from braid.core.compiler import compile_plan
from braid.cost.costs import Layout, uniform_costs
from braid.core.ir import Braided, compute_ops
from braid.programs import main as programs_main
from braid.simulator import simulate
from braid.core.torch_format import TorchFormatError, from_torch_csv, to_torch_csv


class _Stage(_PipelineStageBase):
    """What torch's schedule constructors read from a stage, without a model or a process group."""

    def __init__(self, stage_index: int, num_stages: int, rank: int, group_size: int) -> None:
        self.stage_index, self.num_stages, self.group_rank, self.group_size = stage_index, num_stages, rank, group_size
        self.submod = torch.nn.Identity()
        self.stage_index_to_group_rank = {}

    def _create_grad_recv_info(self, *args, **kwargs):
        return ()

    def _prepare_forward_infra(self, *args, **kwargs):
        return ()

    def _prepare_backward_infra(self, *args, **kwargs):
        return ()

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


def _stages(stage_ids: list[int], num_stages: int, p: int) -> list[_Stage]:
    return [_Stage(s, num_stages, 0, p) for s in stage_ids]


def _loss(out, target):
    return out


def _torch_load(path, plan) -> tsched._PipelineScheduleRuntime:
    rt = tsched._PipelineScheduleRuntime(_stages([plan.stage_of(0, c) for c in range(plan.v)], plan.num_stages, plan.p),
                                         plan.m, loss_fn=_loss)
    rt._load_csv(str(path))  # validates and lowers to a schedule with send/recv actions
    return rt


def _sim(plan):
    specs = {(r, c): ChunkSpec(2) for r in range(plan.p) for c in range(plan.v)}
    costs = uniform_costs(Layout(2, plan.p, plan.v, plan.placement), specs, T_F=1.0, T_B=1.0, T_W=1.0, T_AR=0.25, T_P2P=0.0)
    return simulate(compile_plan(plan), costs, name=plan.name, record=False).report


# -- export -------------------------------------------------------------------------------
@pytest.mark.parametrize("p,m", [(2, 4), (2, 6), (4, 8), (4, 12)])
def test_every_registered_schedule_loads_in_torch_and_keeps_every_compute_action(tmp_path, p, m):
    for name in schedules.names():
        try:
            plan = schedules.build(name, p, m)
        except ValueError:
            continue  # a config the schedule does not serve
        path = tmp_path / f"{name}.csv"
        path.write_text(to_torch_csv(plan))
        rt = _torch_load(path, plan)
        for rank, instrs in enumerate(plan.ranks):
            got = []
            for a in rt.pipeline_order[rank]:
                got += [str(s) for s in a.sub_actions] if a.sub_actions else [str(a)]
            kind = {"F": "F", "B": "I", "W": "W", "BW": "B"}
            want = [f"{plan.stage_of(rank, op.chunk)}{kind[op.kind.value]}{op.mb}" for i in instrs for op in compute_ops(i)]
            assert got == want, f"{name} p={p} m={m} rank {rank}"
            blocks = sum(isinstance(i, Braided) for i in instrs)
            assert sum(a.computation_type == tsched.OVERLAP_F_B for a in rt.pipeline_order[rank]) == blocks
            assert any(a.computation_type == tsched.SEND_F for a in rt.pipeline_order_with_comms[rank]) or p == 1 or rank == p - 1 and plan.v == 1
        assert from_torch_csv(path.read_text(), name=name).ranks == plan.ranks  # and back, unchanged


def test_cli_writes_the_torch_csv(tmp_path, capsys):
    out = tmp_path / "braided_v.csv"
    assert programs_main(["braided_v", "--pp", "4", "--mbs", "12", "--format", "torch-csv", "-o", str(out)]) == 0
    plan = schedules.build("braided_v", 4, 12)
    assert out.read_text() == to_torch_csv(plan)
    assert out.read_text().splitlines()[0].startswith("0F0,0F1,")
    assert "(0F8;7W0)OVERLAP_F_B" in out.read_text()  # an F&W block on rank 0


# -- import -------------------------------------------------------------------------------
def _torch_order(cls, p: int, m: int, style: str, **kw) -> tuple[str, int]:
    v = 2
    stage_ids = [0, 2 * p - 1] if style == "v" else [0, p]
    sch = cls(_stages(stage_ids, v * p, p), m, loss_fn=_loss, **kw)
    return sch, v


@pytest.mark.parametrize("p,m", [(2, 4), (2, 6), (2, 8), (4, 8), (4, 12), (4, 16)])
def test_torch_dualpipev_imports_as_braids_dualpipe_v_and_simulates_to_the_same_makespan(tmp_path, p, m):
    sch, _ = _torch_order(tsched.ScheduleDualPipeV, p, m, "v")
    path = tmp_path / "dpv.csv"
    sch._dump_csv(str(path), format="compute_only")
    plan = from_torch_csv(path.read_text(), name="torch_dualpipev")
    ours = schedules.build("dualpipe_v", p, m)
    assert plan.placement == "v" and (plan.p, plan.m, plan.v) == (p, m, 2)
    assert plan.ranks == ours.ranks  # every overlapped pair is a cross-chunk braided block
    assert sum(isinstance(i, Braided) and i.cross_chunk for r in plan.ranks for i in r) > 0
    assert _sim(plan).step_time_s == pytest.approx(_sim(ours).step_time_s, abs=1e-12)


@pytest.mark.parametrize("cls,style", [(tsched.ScheduleZBVZeroBubble, "v"), (tsched.ScheduleInterleaved1F1B, "loop"),
                                       (tsched.ScheduleInterleavedZeroBubble, "loop"), (tsched.ScheduleLoopedBFS, "loop")])
@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8), (4, 12)])
def test_torch_multi_stage_schedules_import_compile_and_simulate(tmp_path, cls, style, p, m):
    sch, v = _torch_order(cls, p, m, style)
    path = tmp_path / "torch.csv"
    sch._dump_csv(str(path), format="compute_only")
    plan = from_torch_csv(path.read_text(), name=cls.__name__)
    assert plan.placement == style and (plan.p, plan.m, plan.v) == (p, m, v)
    n_torch = sum(len(a.sub_actions) if a.sub_actions else 1 for r in sch.pipeline_order.values() for a in r if a is not None)
    assert sum(len(compute_ops(i)) for r in plan.ranks for i in r) == n_torch
    report = _sim(plan)  # compiles (validates) and simulates without deadlock
    assert report.step_time_s > 0
    assert to_torch_csv(plan).splitlines() == [",".join(str(a) for a in row if a is not None)
                                               for row in sch.pipeline_order.values()]


def test_simulate_cli_runs_a_torch_csv_beside_braids_schedule(tmp_path, capsys):
    import json

    from braid.simulate import main as simulate_main

    sch, _ = _torch_order(tsched.ScheduleDualPipeV, 2, 6, "v")
    csv_path, costs, out = tmp_path / "torch_dpv.csv", tmp_path / "u.json", tmp_path / "r.json"
    sch._dump_csv(str(csv_path), format="compute_only")
    costs.write_text(json.dumps({"format": "braid-costs/1", "T_F": 1, "T_B": 1, "T_W": 1, "T_AR": 0.25, "T_P2P": 0}))
    argv = ["--pp", "2", "--mbs", "6", "--model", "qwen2-small", "--costs", str(costs), "--schedule", "dualpipe_v",
            "--torch-csv", str(csv_path), "--json", str(out), "--braid", "all"]  # torch's order, with its blocks
    assert simulate_main(argv) == 0
    rep = json.loads(out.read_text())["schedules"]
    assert rep["torch_dpv"]["step_time_s"] == pytest.approx(rep["dualpipe_v"]["step_time_s"], abs=1e-12)
    with pytest.raises(SystemExit) as e:  # p and m come from the file; a mismatch is one line
        simulate_main(["--pp", "4", "--mbs", "6", "--torch-csv", str(csv_path)])
    assert e.value.code == 2 and "pass --pp 2 --mbs 6" in capsys.readouterr().err


def test_torch_zbv_matches_braids_zb_v():
    sch, _ = _torch_order(tsched.ScheduleZBVZeroBubble, 4, 12, "v")
    rows = [[str(a) for a in row if a is not None] for row in sch.pipeline_order.values()]
    from braid.core.torch_format import from_torch_rows

    assert from_torch_rows(rows).ranks == schedules.build("zb_v", 4, 12).ranks


@pytest.mark.parametrize("text, message", [
    ("0F0,0SEND_F0\n1RECV_F0,1F0", r"rank 0, step 1: cannot read '0SEND_F0'.*compute_only"),
    ("0F0,1F0\n2F0,3F0\n", "neither braid.s loop placement"),
    ("", "no rows"),
    ("(0F0;0B0;0W0)OVERLAP_F_B", "two sub-actions"),
])
def test_unreadable_torch_csv_says_why(text, message):
    with pytest.raises(TorchFormatError, match=message):
        from_torch_csv(text)
