"""Simulator semantics and conformance with the paper's Table 1 (DESIGN.md).

Uniform costs T_F = T_B = T_W = 1, free P2P, ``ar_slowdown=1`` (so the exposed all-reduce
time is exactly the compute stream's wait), chunks of two layers. Figures are per rank;
"max" means the worst rank.
"""

from __future__ import annotations

import pytest

from braid import schedules
from braid.core.braiding import ChunkSpec
from braid.core.compiler import compile_plan
from braid.cost.costs import Layout, uniform_costs
from braid.core.ir import OpKind, Program, compute_ops
from braid.core.offload import RELEASE_AFTER
from braid.io.trace import LANES, Trace
from braid.simulator import SimulationError, simulate

TF = TB = TW = 1.0


def _run(name: str, p: int, m: int, t_ar: float, slowdown: float = 1.0, tp: int = 2):
    plan = schedules.build(name, p, m)
    progs = compile_plan(plan)
    specs = {(r, c): ChunkSpec(2) for r in range(p) for c in range(plan.v)}
    costs = uniform_costs(Layout(tp, p, plan.v, plan.placement), specs, T_F=TF, T_B=TB, T_W=TW, T_AR=t_ar,
                          T_P2P=0.0, ar_slowdown=slowdown)
    return progs, simulate(progs, costs, name=name, record=False).report


# -- exposed TP comm (Table 1, column 2) ------------------------------------------------
@pytest.mark.parametrize("p,m", [(3, 6), (4, 8), (4, 12), (6, 12)])
def test_exposed_tp_of_1f1b_i_and_zb_v_match_table1_exactly(p, m):
    t_ar = 0.25
    _, r = _run("1f1b_i", p, m, t_ar)
    assert all(x.tp_exposed_s == pytest.approx(2 * m * t_ar, abs=1e-9) for x in r.ranks)  # every F exposes T_AR
    _, r = _run("zb_v", p, m, t_ar)
    assert all(x.tp_exposed_s == pytest.approx(4 * m * t_ar, abs=1e-9) for x in r.ranks)  # F and split B expose


_TARGET_POINTS = [(p, m, t_ar) for t_ar in (0.25, 0.5) for p in (2, 4, 8) for m in (3 * p, 4 * p)]


@pytest.mark.parametrize("p,t_ar", [(p, t) for t in (0.25, 0.5) for p in (2, 3, 4, 6, 8)])
def test_exposed_tp_of_braided_v_is_constant_in_m_and_at_most_2p_plus_1(p, t_ar):
    exposed = [_run("braided_v", p, m, t_ar)[1].max_tp_exposed_s for m in (3 * p, 4 * p)]
    # Only the unbraided warm-up forwards expose all-reduces (every braided block's trailing
    # one is carried into the next instruction), so more micro-batches add none.
    assert exposed[0] == pytest.approx(exposed[1], abs=1e-9)
    assert exposed[0] <= (2 * p + 1) * t_ar + 1e-9


def test_only_warm_up_forwards_expose_allreduces_in_braided_v(monkeypatch):
    from braid.simulator import engine

    exposed_by: dict[str, float] = {}
    compute = engine.Engine._compute

    def counting(self, rs, instr, idx):
        before = rs.stats.tp_exposed_s
        compute(self, rs, instr, idx)
        exposed_by[str(instr)] = exposed_by.get(str(instr), 0.0) + rs.stats.tp_exposed_s - before

    hoisted = engine.Engine._hoisted

    def counting_hoisted(self, rs):  # the wait for a carried all-reduce after the next first unit
        before, into = rs.stats.tp_exposed_s, rs.hoist[0]
        ok = hoisted(self, rs)
        exposed_by[str(rs.prog[into])] = exposed_by.get(str(rs.prog[into]), 0.0) + rs.stats.tp_exposed_s - before
        return ok

    monkeypatch.setattr(engine.Engine, "_compute", counting)
    monkeypatch.setattr(engine.Engine, "_hoisted", counting_hoisted)
    _run("braided_v", 4, 12, 0.25)
    exposing = {k for k, v in exposed_by.items() if v > 1e-9}
    assert any(k.startswith("F") and "&" not in k for k in exposing)  # the warm-up forwards
    braided = {k for k in exposing if "&" in k}
    # rank 0's first F&F block: its first unit waits for the last warm-up forward's all-reduce
    assert braided == {"F7c0&F0c1"}, braided


