"""Parameters replicated over TP ranks whose gradient each rank holds only a part of.

Most replicated parameters (the RMSNorm weights before attention and MLP) get their whole
gradient on every TP rank: it is computed from the all-reduced input gradient. A few are
applied to a TP rank's share of the work and so collect only that share's gradient: Qwen3's
head norms (each rank normalises its own heads, :mod:`braid.models.qwen3`) and the router of
a mixture of experts whose experts are split over TP ranks (each rank combines its own
experts' outputs, :mod:`braid.models.qwen3_moe`). Such a parameter is marked
(:func:`mark`); :func:`reduce_partial_gradients` sums its gradient over the TP group before
the data-parallel reduction, and the global gradient norm then counts it on TP rank 0 only
(:func:`braid.training.grads.tp_norm_mask`).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

PARTIAL_ATTR = "braid_tp_partial"


def mark(p: nn.Parameter) -> nn.Parameter:
    setattr(p, PARTIAL_ATTR, True)
    return p


def is_partial(p: torch.Tensor) -> bool:
    return bool(getattr(p, PARTIAL_ATTR, False))


def reduce_partial_gradients(params: Iterable[nn.Parameter], tp_group: Any, abort: Any = None, attr: str = "grad") -> None:
    """Sum the gradients of the marked parameters over ``tp_group`` (None: one TP rank, nothing to do), in place.

    ``attr``: ``"grad"`` or ``"main_grad"`` (a :class:`braid.training.optimizer.ShardedAdamW`'s fp32 buffer).
    """
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    works = []
    for p in params:
        g = getattr(p, attr, None)
        if is_partial(p) and g is not None:
            works.append(dist.all_reduce(g, group=tp_group, async_op=True))
    for w in works:
        abort.wait(w) if abort is not None else w.wait()
