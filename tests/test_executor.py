"""The executor against a single-process reference, in real gloo processes (CPU).

One pool of processes per world size (1, 2, 4) runs every registered schedule for each
layout (pp, tp) and m in {p, p+1, 2p+1} (those the schedule accepts; p+1 and 2p+1 are not
multiples of p): loss, every gradient, and the parameters after two AdamW steps must equal
the single-device model with the same seed and data, in float64, within the rounding bound
of ``reference_error``. Braided blocks, W units and all-reduces are counted
from the executed run and compared with the program. At tp > 1 the runs of each schedule
alternate between sequence parallelism inside TP (:mod:`braid.tp.seq_shard`; its first, third
accepted m) and the plain all-reduces, so both run every path without running twice.
"""

from __future__ import annotations

import pytest
import torch

from braid import schedules
from distributed_utils import DistPool
import executor_cases as cases
from reference_error import assert_matches_reference

LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]
# m as a function of p: p, and two counts that are not multiples of p (for p > 1).
M_OF_P = {"p": lambda p: p, "p+1": lambda p: p + 1, "2p+1": lambda p: 2 * p + 1}
# (schedule, m) combinations that every generator must accept for p in {1, 2, 4}.
MUST_RUN = {("gpipe", "p"), ("gpipe", "p+1"), ("gpipe", "2p+1"), ("1f1b", "p"), ("1f1b", "p+1"), ("1f1b", "2p+1"),
            ("zb_h1", "p+1"), ("zb_h1", "2p+1"), ("zb_v", "p+1"), ("braided_v", "2p+1")}


def _accepted(name: str, pp: int, ms) -> list[int]:
    out = []
    for m in ms:
        try:
            schedules.build(name, pp, m)
        except ValueError:
            continue
        out.append(m)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("pp,tp", LAYOUTS, ids=[f"pp{p}-tp{t}" for p, t in LAYOUTS])
def test_schedules_match_reference(pools, pp: int, tp: int) -> None:
    combos = [(name, m, None, tp > 1 and k % 2 == 0) for name in schedules.names()
              for k, m in enumerate(_accepted(name, pp, [m_of(pp) for m_of in M_OF_P.values()]))]
    ran_by_rank = pools(pp * tp).run(cases.equivalence, pp, tp, combos, timeout_s=400)
    ran = {(n, m) for n, m, _ in ran_by_rank[0]}
    if tp > 1:  # every schedule ran sequence-sharded, m not a multiple of p among them; the plain path too
        shard = {(n, m) for n, m, c in ran_by_rank[0] if c["seq_shard"]}
        assert {n for n, _ in shard} == set(schedules.names()) and (pp == 1 or any(m % pp for _, m in shard))
        assert len(shard) < len(ran)
    for name, which in MUST_RUN:
        m = M_OF_P[which](pp)
        assert (name, m) in ran, f"{name} m={m} did not run at pp={pp} tp={tp}; ran: {sorted(ran)}"
    # The braided and W-split paths were really executed (counted on every rank).
    for rank_ran in ran_by_rank:
        counts = {(n, m): c for n, m, c in rank_ran}
        assert counts[("braided_v", 2 * pp + 1)]["braided"] > 0
        assert counts[("zb_h1", 2 * pp + 1)]["W"] > 0
        if tp > 1:
            assert counts[("braided_v", 2 * pp + 1)]["AR"] > 0


def test_invariant_violations_name_rank_instruction_and_microbatch(pools) -> None:
    pool = pools(1)
    (msg,) = pool.run(cases.bad_program, "W0c0\nF0c0\nBW0c0")
    assert "rank 0" in msg and "instruction 0 (W0c0)" in msg and "micro-batch 0" in msg and "stash" in msg
    (msg,) = pool.run(cases.bad_program, "F0c0\nB1c0")
    assert "instruction 1 (B1c0)" in msg and "micro-batch 1" in msg
    (msg,) = pool.run(cases.bad_program, "F0c0\nB0c0")
    assert "ended with work left" in msg  # W0c0 never ran


