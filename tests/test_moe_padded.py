"""Expert parallelism with the padded all-to-all (``--moe-dispatch padded``) against the single-process model (gloo).

:class:`braid.runtime.expert_parallel.PaddedAllToAllDispatch` sends every expert-parallel peer a
block of C rows (real rows first, zeros after) and reads nothing on the host. The same
equivalence as ``test_moe_pipeline.py``'s (``moe_cases.ep_equivalence``: the step's loss, every
gradient, the parameters after two AdamW steps, float64, within the reference's rounding bound)
at dp=2 x ep=2 and pp=2 x (dp=2, ep=2), for plain, interleaved and braided schedules (and with the
compiled unit functions); and one
MoE layer's forward and backward, fp32 through ``torch._grouped_mm``, with every host read of a
tensor made to raise.
"""

from __future__ import annotations

import pytest

import moe_cases as cases

PLAIN = [("1f1b", 3), ("1f1b_i", 4), ("zb_v", 4)]
BRAIDED = [("braided_v", 5), ("braided_v_lowmem", 5), ("braided_v_offload", 5), ("dualpipe_v", 5)]


@pytest.mark.slow
@pytest.mark.parametrize("pp,world", [(1, 2), (2, 4)])
def test_padded_all_to_all_matches_single_process(pools, pp: int, world: int) -> None:
    runs = PLAIN + BRAIDED
    got = pools(world).run(cases.ep_equivalence, pp, 2, runs, None, 0.2, 1, False, "padded", timeout_s=600)
    assert got == [[f"{n} m={m}" for n, m in runs]] * world


@pytest.mark.slow
def test_padded_all_to_all_with_compiled_units(pools) -> None:
    want = ["1f1b m=3", "braided_v m=5"]
    assert pools(2).run(cases.ep_equivalence, 1, 2, [("1f1b", 3), ("braided_v", 5)], None, 0.2, 1, True, "padded",
                        timeout_s=300) == [want] * 2


@pytest.mark.slow
def test_padded_layer_reads_nothing_on_the_host(pools) -> None:
    padding = pools(2).run(cases.padded_moe_reads_no_host, timeout_s=120)
    assert all(n > 0 for n in padding), padding  # the blocks held padding, which the experts' rows left out
