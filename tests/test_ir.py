"""The IR: text forms round-trip, invalid instructions are rejected, plans serialise."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from braid.core.ir import (
    Braided,
    CommKind,
    Compute,
    Offload,
    OpKind,
    Plan,
    Program,
    Recv,
    Reload,
    ScheduleConfig,
    Send,
    parse_instruction,
    programs_from_json,
    programs_to_json,
    rank_chunk_of,
    stage_of,
)

ids = st.integers(0, 500)
computes = st.builds(Compute, st.sampled_from(list(OpKind)), ids, st.integers(0, 3))


@st.composite
def braided(draw):
    kind2 = draw(st.sampled_from([OpKind.F, OpKind.W, OpKind.B, OpKind.BW]))
    chunk = draw(st.integers(0, 1))
    if kind2 in (OpKind.B, OpKind.BW):
        mb2 = draw(st.integers(0, 100))
        return Braided(Compute(OpKind.F, mb2 + draw(st.integers(1, 50)), chunk), Compute(kind2, mb2, chunk))
    return Braided(Compute(OpKind.F, draw(ids), 0), Compute(kind2, draw(ids), 1))


instructions = st.one_of(
    computes,
    braided(),
    st.builds(Send, st.sampled_from(list(CommKind)), ids, st.integers(0, 3), st.integers(0, 63)),
    st.builds(Recv, st.sampled_from(list(CommKind)), ids, st.integers(0, 3), st.integers(0, 63)),
    st.builds(Offload, ids, st.integers(0, 3), st.sampled_from([1.0, 0.5, 0.25, 0.125, 0.3])),
    st.builds(Reload, ids, st.integers(0, 3)),
)


@given(instructions)
def test_text_form_round_trips(instr):
    text = str(instr)
    assert parse_instruction(text) == instr
    assert str(parse_instruction(text)) == text


def test_text_forms_are_compact_and_explicit():
    assert str(Compute(OpKind.B, 3, 1)) == "B3c1"
    assert str(Compute(OpKind.BW, 3, 1)) == "BW3c1"
    assert str(Braided(Compute(OpKind.F, 9, 1), Compute(OpKind.B, 3, 1))) == "F9c1&B3c1"
    assert str(Send(CommKind.ACT, 3, 0, 1)) == "SEND_A3c0>1"
    assert str(Recv(CommKind.GRAD, 3, 0, 1)) == "RECV_G3c0<1"
    assert str(Offload(3, 0, 0.5)) == "OFFLOAD3c0@0.5"
    assert str(Offload(3, 0)) == "OFFLOAD3c0"


@pytest.mark.parametrize(
    "text, message",
    [
        ("F3c0&B5c0", "forward micro-batch must be larger"),
        ("B3c0&F9c0", "allowed pairs"),
        ("F3c0&W3c0", r"same \(mb, chunk\)"),
        ("X3c0", "cannot parse"),
        ("OFFLOAD3c0@1.5", "fraction"),
    ],
)
def test_invalid_instructions_raise(text, message):
    with pytest.raises(ValueError, match=message):
        parse_instruction(text)


@pytest.mark.parametrize("text", ["F9c0&B3c1", "F2c0&B7c1", "F4c1&BW4c0", "F3c1&W5c0"])
def test_cross_chunk_blocks_parse_back_with_any_micro_batches(text):
    block = parse_instruction(text)
    assert isinstance(block, Braided) and block.cross_chunk and str(block) == text


def test_placements():
    p = 4
    # V: device d holds virtual stages d and 2p-1-d.
    for d in range(p):
        assert stage_of("v", p, d, 0) == d and stage_of("v", p, d, 1) == 2 * p - 1 - d
    for s in range(2 * p):
        assert stage_of("v", p, *rank_chunk_of("v", p, s)) == s
        assert stage_of("loop", p, *rank_chunk_of("loop", p, s)) == s
    assert rank_chunk_of("loop", p, 5) == (1, 1)


def test_plan_and_programs_json_round_trip():
    plan = Plan(
        "toy",
        ScheduleConfig(2, 1, 2, (("alpha", 0.5),)),
        "v",
        (
            (Compute(OpKind.F, 0, 0), Compute(OpKind.F, 0, 1), Compute(OpKind.BW, 0, 1), Compute(OpKind.BW, 0, 0)),
            (Compute(OpKind.F, 0, 0), Compute(OpKind.F, 0, 1), Compute(OpKind.B, 0, 1), Compute(OpKind.W, 0, 1),
             Compute(OpKind.BW, 0, 0)),
        ),
    )
    assert Plan.from_json(plan.to_json()) == plan
    progs = [Program(0, (Compute(OpKind.F, 0, 0), Send(CommKind.ACT, 0, 0, 1))), Program(1, (Recv(CommKind.ACT, 0, 0, 0),))]
    plan2, progs2 = programs_from_json(programs_to_json(plan, progs))
    assert plan2 == plan and progs2 == progs
    assert Program.from_text(0, progs[0].text()) == progs[0]
    with pytest.raises(ValueError, match="not a braid plan"):
        Plan.from_json('{"format": "nope"}')


def test_config_validation():
    with pytest.raises(ValueError, match="positive integers"):
        ScheduleConfig(0, 4)
    with pytest.raises(ValueError, match="V placement needs v=2"):
        Plan("x", ScheduleConfig(1, 1, 1), "v", ((),))


def test_a_plan_with_an_unknown_placement_is_refused() -> None:
    """Any placement but "v" used to mean "loop" silently (stage_of's else branch)."""
    import json as _json

    from braid import schedules as _schedules
    from braid.core.ir import Plan as _Plan

    d = _json.loads(_schedules.build("1f1b_i", 2, 4).to_json())
    assert _Plan.from_dict(d).placement == "loop"
    d["placement"] = "zigzag"
    with pytest.raises(ValueError, match="unknown placement 'zigzag'; valid: loop, v"):
        _Plan.from_dict(d)
