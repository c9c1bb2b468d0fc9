"""Sequence parallelism inside tensor parallelism (Megatron's ``--sequence-parallel``).

Korthikanti et al. 2022 (Sec. 4.2.2): between a row-parallel linear and the next
column-parallel one, a TP layer holds the residual stream whole on every TP rank, and
the norms and residual adds there run t times over. With the sequence sharded over the
TP group instead, the all-reduce after a row-parallel linear (operator g) becomes a
*reduce-scatter* over the sequence, the norm and the residual add run on the rank's
``s/t`` tokens, and an *all-gather* over the sequence (operator g-bar) feeds the next
column-parallel linears; in the backward the roles swap. The layer's activations drop
from ``s*b*h*(10 + 24/t)`` to ``s*b*h*34/t`` bytes (:mod:`braid.cost.costs`).

Not to be confused with :mod:`braid.models.sequence_parallel` (LoongTrain's 2D-Attention,
``--cp``), which splits every sequence over a group of its own, attention included.
Here the option is named ``seq_shard`` in code and ``--sequence-parallel`` on the
command line; where it runs (and the refusals where it does not) is :mod:`braid.io.cli`.

Layout: activations are ``(b, s, h)``; rank ``r`` of the TP group holds tokens
``[r*s/t, (r+1)*s/t)`` of every sample. The collectives run over dim 0 of a
``(t, b, s/t, h)`` view, which is the activation itself for ``b == 1`` and a copy
otherwise.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist


class Scatter(NamedTuple):
    """A unit's request to reduce-scatter its output over the sequence: ``src`` (t, b, s/t, h), the
    output (b, s, h, partial over TP) laid out by destination rank (the output itself for b == 1);
    ``out`` (b, s/t, h), this rank's tokens of the sum once the work ends (the chunk already
    holds ``out`` as the unit's result, as it holds an all-reduced tensor, which is reduced in
    place). Whoever waits for the work on another stream than the one ``src`` was made on keeps
    the request until the maker's stream is ordered after it (:mod:`braid.runtime.follow`)."""

    src: torch.Tensor
    out: torch.Tensor


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool = True) -> Any:
    """``out`` (flat, world x ``inp``) = every rank's ``inp``, in rank order; the work (async) or None."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    return fn(out, inp, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool = True) -> Any:
    """``out`` = this rank's 1/world of the sum of every rank's flat ``inp``; the work (async) or None."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


def scatter_request(full: torch.Tensor, t: int) -> Scatter:
    """A :class:`Scatter` of ``full`` (b, s, h) with a new output buffer (b, s/t, h)."""
    b, s, *rest = full.shape
    src = full.reshape(b, t, s // t, *rest).transpose(0, 1).contiguous()  # (t, b, s/t, h): a view for b == 1
    return Scatter(src, full.new_empty((b, s // t, *rest)))


def reduce_scatter(req: Scatter, group: Any, async_op: bool = True) -> Any:
    """Sum ``req.src`` over ``group`` and leave this rank's tokens in ``req.out``; the work handle
    (None when ``async_op`` is False)."""
    return reduce_scatter_into(req.out.view(-1), req.src.view(-1), group, async_op)


def gather_buffer(like: torch.Tensor, group: Any) -> torch.Tensor:
    """An empty all-gather buffer (t, b, s/t, h) for every rank's tokens shaped as ``like`` (b, s/t, h)."""
    return like.new_empty((dist.get_world_size(group), *like.shape))


def gather_start(local: torch.Tensor, group: Any, buf: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
    """Start the all-gather of every rank's tokens ``local`` (b, s/t, h): returns its buffer
    (t, b, s/t, h; ``buf`` if given, made by :func:`gather_buffer`) and the work; :func:`gathered_view`
    reads the buffer once the work has ended. ``local`` may be ``buf``'s own slot (``buf[rank]``): the
    gather then runs in place, with no second copy of the rank's tokens."""
    buf = gather_buffer(local, group) if buf is None else buf
    return buf, all_gather_into(buf.view(-1), local.contiguous().view(-1), group)


def gathered_view(buf: torch.Tensor) -> torch.Tensor:
    """The whole sequence (b, s, h) of a :func:`gather_start` buffer (a view for b == 1, else a copy)."""
    t, b, n, *rest = buf.shape
    return buf.transpose(0, 1).reshape(b, t * n, *rest)


def reduce_now(req: torch.Tensor | Scatter, group: Any) -> None:
    """A unit's TP reduction, blocking: all-reduce in place, or the reduce-scatter of a :class:`Scatter`."""
    if isinstance(req, Scatter):
        reduce_scatter(req, group, async_op=False)
    else:
        dist.all_reduce(req, group=group)


class _AddShardResidual(torch.autograd.Function):
    """``out`` with ``residual`` added into the rank's tokens, in place; its backward hands the output
    gradient on as it is (autograd's own in-place add on a slice would copy the whole of it first)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, residual: torch.Tensor, rank: int) -> torch.Tensor:
        add_shard_residual(out, residual, rank)  # (grad mode is off in here: the plain in-place add)
        ctx.mark_dirty(out)
        ctx.span = (rank * residual.shape[1], residual.shape[1])
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start, n = ctx.span
        return grad, grad.narrow(1, start, n) if ctx.needs_input_grad[1] else None, None


def add_shard_residual(out: torch.Tensor, residual: torch.Tensor, rank: int) -> torch.Tensor:
    """The fused residual under sequence sharding: ``residual`` (b, s/t, h), this rank's tokens of
    the layer input, added once into its own tokens of ``out`` (b, s, h, partial over TP), so
    that the reduce-scatter's sum holds it exactly once (in place: no second (b, s, h) tensor, and
    the backward passes the gathered output gradient through without a copy)."""
    if torch.is_grad_enabled() and (out.requires_grad or residual.requires_grad):
        return _AddShardResidual.apply(out, residual, rank)
    n = residual.shape[1]
    out.narrow(1, rank * n, n).add_(residual)
    return out
