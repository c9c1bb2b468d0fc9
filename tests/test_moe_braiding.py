"""A mixture-of-experts layer's all-to-alls as unit boundaries: the braid pattern and the simulator's all-to-all lane.

Table-1 style figures for expert parallelism, derived as the paper derives Table 1 for the TP
all-reduce. Uniform costs T_F = T_B = T_W = 1 per chunk, chunks of two MoE layers (ten units),
free P2P, ``ar_slowdown=1``, tp=1; ``T_A2A`` is the all-to-all time of one chunk per direction
(four all-to-alls of ``T_A2A/4``: each MoE layer's dispatch and combine, or their backwards),
0.25 here, so every unit (0.1) outlasts one all-to-all (0.0625):

* zb_v: every F and every split B waits for each of its all-to-alls: 4 m T_A2A per rank, exactly;
* 1f1b_i: every F exposes its all-to-alls (2 m T_A2A); a full backward (``BW``) runs each unit's
  weight gradient right after its activation gradient, so the W units hide its own: exactly 2 m T_A2A;
* braided_v: a braided block runs the other member's segment beside each all-to-all, and a ``BW``
  hides its own, so only the unbraided warm-up forwards expose theirs: exactly T_A2A per plain
  forward of the rank -- at most 2p T_A2A whatever m.
"""

from __future__ import annotations

import pytest

from braid import schedules
from braid.core.braiding import ChunkSpec, Comm, steps, unit_tasks
from braid.core.compiler import compile_plan
from braid.core.ir import Braided, Compute, OpKind
from braid.cost.costs import Layout, uniform_costs
from braid.simulator import simulate

T_A2A = 0.25
MOE_CHUNK = ChunkSpec(2, moe={0, 1})


def _simulated(name: str, p: int, m: int, record: bool = False, **extra: float):
    """``name`` at (p, m) on MoE chunks of uniform costs (``extra``: cost-file keys over the defaults)."""
    plan = schedules.build(name, p, m)
    specs = {(r, c): MOE_CHUNK for r in range(p) for c in range(plan.v)}
    costs = uniform_costs(Layout(1, p, plan.v, plan.placement), specs,
                          **{"T_F": 1.0, "T_B": 1.0, "T_W": 1.0, "T_AR": 0.0, "T_A2A": T_A2A, "T_P2P": 0.0, "ar_slowdown": 1.0,
                             **extra})
    return plan, simulate(compile_plan(plan), costs, name=name, record=record)


def _report(name: str, p: int, m: int):
    plan, res = _simulated(name, p, m)
    return plan, res.report


def test_an_moe_layer_is_cut_at_its_all_to_alls() -> None:
    f = [(t.unit.value, t.comm) for t in unit_tasks(OpKind.F, ChunkSpec(1, moe={0}))]
    assert f == [("pre_attn", None), ("attn", Comm.AR), ("pre_mlp", Comm.A2A), ("experts", Comm.A2A), ("mlp", Comm.AR)]
    b = [(t.unit.value, t.comm) for t in unit_tasks(OpKind.B, ChunkSpec(1, moe={0}))]
    assert b == [("mlp", Comm.A2A), ("experts", Comm.A2A), ("pre_mlp", Comm.AR), ("attn", None), ("pre_attn", Comm.AR)]
    assert all(t.comm is None for t in unit_tasks(OpKind.W, ChunkSpec(1, moe={0})))
    # a dense chunk's tasks are what they were: no experts, no all-to-all
    assert [t.unit.value for t in unit_tasks(OpKind.F, ChunkSpec(1))] == ["pre_attn", "attn", "pre_mlp", "mlp"]
    assert not any(t.comm is Comm.A2A for k in OpKind for t in unit_tasks(k, ChunkSpec(2)))


@pytest.mark.parametrize("p", [2, 4])
def test_braided_blocks_put_the_other_members_units_between_an_all_to_all_and_its_wait(p: int) -> None:
    """In every braided block of braided_v on MoE chunks, each all-to-all of a member is followed by a
    unit of the other member before the member's next unit (which waits for it)."""
    plan = schedules.build("braided_v", p, 3 * p)
    blocks = {ins for ops in plan.ranks for ins in ops if isinstance(ins, Braided)}
    assert blocks
    for ins in blocks:
        st = steps(ins, lambda c: MOE_CHUNK)
        a2a = [k for k, s in enumerate(st) if s.task.comm is Comm.A2A]
        assert a2a, ins
        for k in a2a:
            nxt = next(j for j in range(k + 1, len(st)) if st[j].member == st[k].member)
            assert any(st[j].member != st[k].member for j in range(k + 1, nxt)), (ins, st[k].task.label)