def test_wrong_world_size_is_a_clear_error(pools) -> None:
    (msg,) = pools(1).run(cases.wrong_world)
    assert "topology is for 4 ranks but 1 processes" in msg


@pytest.mark.slow
def test_a_failing_rank_makes_the_other_fail_within_the_timeout() -> None:
    pool = DistPool(2, timeout_s=5)
    try:
        results = pool.run(cases.failing_rank, 1, timeout_s=60)
    finally:
        pool.close()
    assert results[1].startswith("IndexError"), results
    # Rank 0 waits for rank 1's activation/gradient: it must stop with rank 1's reason.
    assert results[0] != "no error", results
    assert "rank 1" in results[0] and "IndexError" in results[0], results


def test_recording_modes_time_less_and_compute_the_same(pools) -> None:
    # tp=2 so the unit-level all-reduces are recorded (units) or only waited for (the others).
    for rank, got in enumerate(pools(2).run(cases.record_modes, 2)):
        units = got["n_units"]
        for mode in ("instructions", "off", "None"):
            assert got[mode]["loss"] == got["units"]["loss"], (rank, mode)
            assert got[mode]["counts"] == got["units"]["counts"], (rank, mode)
            assert got[mode]["grads"].keys() == got["units"]["grads"].keys()
            for name, g in got[mode]["grads"].items():
                assert torch.equal(g, got["units"]["grads"][name]), (rank, mode, name)
        assert got["units"]["counts"]["AR"] > 0
        assert got["units"]["compute"] == got["units"]["with_unit"] == units
        assert got["units"]["ar"] == got["units"]["counts"]["AR"] and got["units"]["exposed"]
        assert got["instructions"]["compute"] == got["ops"] and got["instructions"]["with_unit"] == 0
        assert got["instructions"]["ar"] == 0 and not got["instructions"]["exposed"]
        assert got["instructions"]["memory"] == got["units"]["memory"] > 0
        for mode in ("off", "None"):
            assert got[mode]["compute"] == got[mode]["memory"] == 0 and got[mode]["meta_record"] == "off"
        assert "record='unit'" in got["bad"] and "units, instructions, off" in got["bad"]
        assert got["named"] <= got["ranges"], sorted(got["named"] - got["ranges"])[:5]  # every block, op and unit
        assert any("&" in n for n in got["named"])  # braided blocks ("F2c0&B0c1") among them
        assert "record='all'" in got["bad_init"]


def _every_choice(name: str, pp: int, m: int) -> str:
    """``name``'s plan with its blocks run every way :mod:`braid.planner.braid_tune` can choose, in turn,
    and its fusable pairs of plain ops fused every way (pairs that share no op)."""
    from braid.planner.braid_tune import FUSES, VARIANTS, apply_choices, fusable_pairs

    plan = schedules.build(name, pp, m)
    blocks = [(r, i) for r, ops in enumerate(plan.ranks) for i, ins in enumerate(ops) if hasattr(ins, "lead")]
    choices = {blk: VARIANTS[k % len(VARIANTS)] for k, blk in enumerate(blocks)}
    sites = [(r, i) for r, i in fusable_pairs(plan) if (r, i - 1) not in fusable_pairs(plan)]
    choices |= {site: FUSES[k % len(FUSES)] for k, site in enumerate(sites)}
    return apply_choices(plan, choices).to_json()


# Stages cut between a layer's attention and its MLP: one ends with an attention half, the
# next starts with the MLP half (stage 1 of four holds only that); the head's stage too.
HALVES = {1: (2,), 2: (1.5, 1.5), 4: (1.5, 0.5, 1.5, 0.5)}


