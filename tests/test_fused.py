"""Fused chunks (one backward engine call per op where nothing needs the unit cuts), in gloo processes.

At tp=1 without offload the executor runs its chunks fused; at tp=2 or with an offload
program it keeps the cuts, and asking for fused mode there is refused. Fused and cut mode
give the same losses and gradients (within fp32 rounding: the same sums in another order)
and the same parameters after two AdamW steps, for braided_v, 1f1b_i and zb_v at pp=1 and
pp=2. (That both equal the single-process reference is ``test_executor.py``'s job.)
"""

from __future__ import annotations

import pytest

import fused_cases as cases

SCHEDULES = ("braided_v", "1f1b_i", "zb_v")


@pytest.mark.parametrize("pp", [1, 2])
def test_fused_and_cut_mode_agree(pools, pp: int) -> None:
    combos = [(name, 4) for name in SCHEDULES]  # m a multiple of p (1f1b_i)
    for ran in pools(pp).run(cases.fused_matches_cut, pp, 1, combos, timeout_s=300):
        assert [(n, m) for n, m, _, _ in ran] == combos
        assert all(fused for _, _, fused, _ in ran), f"tp=1 without offload did not run fused: {ran}"


@pytest.mark.parametrize("tp", [1, 2])
def test_mode_is_chosen_by_tp_and_offload(pools, tp: int) -> None:
    for got in pools(2 * tp).run(cases.modes_chosen, tp, timeout_s=300):
        assert got["braided_v"] == ([True] if tp == 1 else [False]), got
        assert got["braided_v_offload"] == [False], got
        assert got["braided_v fuse=True"] == ("accepted" if tp == 1 else
                                              "fused chunk requested (fuse=True), but tensor parallelism (tp > 1) needs the unit cuts; build it with fuse=None"), got
        assert "the program offloads activations needs the unit cuts" in str(got["braided_v_offload fuse=True"]), got


def test_fused_at_tp2_is_not_taken(pools) -> None:
    ran = pools(2).run(cases.fused_matches_cut, 1, 2, [("braided_v", 3)], timeout_s=300)
    assert all(not fused for r in ran for _, _, fused, _ in r), ran