@pytest.mark.parametrize("p,m,t_ar", _TARGET_POINTS)
def test_table1_exposed_tp_holds_exactly_for_1f1b_i_and_zb_v_at_p_2_4_8(p, m, t_ar):
    for name, per_mb in (("1f1b_i", 2), ("zb_v", 4)):
        r = _run(name, p, m, t_ar)[1]
        assert all(x.tp_exposed_s == pytest.approx(per_mb * m * t_ar, abs=1e-9) for x in r.ranks), name


@pytest.mark.parametrize("p,m,t_ar", _TARGET_POINTS)
def test_dualpipe_v_cross_chunk_blocks_hide_at_least_half_of_zb_v_tp_comm(p, m, t_ar):
    dual = _run("dualpipe_v", p, m, t_ar)[1].max_tp_exposed_s
    zbv = _run("zb_v", p, m, t_ar)[1].max_tp_exposed_s
    assert dual <= zbv / 2 + 1e-9


@pytest.mark.parametrize("p,m,t_ar", _TARGET_POINTS)
def test_carried_allreduces_never_lengthen_braided_v_nor_expose_more(monkeypatch, p, m, t_ar):
    from braid.simulator import engine

    progs, with_carry = _run("braided_v", p, m, t_ar)
    assert any(engine.carries(prog.instructions, lambda c: ChunkSpec(2)) for prog in progs)  # the rule fires
    monkeypatch.setattr(engine, "carries", lambda instructions, spec_of: {})
    without = _run("braided_v", p, m, t_ar)[1]
    assert with_carry.step_time_s <= without.step_time_s + 1e-9
    assert all(a.tp_exposed_s <= b.tp_exposed_s + 1e-9 for a, b in zip(with_carry.ranks, without.ranks))


@pytest.mark.parametrize("p,m,t_ar", _TARGET_POINTS)
def test_braided_v_on_a_12b_partition_exposes_at_most_2p_plus_1_allreduces(p, m, t_ar):
    # Uniform times on the 12B model's partition (3-7 layers a chunk, embedding and head on
    # rank 0), as `python -m braid.simulate --costs` runs them.
    from braid.cost.costs import analytic_costs, costs_from_dict
    from braid.cost.hardware import get_hardware
    from braid.cost.catalog import get_model

    plan = schedules.build("braided_v", p, m)
    layout = Layout(2, p, plan.v, plan.placement)
    base = analytic_costs(get_model("qwen2-12b"), get_hardware("h200"), layout)
    costs = costs_from_dict({"format": "braid-costs/1", "T_F": 1.0, "T_B": 1.0, "T_W": 1.0, "T_AR": t_ar, "T_P2P": 0.0},
                            layout, {k: c.spec for k, c in base.chunks.items()}, base=base)
    report = simulate(compile_plan(plan), costs, name="braided_v", record=False).report
    assert report.max_tp_exposed_s <= (2 * p + 1) * t_ar + 1e-9


# -- PP bubble (Table 1, column 1) -------------------------------------------------------
@pytest.mark.parametrize("p,m", [(3, 6), (4, 8), (4, 12), (6, 18)])
def test_bubble_of_1f1b_i_matches_table1_without_tp_comm(p, m):
    # T_AR = 0: the compiler orders P2P by list-scheduling with F = B = W = 1, which are
    # then the real costs. With T_AR > 0 its rendezvous batches couple neighbours and the
    # bubble grows with m (reported to the compiler owner), so exactness is checked here.
    _, r = _run("1f1b_i", p, m, 0.0)
    assert all(x.pp_bubble_s == pytest.approx((p - 1) * (TF + TB + TW), abs=1e-9) for x in r.ranks)