@pytest.mark.parametrize("pp,tp", [(2, 1), (2, 2)], ids=["pp2-tp1-fused", "pp2-tp2-cut"])
def test_half_layer_stages_match_reference(pools, pp: int, tp: int) -> None:
    # at tp=2 every other schedule sequence-sharded: a stage then ends on the attention half's reduce-scatter
    combos = [(name, 2 * pp + 1, None, tp > 1 and k % 2 == 0) for k, name in enumerate(schedules.names())]
    ran_by_rank = pools(pp * tp).run(cases.equivalence, pp, tp, combos, None, None, "none", HALVES, timeout_s=400)
    ran = {n for n, _, _ in ran_by_rank[0]}
    assert {"1f1b", "zb_v", "braided_v", "dualpipe_v"} <= ran, sorted(ran)
    if tp > 1:
        assert all(dict((n, c) for n, _, c in r)["braided_v"]["AR"] > 0 for r in ran_by_rank)


@pytest.mark.parametrize("name", ["braided_v", "dualpipe_v"])
def test_braid_choices_match_reference(pools, name: str) -> None:
    # What the braiding pass may choose (split blocks in either order, a fixed lead, a trailing
    # all-reduce kept inside its block, two plain ops fused into a block) runs through the same programs and gives the reference's
    # loss, gradients and parameters; tp=2 so leads and carries change the all-reduce order.
    pp, tp, m = 2, 2, 5
    plan_json = _every_choice(name, pp, m)
    assert "/a" in plan_json and "/b" in plan_json and "/n" in plan_json
    assert '"F0c0&F1c0"' in plan_json  # a block fused from two plain warm-up forwards
    ran_by_rank = pools(pp * tp).run(cases.equivalence, pp, tp, [(name, m, plan_json)], timeout_s=400)
    for rank_ran in ran_by_rank:
        assert [(n, mm) for n, mm, _ in rank_ran] == [(name, m)]
        assert rank_ran[0][2]["braided"] > 0 and rank_ran[0][2]["AR"] > 0


def test_sequence_parallel_matches_reference_and_saves_activations(pools) -> None:
    # Sequence parallelism inside TP (braid.tp.seq_shard) at tp=2, with and without recomputation:
    # the reference's loss, gradients and parameters, the same count of reductions as the
    # all-reduce path, gathers run ahead of their unit, and a lower measured peak of saved
    # activations than that path.
    pool = pools(2)
    plain, = pool.run(cases.equivalence, 1, 2, [("braided_v", 3)], timeout_s=120)[:1]
    for recompute in ("none", "full"):
        for rank, got in enumerate(pool.run(cases.equivalence, 1, 2, [("braided_v", 3)], None, None, recompute, None, True,
                                            timeout_s=120)):
            (_, _, c), = got
            assert c["seq_shard"] and c["braided"] > 0 and c["AR"] == plain[0][2]["AR"], (rank, recompute, c)
            # some braided block's following member started its first unit's gather with the block
            # (braiding.early_heads: the pre_attn after the V turn, the last layer's mlp backward)
            assert c["early_AG"] > 0 and plain[0][2]["early_AG"] == 0, (rank, recompute, c)
            if recompute == "none" and rank == 0:
                assert c["peak_bytes"] < plain[0][2]["peak_bytes"], (c["peak_bytes"], plain[0][2]["peak_bytes"])
    # What sharding saves per unit is what the cost model's runtime count takes off (the norms' and the
    # column-parallel inputs' bytes over t, the LM head's input too; the attention and MLP cores keep theirs).
    (kept0, model0), _ = pool.run(cases.seq_shard_saved_bytes, False, timeout_s=60)
    (kept1, model1), _ = pool.run(cases.seq_shard_saved_bytes, True, timeout_s=60)
    for unit in kept0:
        assert kept0[unit] - kept1[unit] == model0[unit] - model1[unit], (unit, kept0, kept1, model0, model1)
    assert kept1["pre_attn"] < kept0["pre_attn"] and kept1["attn"] == kept0["attn"]


