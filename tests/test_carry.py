"""The carried all-reduce (braid.core.braiding.carries): where the rule fires, and what the simulator does with it.

One rank, uniform costs: chunks of two layers, so every plain forward ends with the MLP's
all-reduce. The executor's side is checked in the gloo equivalence cases
(``executor_cases._check_carried_overlap``: the measured all-reduce spans the hoisted unit).
"""

from __future__ import annotations

import pytest

from braid.core.braiding import ChunkSpec, carries, steps
from braid.cost.costs import Layout, uniform_costs
from braid.core.ir import Program, parse_instruction
from braid.simulator import simulate

MIDDLE = ChunkSpec(2)


def _carries(text: str, spec=MIDDLE) -> dict[str, str]:
    instrs = [parse_instruction(line) for line in text.split()]
    return {str(instrs[i]): f"{c.op}->{instrs[c.into]}" + " chained" * c.chained + " reads-run" * c.head_reads_run
            for i, c in carries(instrs, lambda chunk: spec).items()}


def test_a_trailing_allreduce_is_carried_into_the_next_braided_block():
    assert _carries("F0c0 F1c0&BW0c0") == {"F0c0": "F0c0->F1c0&BW0c0"}
    # a braided block's last unit is its second member's when both have as many segments
    assert _carries("F2c0&F3c0 F1c1&B0c1") == {"F2c0&F3c0": "F3c0->F1c1&B0c1"}


@pytest.mark.parametrize("text", [
    "F0c0 F1c0",                         # plain next to plain: finished as 1F1B-I / ZB-V runtimes do
    "F0c0 OFFLOAD0c0 F1c0&BW0c0",        # a copy between would read the tensor being reduced
    "F2c0&F3c0 F3c1",                   # the next unit consumes the carried op's micro-batch
    "B0c0 SEND_G0c0>0 F3c0&B1c0",        # a backward's gradient still needs its last norm backward
])
def test_no_carry(text):
    assert _carries(text) == {}


def test_a_receive_posted_before_the_earlier_instruction_does_not_block_the_carry():
    assert _carries("RECV_A1c0<1 F0c0 F1c0&BW0c0") == {"F0c0": "F0c0->F1c0&BW0c0"}


def test_a_sent_forward_output_chains_the_run_to_its_allreduce():
    assert _carries("F0c0 SEND_A0c0>1 F1c0&BW0c0") == {"F0c0": "F0c0->F1c0&BW0c0 chained"}
    assert _carries("F0c0 RECV_A1c0<1 F1c0&BW0c0") == {"F0c0": "F0c0->F1c0&BW0c0 reads-run"}
    got = _carries("F2c0&B0c0 RECV_G1c0<1 SEND_A2c0>1 SEND_G0c0>0 F4c0&B1c0")
    assert got == {"F2c0&B0c0": "F2c0->F4c0&B1c0 chained reads-run"}  # the block ends on its forward's all-reduce


def test_a_middle_block_ends_on_its_forwards_allreduce():
    st = steps(parse_instruction("F3c0&B1c0"), lambda c: MIDDLE)
    assert st[0].op.kind.value == "B" and st[-1].op.kind.value == "F" and st[-1].task.ar


def test_nothing_is_carried_when_the_last_unit_starts_no_allreduce():
    head = ChunkSpec(2, head=True)  # a forward ends with the LM head, no all-reduce
    assert _carries("F0c0 F1c0&BW0c0", head) == {}


def test_a_last_stage_block_ends_on_the_forward_head_so_the_backward_allreduce_hides_inside():
    head = ChunkSpec(2, head=True)
    st = steps(parse_instruction("F3c0&B1c0"), lambda c: head)
    assert st[0].op.kind.value == "B" and st[-1].task.label == "F:head"  # led by the backward
    middle = steps(parse_instruction("F3c0&B1c0"), lambda c: MIDDLE)
    assert middle[-1].task.ar  # no order avoids a trailing all-reduce there


def test_a_short_weight_gradient_is_cut_to_sit_beside_every_allreduce_of_a_long_forward():
    specs = {0: ChunkSpec(7, embed=True), 1: ChunkSpec(5, head=True)}  # rank 0 of a 12B model at p=4
    st = steps(parse_instruction("F8c0&W0c1"), specs.__getitem__)
    for a, b in zip(st, st[1:]):
        if a.task.ar:  # every forward all-reduce is followed by a W unit
            assert b.op.kind.value == "W", (a, b)


def _one_rank(text: str, t_ar: float = 0.4):
    costs = uniform_costs(Layout(2, 1, 1), {(0, 0): MIDDLE}, T_F=1.0, T_B=1.0, T_W=1.0, T_AR=t_ar)
    return simulate([Program.from_text(0, text.replace(" ", "\n"))], costs)


def test_simulated_carry_overlaps_the_next_first_unit_and_hides_the_wait(monkeypatch):
    res = _one_rank("F0c0 F1c0&BW0c0 BW1c0")
    ar = [e for e in res.trace.events if e.lane == "tp-comm" and e.op_index == 0][-1]  # F0c0's last all-reduce
    first = min((e for e in res.trace.events if e.lane == "compute" and e.op_index == 1), key=lambda e: e.start)
    assert ar.start == pytest.approx(first.start) and ar.end <= first.end + 1e-12  # beside it, hidden by it
    from braid.simulator import engine

    monkeypatch.setattr(engine, "carries", lambda instructions, spec_of: {})
    plain = _one_rank("F0c0 F1c0&BW0c0 BW1c0")
    assert res.report.ranks[0].tp_exposed_s == pytest.approx(plain.report.ranks[0].tp_exposed_s - ar.dur)
    assert res.report.step_time_s < plain.report.step_time_s


def test_a_chained_run_is_posted_when_the_carried_allreduce_ends():
    # Two ranks; rank 0's braided block ends on F3c0's all-reduce, whose output rank 1 receives.
    text0 = "F2c0&F3c0 SEND_A3c0>1 F4c0&F5c0 SEND_A2c0>1 SEND_A4c0>1 SEND_A5c0>1"
    text1 = "RECV_A3c0<0 RECV_A2c0<0 F3c0 F2c0 RECV_A4c0<0 RECV_A5c0<0 F4c0 F5c0"
    costs = uniform_costs(Layout(2, 2, 1), {(0, 0): MIDDLE, (1, 0): MIDDLE}, T_F=1.0, T_B=1.0, T_W=1.0, T_AR=0.4)
    progs = [Program.from_text(0, text0.replace(" ", "\n")), Program.from_text(1, text1.replace(" ", "\n"))]
    res = simulate(progs, costs)
    ar = [e for e in res.trace.events if e.rank == 0 and e.lane == "tp-comm" and e.op_index == 0][-1]
    send = next(e for e in res.trace.events if e.rank == 0 and e.kind == "SEND" and e.mb == 3)
    first = min((e for e in res.trace.events if e.rank == 0 and e.lane == "compute" and e.op_index == 2), key=lambda e: e.start)
    assert send.start == pytest.approx(ar.start + ar.dur)  # leaves as the all-reduce ends
    assert first.start == pytest.approx(ar.start)  # while the next block's first unit runs beside it