@pytest.mark.parametrize("p,m", [(2, 6), (2, 8), (4, 12), (4, 16)])
def test_exposed_all_to_all_of_1f1b_i_zb_v_and_braided_v(p: int, m: int) -> None:
    _, zbv = _report("zb_v", p, m)
    assert all(r.a2a_exposed_s == pytest.approx(4 * m * T_A2A, abs=1e-9) for r in zbv.ranks)
    _, i = _report("1f1b_i", p, m)
    assert all(r.a2a_exposed_s == pytest.approx(2 * m * T_A2A, abs=1e-9) for r in i.ranks)
    plan, bv = _report("braided_v", p, m)
    for r, ops in zip(bv.ranks, plan.ranks):
        plain_forwards = sum(isinstance(o, Compute) and o.kind is OpKind.F for o in ops)
        assert r.a2a_exposed_s == pytest.approx(plain_forwards * T_A2A, abs=1e-9)
        assert r.a2a_exposed_s <= 2 * p * T_A2A + 1e-9
    assert all(r.tp_exposed_s == 0.0 for rep in (zbv, i, bv) for r in rep.ranks)  # tp=1: the lanes are apart


def test_the_trace_puts_all_to_alls_on_their_own_lane() -> None:
    plan = schedules.build("braided_v", 2, 6)
    specs = {(r, c): MOE_CHUNK for r in range(2) for c in range(2)}
    costs = uniform_costs(Layout(1, 2, 2, "v"), specs, T_F=1.0, T_B=1.0, T_W=1.0, T_AR=0.0, T_A2A=T_A2A, T_P2P=0.0)
    trace = simulate(compile_plan(plan), costs, name="braided_v").trace
    a2a = [e for e in trace.events if e.kind == "A2A"]
    # every op's two all-to-alls per MoE layer (2 layers, F and B of 6 micro-batches on 2 chunks, 2 ranks)
    assert {e.lane for e in a2a} == {"ep-comm"} and len(a2a) == 2 * 2 * 2 * 6 * 2 * 2
    assert all(e.dur == pytest.approx(T_A2A / 4) for e in a2a)


def _trace(name: str, **extra: float):
    return _simulated(name, 2, 6, record=True, **extra)[1].trace


@pytest.mark.parametrize("k", [1.25, 2.0])
def test_compute_beside_an_all_to_all_is_slowed_by_a2a_slowdown(k: float) -> None:
    """Inside an in-flight all-to-all's window a unit runs ``a2a_slowdown`` times slower (the rest of it at
    full speed), whatever ``ar_slowdown`` says (braided_v runs the other member's units there)."""
    base, slow = _trace("braided_v"), _trace("braided_v", a2a_slowdown=k)

    def compute(trace):  # each rank's compute lane in its program's order (ranks interleave by time otherwise)
        return sorted((e for e in trace.events if e.lane == "compute"), key=lambda e: (e.rank, e.start))

    assert [(e.rank, e.name, e.unit) for e in compute(base)] == [(e.rank, e.name, e.unit) for e in compute(slow)]
    nominal = [e.dur for e in compute(base)]
    a2a = [e for e in slow.events if e.kind == "A2A"]
    beside = 0
    for e, dur in zip(compute(slow), nominal):
        ends = [x.start + x.dur for x in a2a if x.rank == e.rank and x.start <= e.start < x.start + x.dur]
        if not ends:
            assert e.dur == pytest.approx(dur, abs=1e-12)
            continue
        beside += 1
        win = max(ends) - e.start
        assert e.dur == pytest.approx(dur * k if win >= dur * k else win + dur - win / k, abs=1e-12)
    assert beside > 0
    # unset, an all-to-all slows compute as an all-reduce does (tp=1: no all-reduce of its own here)
    assert _trace("braided_v", ar_slowdown=k).events == slow.events


def test_a2a_slowdown_in_a_cost_file() -> None:
    from braid.cost.costs import CostFileError, costs_from_dict, costs_to_dict

    lay, specs = Layout(1, 2, 1, "loop"), {(r, 0): MOE_CHUNK for r in range(2)}
    one = dict(T_F=1.0, T_B=1.0, T_W=1.0, T_AR=0.0, T_A2A=T_A2A)
    assert "a2a_slowdown" not in costs_to_dict(costs_from_dict(one, lay, specs))  # unset: ar_slowdown serves both
    got = costs_from_dict(costs_to_dict(costs_from_dict({**one, "a2a_slowdown": 1.3}, lay, specs)), lay, specs)
    assert (got.a2a_slowdown, got.a2a_factor) == (1.3, 1.3)
    assert costs_from_dict({**one, "ar_slowdown": 1.2}, lay, specs).a2a_factor == 1.2
    with pytest.raises(CostFileError, match="a2a_slowdown"):
        costs_from_dict({**one, "a2a_slowdown": 0.5}, lay, specs)