@pytest.mark.parametrize("p", [3, 4, 6])
@pytest.mark.parametrize("t_ar", [0.0, 0.25])
def test_bubble_of_braided_v_is_constant_in_m_and_close_to_table1(p, t_ar):
    bubbles = [_run("braided_v", p, m, t_ar)[1].max_bubble_s for m in (3 * p, 4 * p)]
    formula = (p - 1) * (TF + t_ar + TB - TW)
    assert bubbles[0] == pytest.approx(bubbles[1], abs=1e-9)
    # Remainder: the generator's cool-down leaves about one forward slot per two stages
    # unfilled; bounded by (p-1)/2 * (T_F + T_AR).
    assert formula - 1e-9 <= bubbles[0] <= formula + (p - 1) / 2 * (TF + t_ar) + 1e-9
    zb = _run("1f1b_i", p, 3 * p, t_ar)[1].max_bubble_s
    assert bubbles[0] < zb


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (3, 9), (4, 8), (4, 12), (4, 16), (6, 18), (8, 16)])
def test_bubble_of_zb_v_is_the_papers_zero_plus_the_pipeline_fill(p, m):
    """ZB-V with T_F = T_B = T_W: the paper's bubble (p-1)(T_F+T_B-2T_W) = 0 holds exactly.

    The zero-bubble papers count the idle time inside each device's span, from its first
    op to its last (the parallelogram that the next iteration's warm-up overlaps once the
    optimizer step is no barrier). One simulated step also counts the pipeline fill: the
    rank holding stage p-1 cannot start before p-1 forwards have passed, so no schedule's
    worst bubble is below (p-1)*T_F (see the next test). ZB-V reaches that bound:
    rank r starts after r forwards, never idles, and ends (p-1-r)*T_F before the last
    rank, so every rank's bubble is (p-1)*T_F -- at p=4, m=12 a step of 75 = 72 + 3.
    """
    _, r = _run("zb_v", p, m, 0.0)
    work = 2 * m * (TF + TB + TW)
    assert (p - 1) * (TF + TB - 2 * TW) == 0
    assert r.step_time_s == pytest.approx(work + (p - 1) * TF, abs=1e-9)
    for x in r.ranks:
        assert x.compute_s == pytest.approx(work, abs=1e-9)
        assert x.pp_bubble_s == pytest.approx((p - 1) * TF, abs=1e-9)
        # Rank r cannot start before r*T_F, so what is left of its bubble after that head
        # and its tail is an upper bound on the idle time inside its span: here none.
        inside = x.pp_bubble_s - x.rank * TF - (r.step_time_s - x.end_s)
        assert inside == pytest.approx(0.0, abs=1e-9)
    # With TP all-reduces every forward hop of the fill also exposes one: (p-1)(T_F+T_AR).
    t_ar = 0.25
    _, r = _run("zb_v", p, m, t_ar)
    assert all(x.pp_bubble_s == pytest.approx((p - 1) * (TF + t_ar), abs=1e-9) for x in r.ranks)


@pytest.mark.parametrize("p,m", [(3, 9), (4, 12)])
def test_no_schedule_beats_the_pipeline_fill(p, m):
    # F(mb, p-1) needs p-1 earlier forwards on other ranks, so the rank holding stage p-1
    # idles at least (p-1)*T_F before its first op, whatever the schedule.
    for name in schedules.names():
        try:
            _, r = _run(name, p, m, 0.0)
        except ValueError:
            continue  # a generator that rejects (p, m)
        assert r.max_bubble_s >= (p - 1) * TF - 1e-9, name