def test_a_split_backward_stashes_the_ranks_tokens_and_w_gathers_them(pools) -> None:
    # Under sequence sharding the column-parallel linears' input gradient does not read their input: B
    # stashes the rank's s/t tokens for W (not the gathered sequence, Megatron's choice too), W gathers
    # them, and the weight gradients are those of the unsharded layer. So for the row-parallel linears'
    # output gradient (the same on every TP rank): B stashes the rank's tokens of it, W gathers them.
    pool = pools(2)
    whole = pool.run(cases.seq_shard_w_stash, False, timeout_s=60)
    shard = pool.run(cases.seq_shard_w_stash, True, timeout_s=60)

    def halved(a: list, b: list) -> bool:  # (b, s, h) without sharding, (b, s/2, h) with it
        return len(a) == len(b) > 0 and all(x[:1] + x[2:] == y[:1] + y[2:] and x[1] == 2 * y[1] for x, y in zip(a, b))

    for rank, ((st0, held0, g0, _, _), (st1, held1, g1, (boxes, boxed), _)) in enumerate(zip(whole, shard)):
        assert halved(st0[0], st1[0]) and halved(st0[1], st1[1]), (rank, st0, st1)
        assert boxes > 0 and boxed == [], (rank, boxes, boxed)  # a box left (the last norm's) holds no stashed tokens
        assert held1[-1] == [] and held0[-1] == [], (rank, held0, held1)
        assert [n for n, _ in g0] == [n for n, _ in g1], rank
        scale = max(float(a.abs().max()) for _, a in g0)
        for (n, a), (_, b) in zip(g0, g1):  # float64 sums in another order (norms on the rank's tokens)
            assert_matches_reference(b, a, what=f"rank {rank} sharded {n}.grad", scale=scale)
    # a full backward's micro-batch (W right after B, nothing to gather beside) keeps the output gradients whole;
    # the inputs are still the rank's tokens, and the weight gradients the same
    joint = pool.run(cases.seq_shard_w_stash, True, True, timeout_s=60)
    for rank, ((st0, _, g0, _, _), (stj, heldj, gj, _, _)) in enumerate(zip(whole, joint)):
        assert halved(st0[0], stj[0]) and stj[1] == st0[1], (rank, st0, stj)
        assert heldj[-1] == [], (rank, heldj)
        scale = max(float(a.abs().max()) for _, a in g0)
        for (n, a), (_, b) in zip(g0, gj):
            assert_matches_reference(b, a, what=f"rank {rank} joint {n}.grad", scale=scale)
    # At one sample per micro-batch the gathered sequence is its buffer itself, and the attention unit's gradient
    # of the residual (its norm backward plus the residual) is summed into the rank's own slot of it: no second
    # tensor of the rank's tokens beside the whole while the unit's backward runs. A full backward keeps it there
    # (its W holds the whole anyway); a split B copies it out, so its stash holds s/t tokens until W, not the
    # buffer. The MLP's is the received gradient, gathered apart. Weight gradients as without sharding.
    # Below the LM head the MLP's is the head's norm backward, copied into its slot (one copy per micro-batch).
    for joint, head in [(False, False), (True, False), (False, True), (True, True)]:
        one = pool.run(cases.seq_shard_w_stash, False, joint, 1, head, timeout_s=60)
        got = pool.run(cases.seq_shard_w_stash, True, joint, 1, head, timeout_s=60)
        for rank, ((*_, g0, _, slots0), (*_, g1, _, slots1)) in enumerate(zip(one, got)):
            assert slots0 == [("mlp", False), ("attn", False)], (rank, slots0)
            assert slots1 == [("mlp", joint and head), ("attn", joint)], (rank, joint, head, slots1)
            scale = max(float(a.abs().max()) for _, a in g0)
            for (n, a), (_, b) in zip(g0, g1):
                assert_matches_reference(b, a, what=f"rank {rank} b=1 joint={joint} head={head} {n}.grad", scale=scale)


