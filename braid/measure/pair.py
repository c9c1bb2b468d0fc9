"""A collective beside compute on one GPU: how much longer each takes than alone (CUDA).

A braided block issues one member's collective (a TP all-reduce, an expert-parallel all-to-all) and runs
the other member's GEMMs beside it on another stream. :func:`collective_pair` times that pair and each
alone; :func:`pair_slowdown_of` turns the pair into the simulator's slowdown of compute beside an
in-flight collective (``ar_slowdown``, ``a2a_slowdown`` of :class:`braid.cost.costs.CostModel`).
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

import torch
import torch.distributed as dist


def pair_slowdown_of(window_s: float, gemm_alone_s: float, together_s: float) -> float:
    """The slowdown ``f`` of compute beside an in-flight collective that gives the pair's time: GEMMs of
    ``gemm_alone_s`` issued beside a collective of ``window_s`` (its time beside them) were both done after
    ``together_s``. The simulator slows compute by ``f`` inside the window ``w``: ``together = w + g - w / f``,
    so ``f = w / (w + g - together)``, in [1, 4]. This holds what a GEMM timed on its own stream misses:
    beside a collective it starts late (persistent GEMM kernels wait for the SMs the collective holds)."""
    w, g, t = window_s, gemm_alone_s, together_s
    if t <= max(g, w):
        return 1.0
    return 4.0 if w + g - t <= w / 4.0 else w / (w + g - t)


def collective_pair(x: torch.Tensor, group, a: torch.Tensor, b: torch.Tensor, ar: float, one: float,
                    dev: torch.device, n: int, all_reduce: Callable[[torch.Tensor], Any] | None = None) -> dict[str, float]:
    """How much longer a collective takes while compute runs beside it (CUDA; ``ar_stretch``),
    and how much longer the compute takes beside it (``gemm_slowdown``). The collective is the
    all-reduce of ``x`` over ``group`` unless ``all_reduce`` issues another (async, returning a
    work handle: an all-to-all of ``x`` for the expert-parallel pair); ``ar``: its time alone,
    ``one``: one GEMM ``a @ b``'s. The keys keep the all-reduce's names.

    Both ranks start together (a barrier, then a sync); the all-reduce is issued, then GEMMs
    that outlast it go to another stream, as the next unit task of a braided block would; the
    all-reduce's time is from its issue to its end on the issuing stream. Alone: the same
    without the GEMMs. The ratio of the medians, clamped to [1, 4]. The GEMMs' own time on
    their stream, over the same GEMMs alone, is the slowdown the all-reduce causes; the time
    until both are done (``together_s``) is what a braided block pays for the pair.
    """
    if all_reduce is None:
        all_reduce = lambda t: dist.all_reduce(t, group=group, async_op=True)  # noqa: E731
    side = torch.cuda.Stream(device=dev)
    reps = max(1, int(3 * ar / one)) if one > 0 else 1

    def timed(with_ar: bool, with_gemm: bool) -> tuple[float, float, float]:
        ar_t, gemm_t, both_t = [], [], []
        for _ in range(n + 1):
            torch.cuda.synchronize(dev)
            dist.barrier(group=group)
            torch.cuda.synchronize(dev)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            gs, ge = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            work = all_reduce(x) if with_ar else None
            if with_gemm:
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    gs.record(side)
                    for _ in range(reps):
                        a @ b
                    ge.record(side)
            if work is not None:
                work.wait()
            e.record()
            torch.cuda.synchronize(dev)
            ar_t.append(s.elapsed_time(e) / 1e3 if with_ar else 0.0)
            gemm_t.append(gs.elapsed_time(ge) / 1e3 if with_gemm else 0.0)
            both_t.append(max(s.elapsed_time(e), s.elapsed_time(ge) if with_gemm else 0.0) / 1e3)
        return tuple(statistics.median(v[1:]) for v in (ar_t, gemm_t, both_t))  # type: ignore[return-value]

    alone = timed(True, False)[0]
    gemm_alone = timed(False, True)[1]
    beside, gemm_beside, together = timed(True, True)
    return {"ar_alone_s": alone, "ar_beside_s": beside, "ar_stretch": min(4.0, max(1.0, beside / alone)) if alone > 0 else 1.0,
            "gemm_alone_s": gemm_alone, "gemm_beside_s": gemm_beside,
            "gemm_slowdown": gemm_beside / gemm_alone if gemm_alone > 0 else 1.0, "together_s": together}