# -- monotonicity and lower bounds ---------------------------------------------------------
def test_more_tp_comm_never_makes_a_schedule_faster():
    for name in schedules.names():
        try:
            steps = [_run(name, 4, 12, t_ar, slowdown=1.075)[1].step_time_s for t_ar in (0.0, 0.1, 0.25, 0.5)]
        except ValueError:
            continue  # a generator that rejects (4, 12)
        assert steps == sorted(steps), name


_NOMINAL = {OpKind.F: TF, OpKind.B: TB, OpKind.W: TW, OpKind.BW: TB + TW}


def test_every_rank_ends_after_its_compute_lower_bound():
    for name in ("1f1b_i", "zb_v", "braided_v", "gpipe"):
        progs, r = _run(name, 4, 12, 0.25, slowdown=1.075)
        for prog, rank in zip(progs, r.ranks):
            bound = sum(_NOMINAL[op.kind] for ins in prog.instructions for op in compute_ops(ins))
            assert rank.end_s >= bound - 1e-9
            assert rank.compute_s >= bound - 1e-9  # the slowdown only adds
            assert rank.compute_s + rank.tp_exposed_s + rank.pp_bubble_s == pytest.approx(r.step_time_s)


# -- unit-level TP semantics on one rank -------------------------------------------------
def _one_rank(text: str, t_ar: float = 0.4, slowdown: float = 1.0, tp: int = 2, **kw):
    costs = uniform_costs(Layout(tp, 1, 1), {(0, 0): ChunkSpec(2)}, T_F=TF, T_B=TB, T_W=TW, T_AR=t_ar,
                          ar_slowdown=slowdown, **kw)
    return simulate([Program.from_text(0, text)], costs)


def test_plain_forward_and_split_backward_expose_their_allreduces():
    assert _one_rank("F0c0").report.ranks[0].tp_exposed_s == pytest.approx(0.4)
    r = _one_rank("F0c0\nB0c0\nW0c0").report.ranks[0]
    assert r.tp_exposed_s == pytest.approx(0.8)


def test_full_backward_hides_its_allreduce_behind_w_units():
    # 2 layers: 8 B units, 4 backward all-reduces of 0.1 each, each followed by a W unit of 1/8.
    r = _one_rank("F0c0\nBW0c0").report.ranks[0]
    assert r.tp_exposed_s == pytest.approx(0.4)  # only the forward's


def test_braided_block_hides_forward_allreduces_and_pays_the_slowdown():
    plain = _one_rank("F0c0\nF1c0\nBW0c0\nBW1c0", slowdown=1.075).report.ranks[0]
    braided = _one_rank("F0c0\nF1c0&BW0c0\nBW1c0", slowdown=1.075).report.ranks[0]
    assert braided.tp_exposed_s < plain.tp_exposed_s - 0.3
    assert braided.compute_s > plain.compute_s  # overlapped units run 7.5% slower


@pytest.mark.parametrize("stretch", [1.0, 1.5, 2.0])
def test_an_allreduce_with_compute_beside_it_takes_ar_stretch_longer(stretch):
    # Plain F: every all-reduce is waited for by the next unit (or ends the instruction), so
    # nothing runs beside it and the stretch changes nothing.
    plain = _one_rank("F0c0", ar_stretch=stretch)
    assert plain.report.ranks[0].tp_exposed_s == pytest.approx(0.4)
    # Braided: each member's all-reduces run beside the other member's units.
    res = _one_rank("F0c0\nF1c0&BW0c0\nBW1c0", ar_stretch=stretch)
    alone = 0.4 / 4  # T_AR over the chunk's 4 all-reduces (2 layers: attn, mlp)
    ars = [e for e in res.trace.events if e.lane == "tp-comm"]
    assert len(ars) == 16
    for e in ars:  # a plain F's are waited for at once, but its last one is carried into the block (it
        # runs beside the block's first unit); a BW's run beside its W units; all in the block
        carried = e.name == "F0c0" and e.unit == "L1.mlp"
        beside = e.block is not None or e.name.startswith("BW") or carried
        assert e.dur == pytest.approx(alone * stretch if beside else alone), e
    if stretch > 1:
        base = _one_rank("F0c0\nF1c0&BW0c0\nBW1c0").report.ranks[0]
        assert res.report.ranks[0].end_s >= base.end_s - 1e-12