def test_separate_linears_of_one_gathered_input_share_its_gather(pools) -> None:
    # Under sequence sharding Q, K and V (and gate and up) save one gathered input: as separate linears
    # (a 7b-sized layer's) they keep one slot of the rank's tokens and gather it once for the backward,
    # as the grouped GEMM of the tiny model does -- and still compute the reference's values.
    pool = pools(2)
    grouped = pool.run(cases.seq_shard_gathers, True, timeout_s=120)
    apart = pool.run(cases.seq_shard_gathers, False, timeout_s=120)
    for rank, ((n_grouped, ran_g), (n_apart, ran_a)) in enumerate(zip(grouped, apart)):
        assert [(n, m) for n, m, _ in ran_a] == [("braided_v", 3), ("zb_v", 2)], (rank, ran_a)
        assert n_grouped > 0 and n_apart == n_grouped, (rank, n_grouped, n_apart)


@pytest.mark.parametrize("pp,tp", [(2, 1), (2, 2)], ids=["pp2-tp1", "pp2-tp2"])
def test_staged_transfers_match_reference_and_reuse_their_buffers(pools, pp: int, tp: int) -> None:
    """A captured step sends and receives through kept staging buffers (braid.runtime.p2p: a graph's pool never
    reuses a freed message tensor). Forced on here, without a capture: the same losses, gradients and parameters
    as the single process, m not a multiple of p included; and fewer buffers than messages (they are reused)."""
    combos = [(name, m) for name in ("braided_v", "zb_v", "1f1b_i", "dualpipe_v") for m in (4, 5)]
    ran_by_rank = pools(pp * tp).run(cases.equivalence, pp, tp, combos, None, None, "none", None, False, True, timeout_s=400)
    for rank, rank_ran in enumerate(ran_by_rank):
        assert {(n, m) for n, m, _ in rank_ran} >= {("braided_v", 5), ("zb_v", 5), ("1f1b_i", 4)}, rank_ran
        for name, m, counts in rank_ran:
            assert 0 < counts["staging_made"] < counts["P2P"], (rank, name, m, counts)
            assert counts["sends_held"] == 0, (rank, name, m, counts)  # sent tensors go with the step, not the next one
    if tp == 1:  # by default an eager step sends and receives its own tensors: no staging buffer is made
        for rank_ran in pools(pp).run(cases.equivalence, pp, 1, [("zb_v", 4)], timeout_s=200):
            assert [c["staging_made"] for _, _, c in rank_ran] == [0] and rank_ran[0][2]["P2P"] > 0, rank_ran


def test_sends_go_as_their_batch_completes_in_order_of_posting() -> None:
    """After a receive and before a compute instruction the executor finishes every send whose batch was waited (with a
    receive) or is complete (eager) and keeps the others, in order: a rank that only sends late in the step does not pile its tensors up
    until the end (the simulator frees a sent tensor as its send ends)."""
    from types import SimpleNamespace

    from braid.runtime.executor import Executor

    class Work:
        def __init__(self, done: bool) -> None:
            self.done = done

        def is_completed(self) -> bool:
            return self.done

    finished: list[str] = []
    sends = [([Work(True)], "a", 0), ([Work(False), Work(True)], "b", 1), ([], "c", 2), ([Work(False)], "d", 3)]
    fake = SimpleNamespace(_sends=list(sends), _finish_transfer=lambda works, t, start: finished.append(t), capturing=True)
    Executor._drop_sent(fake)  # a capture cannot ask a work: only the batch already waited (with a receive) goes
    assert finished == ["c"] and [t for _, t, _ in fake._sends] == ["a", "b", "d"]
    finished.clear()
    fake.capturing, fake._sends = False, list(sends)
    Executor._drop_sent(fake)
    assert finished == ["a", "c"] and [t for _, t, _ in fake._sends] == ["b", "d"]
    fake._sends[0][0][0].done = True
    Executor._drop_sent(fake)
    assert finished == ["a", "c", "b"] and [t for _, t, _ in fake._sends] == ["d"]
