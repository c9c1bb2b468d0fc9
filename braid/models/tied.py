"""Tied embeddings across pipeline stages: one copy per holder, gradients summed.

A tied model (``cfg.tie_embeddings``) uses one matrix as the token embedding (first
stage) and the LM head (last stage). The chunk builder gives each of those chunks its own
copy -- the same values, sharded over TP the same way (by vocabulary rows) -- and marks
both with a :class:`Tie`. After a step each copy holds the gradient of its own use; the
single-device model's gradient is their sum. :func:`reduce_tied_gradients` forms that sum
on every holder (locally when one rank holds both, as the V placement does; by one
exchange between the two pipeline ranks otherwise), so the copies receive the same
gradient and stay equal under any deterministic optimizer. It is called by
:func:`braid.runtime.distributed.reduce_gradients` before the data-parallel reduction, so
callers need nothing extra. Float addition of two terms commutes, so both holders get the
bitwise same sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

TIE_ATTR = "braid_tie"


@dataclass(frozen=True, slots=True)
class Tie:
    """``key``: which tied matrix; ``pp_ranks``: the pipeline ranks holding a copy (sorted, unique)."""

    key: str
    pp_ranks: tuple[int, ...]


def mark(p: nn.Parameter, tie: Tie) -> None:
    setattr(p, TIE_ATTR, tie)


def tie_of(p: torch.Tensor) -> Tie | None:
    return getattr(p, TIE_ATTR, None)


def _grad(p: nn.Parameter, attr: str = "grad") -> torch.Tensor:
    g = getattr(p, attr, None)
    return g if g is not None else torch.zeros_like(p)


def reduce_tied_gradients(params: Iterable[nn.Parameter], pp_ranks: Sequence[int] | None = None, pp_rank: int = 0,
                          abort: Any = None, attr: str = "grad") -> None:
    """Give every copy of a tied parameter the sum of all copies' gradients.

    ``attr``: where the gradients are: ``"grad"``, or ``"main_grad"`` (the fp32 buffer of
    :class:`braid.training.optimizer.ShardedAdamW`, summed in place: its views stay the
    optimizer's).

    ``pp_ranks``: global ranks of this rank's pipeline (``ProcessGroups.pp_ranks``),
    ``pp_rank`` this rank's index in it; not needed when one rank holds every copy.
    ``abort``: a :class:`braid.runtime.distributed.Abort` whose ``wait`` bounds the exchange.
    """
    by_key: dict[str, list[nn.Parameter]] = {}
    ties: dict[str, Tie] = {}
    for p in params:
        tie = tie_of(p)
        if tie is not None:
            by_key.setdefault(tie.key, []).append(p)
            ties[tie.key] = tie
    for key in sorted(by_key):
        copies, tie = by_key[key], ties[key]
        total = _grad(copies[0], attr)
        for p in copies[1:]:
            total = total + _grad(p, attr)
        peers = [r for r in tie.pp_ranks if r != pp_rank]
        if peers:
            if pp_ranks is None:
                raise ValueError(f"tied parameter {key!r} has copies on pipeline ranks {list(tie.pp_ranks)}: pass pp_ranks")
            if len(peers) != 1:
                raise ValueError(f"tied parameter {key!r}: expected one peer rank, got {peers}")
            mine = total.contiguous()
            theirs = torch.empty_like(mine)
            peer = pp_ranks[peers[0]]
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)])
            for w in works:
                abort.wait(w) if abort is not None else w.wait()
            total = mine + theirs
        for i, p in enumerate(copies):
            if attr == "grad":
                p.grad = total if i == 0 else total.clone()
            else:
                getattr(p, attr).copy_(total)