@pytest.mark.parametrize("host_over_unit", [0.0, 0.5, 2.0])
def test_host_lane_delays_units_the_host_has_not_issued_yet(host_over_unit):
    # tp=1, one F of a 2-layer chunk: each unit task is issued host_task_s after the previous one.
    base = _one_rank("F0c0", tp=1)
    units = [e for e in base.trace.events if e.lane == "compute"]
    d = units[1].dur  # a decoder unit's time (uniform split)
    host = host_over_unit * d
    res = _one_rank("F0c0", tp=1, host_task_s=host)
    got = [e for e in res.trace.events if e.lane == "compute"]
    issued, t = 0.0, 0.0
    for e, ref in zip(got, units):  # replay the rule: start = max(device free, issued by the host)
        issued += host
        t = max(t, issued)
        assert e.start == pytest.approx(t), e
        t += ref.dur
    assert res.report.ranks[0].end_s == pytest.approx(t)
    if host_over_unit == 0.0:
        assert res.report.ranks[0].end_s == pytest.approx(base.report.ranks[0].end_s)
    else:
        assert res.report.ranks[0].end_s > base.report.ranks[0].end_s


def test_tp1_has_no_allreduce_events():
    res = _one_rank("F0c0\nBW0c0", tp=1)
    assert res.report.ranks[0].tp_exposed_s == 0.0
    assert not [e for e in res.trace.events if e.lane == "tp-comm"]


# -- memory and offload -------------------------------------------------------------------
def test_memory_follows_forward_split_backward_and_w():
    res = _one_rank("F0c0\nF1c0\nB0c0\nB1c0\nW0c0\nW1c0", M_a_bytes=1000.0, W_residual=0.25)
    series = res.trace.memory[0]
    assert res.report.ranks[0].peak_activation_bytes == 2000
    assert res.report.ranks[0].peak_activation_ma == pytest.approx(2.0)
    assert series[-1][1] == 0
    b_end = max(e.end for e in res.trace.events if e.name == "B1c0")
    after_b = [b for t, b in series if t <= b_end + 1e-12][-1]  # both B done, W pending
    assert after_b == pytest.approx(2 * 250, abs=1)


def test_offload_lowers_peak_and_backward_waits_for_reload():
    assert RELEASE_AFTER == 2  # the texts below count on it
    text = "F0c0\nOFFLOAD0c0\nF1c0\nF2c0\nBW2c0\nBW1c0\nRELOAD0c0\nBW0c0"
    kw = dict(M_a_bytes=1000.0, W_residual=0.25)
    base = _one_rank(text.replace("OFFLOAD0c0\n", "").replace("RELOAD0c0\n", ""), **kw).report.ranks[0]
    assert base.peak_activation_bytes == 3000
    fast = _one_rank(text, pcie_bytes_per_s=1e6, **kw)  # the copy is done before F2c0 starts
    assert fast.report.ranks[0].peak_activation_bytes == 2000
    assert fast.report.ranks[0].end_s == pytest.approx(base.end_s, rel=1e-3)
    slow = _one_rank(text, pcie_bytes_per_s=100.0, **kw)  # 10 s each way
    off, reload = (next(e for e in slow.trace.events if e.kind == k) for k in ("OFFLOAD", "RELOAD"))
    # a late copy: the third compute instruction after the offload waits for it, then frees its bytes
    bw2 = min(e.start for e in slow.trace.events if e.name == "BW2c0")
    assert bw2 == pytest.approx(off.end)
    assert slow.report.ranks[0].peak_activation_bytes == 3000
    bw0 = [e for e in slow.trace.events if e.name == "BW0c0"]
    assert min(e.start for e in bw0) >= reload.end - 1e-9


