"""Sequence parallelism inside TP (:mod:`braid.tp.seq_shard`) without processes: the layout helpers,
the flag's resolution, and the cost model's prices (the runtime's equivalence and saved bytes are in
``test_executor.py``)."""

from __future__ import annotations

import pytest
import torch

from braid.core.braiding import Unit
from braid.cost.costs import Layout, analytic_costs
from braid.cost.catalog import get_model
from braid.cost.hardware import get_hardware
from braid.io.cli import SeqShardError, local_seq, resolve_seq_shard
from braid.tp.seq_shard import add_shard_residual, gathered_view

LAYER = (Unit.PRE_ATTN, Unit.ATTN, Unit.PRE_MLP, Unit.MLP)


def test_gathered_view_and_the_shard_residual_follow_the_sequence_layout() -> None:
    b, s, h, t = 3, 8, 2, 4
    x = torch.arange(b * s * h, dtype=torch.float64).view(b, s, h)
    shards = [x[:, r * s // t:(r + 1) * s // t] for r in range(t)]  # rank r's tokens
    assert torch.equal(gathered_view(torch.stack(shards)), x)  # an all-gather's buffer (t, b, s/t, h), read back
    out = torch.zeros(b, s, h, dtype=torch.float64)
    add_shard_residual(out, shards[2], 2)
    assert torch.equal(out[:, 4:6], shards[2]) and out[:, :4].abs().sum() == 0 and out[:, 6:].abs().sum() == 0


def test_the_flag_is_on_at_tp_above_1_where_it_runs_and_refuses_what_it_does_not_cover() -> None:
    assert resolve_seq_shard(None, 2) and resolve_seq_shard(True, 2) and not resolve_seq_shard(True, 1)  # on by default
    assert not resolve_seq_shard(None, 1) and not resolve_seq_shard(False, 8)
    assert resolve_seq_shard(True, 2, seq=4096) and resolve_seq_shard(None, 2, seq=4096)
    notes: list[str] = []
    # off by default where it does not run, or an MoE model's eager step would pay for it, saying why in one line
    for kw, word in (({"cp": 2}, "--cp"), ({"vision": True}, "vision"), ({"seq": 4095}, "4095"), ({"moe": True}, "MoE")):
        assert not resolve_seq_shard(None, 2, note=notes.append, **kw), kw
        assert len(notes) == 1 and word in notes[0] and "\n" not in notes[0], (kw, notes)
        notes.clear()
    assert resolve_seq_shard(True, 2, moe=True)  # asked for: an MoE model runs it (tests/test_moe_pipeline.py)
    with pytest.raises(SeqShardError, match="4095 is not divisible by tp=2"):
        resolve_seq_shard(True, 2, seq=4095)
    for kw, word in (({"cp": 2}, "--cp"), ({"vision": True}, "vision")):
        with pytest.raises(SeqShardError, match=word) as err:
            resolve_seq_shard(True, 2, **kw)
        assert "\n" not in str(err.value) and "--no-sequence-parallel" in str(err.value)
    assert local_seq(4096, 8, True) == 512 and local_seq(4095, 8, False) == 4095
    with pytest.raises(SeqShardError, match="not divisible by tp=8"):
        local_seq(4095, 8, True)


def test_costs_price_34_over_t_bytes_and_a_reduce_scatter_then_all_gather() -> None:
    model, hw = get_model("qwen2-7b"), get_hardware("h200")
    for t in (2, 4):
        lay = Layout(t, 2, 2, "v")
        off = analytic_costs(model, hw, lay).chunks[(0, 1)].units
        on = analytic_costs(model, hw, lay, seq_shard=True).chunks[(0, 1)].units
        sbh = model.tokens * model.hidden * model.dtype_bytes / 2
        assert sum(off[u].act for u in LAYER) == pytest.approx(sbh * (10 + 24 / t))
        assert sum(on[u].act for u in LAYER) == pytest.approx(sbh * 34 / t)
        # the chain: a reduce-scatter and an all-gather, an all-reduce's traffic and one more latency
        assert on[Unit.ATTN].ar_f == pytest.approx(off[Unit.ATTN].ar_f + hw.ar_latency_s)
        assert on[Unit.PRE_MLP].ar_b == pytest.approx(off[Unit.PRE_MLP].ar_b + hw.ar_latency_s)
        for u in LAYER:
            assert (on[u].f, on[u].b, on[u].w) == (off[u].f, off[u].b, off[u].w)
            # a split B's stash: each unit's one whole-sequence tensor (a pre unit's input, an attn/mlp unit's
            # output gradient; 2 s*b*h bytes) is the rank's tokens
            assert on[u].w_res == pytest.approx(off[u].w_res - 2 * sbh * (1 - 1 / t))
        run_off = analytic_costs(model, hw, lay, activations="runtime").chunks[(0, 1)].units
        run_on = analytic_costs(model, hw, lay, activations="runtime", seq_shard=True).chunks[(0, 1)].units
        assert run_on[Unit.PRE_ATTN].act < run_off[Unit.PRE_ATTN].act and run_on[Unit.ATTN].act == run_off[Unit.ATTN].act
    with pytest.raises(ValueError, match="vision"):
        analytic_costs(get_model("qwen2-vl-7b"), hw, Layout(2, 1, 2, "v"), seq_shard=True)


def test_the_simulated_activation_peak_at_tp8_drops_by_34_over_10_plus_24_over_t() -> None:
    # 1F1B's first rank holds the embedding and whole layers (no head, no W residual): its peak is
    # p micro-batches of its layers' activations, so it drops by Korthikanti's ratio.
    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.simulator import simulate

    model, hw, t = get_model("qwen2-72b"), get_hardware("h200"), 8
    plan = schedules.build("1f1b", 4, 8)
    progs, lay = compile_plan(plan), Layout(t, plan.p, plan.v, plan.placement)
    off, on = (simulate(progs, analytic_costs(model, hw, lay, seq_shard=ss), name="1f1b").report.ranks[0]
               for ss in (False, True))
    assert on.peak_activation_bytes / off.peak_activation_bytes == pytest.approx((34 / t) / (10 + 24 / t), rel=0.01)


@pytest.mark.parametrize("pp", [1, 2])
def test_a_following_members_first_gather_starts_with_its_braided_block(pp: int) -> None:
    # An op's first unit with a gathering head (braiding.GATHER_HEAD_F/_B: the pre_attn after a stage
    # boundary, the last layer's mlp backward) all-gathers before it computes. In a braided block
    # whose other member leads, that gather starts as the block starts (braiding.early_heads), so it
    # runs beside the leader's first segment: in the simulated trace a TP collective of the
    # following member starts as the block starts. Gathered when the unit starts
    # (exposed, as before), none would; with the collective priced at 0 it could not be told apart.
    # (A block that a carried all-reduce runs into starts its gathers after its first step: left out.)
    from braid import schedules
    from braid.core.braiding import carries, gather_head, steps
    from braid.core.compiler import compile_plan
    from braid.core.ir import Braided
    from braid.simulator import simulate

    model, hw = get_model("qwen2-7b"), get_hardware("h100")
    plan = schedules.build("braided_v", pp, 4 * pp)
    progs, lay = compile_plan(plan), Layout(2, plan.p, plan.v, plan.placement)
    costs = analytic_costs(model, hw, lay, seq_shard=True)
    assert all(c.units[Unit.PRE_ATTN].ag_f > 0 and c.units[Unit.MLP].ag_b > 0 for c in costs.chunks.values())
    trace = simulate(progs, costs, name="braided_v").trace
    want = 0
    for prog in progs:
        carried_into = {c.into for c in carries(prog.instructions, costs.spec_of(prog.rank)).values()}
        for idx, ins in enumerate(prog.instructions):
            if not isinstance(ins, Braided):
                continue
            st = steps(ins, costs.spec_of(prog.rank))
            follower = 1 - st[0].member
            first = next(s for s in st if s.member == follower)
            if not gather_head(first.task) or idx in carried_into:
                continue
            want += 1
            evs = [e for e in trace.events if e.rank == prog.rank and e.op_index == idx]
            start = min(e.start for e in evs)  # the block's start (its first event: a unit, or that gather)
            assert any(e.lane == "tp-comm" and e.name == str(ins.ops[follower]) and e.start == start for e in evs), (
                prog.rank, str(ins))
    assert want > 0


def test_a_full_backwards_head_follows_its_reduction_past_the_w_tasks_between() -> None:
    # In a BW op each unit's W comes right after its B: B pre_mlp (a reduce-scatter), W pre_mlp, B attn.
    # The attn's head (the norm backward on the rank's tokens, then the all-gather) runs as that
    # reduce-scatter ends, beside the W, not inline as the unit starts: on the stream that ran the
    # norm's forward (the forward's head). A root gradient made on another stream than its consumer's is
    # marked in use there by autograd, and a CUDA graph capture then never reuses its block (a graphed
    # 1f1b_i step's pool grew 14 MiB per reduction, 7b-layer at tp=2). W tasks start no reduction.
    from braid.core.braiding import ChunkSpec, OpKind, Phase, next_of_op, unit_tasks

    tasks = [(0, t) for t in unit_tasks(OpKind.BW, ChunkSpec(2))]
    followed = {(t.unit, t.layer): next_of_op(tasks, k) for k, (_, t) in enumerate(tasks) if t.ar}
    assert followed and all(n is None or n.phase is Phase.B for n in followed.values()), followed
    assert followed[(Unit.PRE_MLP, 1)].unit is Unit.ATTN and followed[(Unit.PRE_MLP, 1)].layer == 1
    assert followed[(Unit.PRE_ATTN, 1)].unit is Unit.MLP and followed[(Unit.PRE_ATTN, 1)].layer == 0
    assert all(next_of_op(tasks, k) is None for k, (_, t) in enumerate(tasks) if t.phase is Phase.W)
