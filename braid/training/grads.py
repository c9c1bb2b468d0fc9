"""Global gradient norm and clipping across tp, pp and dp ranks; weight-decay groups.

The norm of the single-process model's gradient, computed on a split model: every
gradient element must be counted exactly once over the whole job.

* TP-sharded parameters (column/row-parallel weights, the vocab-parallel embedding --
  every :class:`braid.tp.layers.DeferredWeightGrad`'s parameters) hold disjoint pieces
  on the TP ranks: each rank counts its piece. A row-parallel bias lives on TP rank 0
  only, so it is counted once too.
* TP-replicated parameters (norm weights) have the same gradient on every TP rank:
  only TP rank 0 counts them (:func:`tp_norm_mask`); so do those whose partial gradients
  were summed over TP ranks (QK-norm, an MoE router: :mod:`braid.models.tp_partial`).
* Pipeline stages hold disjoint layers: each counts its own.
* Data-parallel replicas hold the same reduced gradient: one of them counts it (or,
  with a sharded optimizer, each counts the piece it owns).

The squares are summed with one all-reduce over the job; the clip coefficient is
torch's (``max_norm / (norm + 1e-6)``, at most 1), so clipping matches
:func:`torch.nn.utils.clip_grad_norm_` on one process.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from braid.cost.step_memory import NORM_CHUNK


def decays(p: torch.Tensor) -> bool:
    """Decoupled weight decay applies to matrices (linear weights, embeddings), not to norms or biases."""
    return p.dim() >= 2


def param_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict]:
    """Two AdamW param groups: decayed (matrices) and not decayed (vectors: norm weights, biases)."""
    params = list(params)
    return [{"params": [p for p in params if decays(p)], "weight_decay": weight_decay},
            {"params": [p for p in params if not decays(p)], "weight_decay": 0.0}]


def tp_sharded_ids(modules: Iterable[nn.Module]) -> set[int]:
    """``id`` of every TP-sharded parameter under ``modules`` (the deferred-weight-gradient modules' parameters)."""
    from braid.tp.layers import DeferredWeightGrad

    out: set[int] = set()
    for mod in modules:
        for m in mod.modules():
            if isinstance(m, DeferredWeightGrad):
                out.update(id(p) for p in m._deferred_params() if p is not None)
    return out


def tp_norm_mask(params: Sequence[nn.Parameter], modules: Iterable[nn.Module], tp_rank: int, pp_rank: int = 0) -> list[bool]:
    """Per parameter: does this rank count it in the global norm (TP shards: yes; replicated ones,
    and those whose partial gradients are summed over TP ranks (:mod:`braid.models.tp_partial`):
    TP rank 0 only; the copies of a tied embedding, which hold the same summed gradient
    (:mod:`braid.models.tied`): one copy, on the first pipeline rank holding one)."""
    from braid.models.tied import tie_of
    from braid.models.tp_partial import is_partial

    sharded = tp_sharded_ids(modules)
    seen: set[str] = set()
    out = []
    for p in params:
        counted = tp_rank == 0 or (id(p) in sharded and not is_partial(p))  # a partial one is whole once reduced
        tie = tie_of(p)
        if tie is not None:
            counted = counted and pp_rank == tie.pp_ranks[0] and tie.key not in seen
            seen.add(tie.key)
        out.append(counted)
    return out


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor :func:`torch.nn.utils.clip_grad_norm_` scales gradients by (at most 1)."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def square_sum(g: torch.Tensor) -> torch.Tensor:
    """The sum of ``g``'s squares in float64 (a 0-d tensor), :data:`NORM_CHUNK` elements at a time: one float64 copy
    of a chunk, squared in place, so the temporaries stay bounded whatever the gradient's size (a non-contiguous
    gradient is first flattened into a copy of its own dtype; the executor's and the optimizer's are contiguous)."""
    chunk = NORM_CHUNK
    flat = g.reshape(-1)
    if flat.numel() <= chunk:
        return flat.to(torch.float64, copy=True).square_().sum()
    total = torch.zeros((), dtype=torch.float64, device=g.device)
    for part in flat.split(chunk):
        total += part.to(torch.float64, copy=True).square_().sum()
    return total


def global_grad_norm(grads: Sequence[torch.Tensor | None], counted: Sequence[bool], group: dist.ProcessGroup | None = None,
                     abort: Any = None) -> torch.Tensor:
    """sqrt of the sum over the job of the squares of the counted gradients (collective over ``group``, default all ranks).

    ``counted[i]``: whether this rank counts ``grads[i]``; for gradients replicated over
    data-parallel ranks, pass False on all but one replica (:func:`replica_mask`). ``abort``
    (a :class:`braid.runtime.distributed.Abort`): the all-reduce goes through it (bounded, a lost rank named).
    """
    dev = next((g.device for g in grads if g is not None), torch.device("cpu"))
    sq = torch.zeros((), dtype=torch.float64, device=dev)
    for g, c in zip(grads, counted):
        if c and g is not None:
            sq += square_sum(g)
    if abort is not None:
        abort.all_reduce(sq, group=group)
    elif dist.is_initialized():
        dist.all_reduce(sq, group=group)
    return sq.sqrt()


def replica_mask(mask: Sequence[bool], first_replica: bool) -> list[bool]:
    """``mask`` on the first data-parallel replica, all False on the others (their gradients are copies)."""
    return [m and first_replica for m in mask]


@torch.no_grad()
def clip_grads_(params: Sequence[nn.Parameter], counted: Sequence[bool], max_norm: float | None,
                group: dist.ProcessGroup | None = None, abort: Any = None) -> float:
    """Global norm of ``p.grad`` over the job; scales the gradients to ``max_norm`` if given and finite.

    For an optimizer that steps on ``p.grad`` (plain AdamW after the data-parallel
    all-reduce). Returns the norm before clipping.
    """
    grads = [p.grad for p in params]
    norm = global_grad_norm(grads, counted, group, abort)
    if max_norm is not None and torch.isfinite(norm):
        coef = clip_coefficient(norm, max_norm)
        for g in grads:
            if g is not None:
                g.mul_(coef.to(g.dtype))
    return float(norm)


def check_finite(norm: float, step: int) -> None:
    """Raise ``FloatingPointError`` when the gradient norm is inf or nan (the run must stop)."""
    if not torch.isfinite(torch.tensor(norm)):
        raise FloatingPointError(f"step {step}: gradient norm is {norm}; stopping (lower --lr, set --clip-grad, or check the data)")