@pytest.mark.parametrize("duplex", [1.0, 1.5, 2.0])
def test_a_copy_against_the_other_direction_takes_copy_duplex_slowdown_longer(duplex):
    # OFFLOAD1c0 and RELOAD0c0 are issued together: the reload starts while the offload runs
    text = "F0c0\nOFFLOAD0c0\nF1c0\nF2c0\nF3c0\nOFFLOAD1c0\nRELOAD0c0\nF4c0\nBW4c0\nBW3c0\nBW2c0\nBW0c0\nRELOAD1c0\nBW1c0"
    res = _one_rank(text, pcie_bytes_per_s=400.0, M_a_bytes=1000.0, copy_duplex_slowdown=duplex)
    copies = {e.name: e for e in res.trace.events if e.kind in ("OFFLOAD", "RELOAD")}
    alone = 1000.0 / 400.0
    assert copies["RELOAD0c0"].start == pytest.approx(copies["OFFLOAD1c0"].start)
    assert copies["RELOAD0c0"].dur == pytest.approx(alone * duplex)
    for name in ("OFFLOAD0c0", "OFFLOAD1c0", "RELOAD1c0"):  # nothing in the other direction at their start
        assert copies[name].dur == pytest.approx(alone)


def test_reload_without_offload_is_an_error():
    with pytest.raises(SimulationError, match="RELOAD0c0"):
        _one_rank("F0c0\nRELOAD0c0\nBW0c0")


# -- P2P errors ----------------------------------------------------------------------------
def _two_ranks(a: str, b: str):
    specs = {(r, 0): ChunkSpec(1) for r in range(2)}
    costs = uniform_costs(Layout(1, 2, 1), specs, T_F=1.0, T_B=1.0, T_W=1.0, T_AR=0.0, T_P2P=0.1)
    return simulate([Program.from_text(0, a), Program.from_text(1, b)], costs)


def test_deadlock_lists_each_ranks_stuck_instruction():
    with pytest.raises(SimulationError) as err:
        # rank 0 runs its backward (needing rank 1's gradient) before the forward rank 1 needs
        _two_ranks("RECV_G0c0<1\nB0c0\nF0c0\nSEND_A0c0>1", "RECV_A0c0<0\nF0c0\nB0c0\nSEND_G0c0>0")
    msg = str(err.value)
    assert "rank 0: stuck at op 1 (B0c0), waiting to receive the gradient of mb 0 chunk 0" in msg
    assert "rank 1: stuck at op 1 (F0c0), waiting to receive the activation of mb 0 chunk 0" in msg


def test_receive_without_send_reports_the_receiver():
    with pytest.raises(SimulationError, match=r"rank 1: op 0 \(RECV_A0c0<0\) is never matched: its peer rank 0 never posts the SEND"):
        _two_ranks("F0c0\nB0c0", "RECV_A0c0<0\nF0c0\nB0c0")


def test_misrouted_send_is_rejected():
    with pytest.raises(SimulationError, match="peer"):
        _two_ranks("F0c0\nSEND_A0c0>0", "F0c0")


def test_two_rank_pipeline_timing_and_trace():
    res = _two_ranks("F0c0\nSEND_A0c0>1\nRECV_G0c0<1\nBW0c0", "RECV_A0c0<0\nF0c0\nBW0c0\nSEND_G0c0>0")
    # F (1) + P2P (0.1) + F (1) + BW (2) + P2P (0.1) + BW (2)
    assert res.report.step_time_s == pytest.approx(6.2)
    assert {e.lane for e in res.trace.events} <= set(LANES)
    again = Trace.from_dict(res.trace.to_dict())
    assert len(again.events) == len(res.trace.events) and again.step_time == pytest.approx(6.2)
    sends = [e for e in res.trace.events if e.kind == "SEND"]
    assert [(e.rank, e.peer) for e in sends] == [(0, 1), (1, 0)]
