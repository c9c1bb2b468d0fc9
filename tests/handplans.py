"""Hand-written plans, independent of the schedule generators under test."""

from braid.core.ir import Braided, Compute, OpKind, Plan, ScheduleConfig


def one_f_one_b(p: int, m: int) -> Plan:
    """A hand-written 1F1B, independent of the generators under test."""
    ranks = []
    for r in range(p):
        ops, fi, bi = [], 0, 0
        for _ in range(min(p - r - 1, m)):
            ops.append(Compute(OpKind.F, fi, 0))
            fi += 1
        while fi < m:
            ops += [Compute(OpKind.F, fi, 0), Compute(OpKind.BW, bi, 0)]
            fi, bi = fi + 1, bi + 1
        ops += [Compute(OpKind.BW, b, 0) for b in range(bi, m)]
        ranks.append(tuple(ops))
    return Plan("hand_1f1b", ScheduleConfig(p, m, 1), "loop", tuple(ranks))


def v_shape_braided(m: int) -> Plan:
    """p=2 V-shaped plan with a braided F&B block and a W split, written by hand."""
    F, B, W, BW = OpKind.F, OpKind.B, OpKind.W, OpKind.BW
    c = Compute
    # rank 0 holds stages 0 and 3, rank 1 holds stages 1 and 2.
    r0 = [c(F, 0, 0), c(F, 1, 0), c(F, 0, 1), Braided(c(F, 1, 1), c(BW, 0, 1)), c(B, 0, 0), c(BW, 1, 1),
          c(BW, 1, 0), c(W, 0, 0)]
    r1 = [c(F, 0, 0), c(F, 0, 1), c(F, 1, 0), c(F, 1, 1), c(BW, 0, 1), c(BW, 0, 0), c(BW, 1, 1), c(BW, 1, 0)]
    assert m == 2
    return Plan("hand_v", ScheduleConfig(2, 2, 2), "v", (tuple(r0), tuple(r1)))
