"""Where a mixture-of-experts layer's rows go: the routing plan, the all-to-all exchanges, and the layer's
MoE path in one piece (:func:`moe_forward`) or cut at the exchanges (the chunk runner's units).

One MoE layer's token flow on one rank: the router's top-k slots sorted by expert
(:func:`braid.models.moe.permute`: rows ``(T*k, h)`` and rows per expert ``counts``) ->
:meth:`Dispatcher.plan` turns ``counts`` into a :class:`RowPlan` -> :func:`sent_rows` (this TP
rank's experts' rows) -> the **dispatch** exchange (:func:`exchange`) -> :func:`expert_rows`
(received rows regrouped by local expert) -> the experts -> :func:`returned_rows` (back in the
order they came) -> the **combine** exchange (``back=True``) -> :func:`combined_rows` (the other
TP ranks' rows as zeros) -> :func:`braid.models.moe.unpermute`. Without expert parallelism
nothing moves (``RowPlan.send_splits`` is None) and the exchanges are identities.

An exchange's backward is the exchange the other way (the splits swapped). :func:`moe_forward`
runs the whole path with blocking exchanges inside autograd (the single-device model, a fused
chunk); a cut chunk (:mod:`braid.models.moe_ops`) stops at each exchange and hands it to the
executor, which starts it asynchronously (:class:`Exchange`) -- the unit boundary
(:mod:`braid.core.braiding`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from braid.models.moe import Experts, permute, route, unpermute


@dataclass(frozen=True, slots=True)
class RowPlan:
    """Where one micro-batch's expert-sorted rows of one MoE layer go and come from.

    ``counts``: rows per local expert once they are here (what the experts' grouped GEMMs take);
    ``before``/``after``: rows of experts held by other TP ranks before/after this rank's slice
    (left out of the exchange, zeros in the combine); ``send_splits``/``recv_splits``: rows sent
    to / received from each expert-parallel rank (None: nothing moves); ``order``: received rows
    (by source rank, then local expert) -> sorted by local expert, ``inverse`` its inverse.
    """

    counts: torch.Tensor
    before: int = 0
    after: int = 0
    send_splits: list[int] | None = None
    recv_splits: list[int] | None = None
    group: Any = None
    order: torch.Tensor | None = None
    inverse: torch.Tensor | None = None

    @property
    def moves(self) -> bool:
        return self.send_splits is not None


class Dispatcher(Protocol):
    """Plans where the expert-sorted rows of one rank go (:class:`RowPlan`)."""

    @property
    def moves(self) -> bool:
        """Whether rows cross ranks (an all-to-all per exchange)."""
        ...

    def plan(self, counts: torch.Tensor) -> RowPlan:
        """Rows per global expert ``counts`` (E,) -> the plan of this micro-batch's rows."""
        ...


class LocalDispatch:
    """Every expert on this device: nothing moves."""

    moves = False

    def plan(self, counts: torch.Tensor) -> RowPlan:
        return RowPlan(counts)


LOCAL = LocalDispatch()


class ExpertSlice:
    """This TP rank's experts ``[first, first + count)``: the tokens are the same on every TP rank, so
    each runs its own experts on their rows and leaves the others' rows zero; the MLP unit's TP
    all-reduce then sums the ranks' parts (no token moves). ``inner``: how the slice's rows reach
    its experts (expert parallelism within the slice; default: they are all here)."""

    def __init__(self, first: int, count: int, inner: Dispatcher = LOCAL) -> None:
        self.first, self.count, self.inner = first, count, inner

    @property
    def moves(self) -> bool:
        return self.inner.moves

    def plan(self, counts: torch.Tensor) -> RowPlan:
        before = int(counts[:self.first].sum())  # rows are sorted by expert: one host read per layer
        mine = counts[self.first:self.first + self.count]
        n = int(mine.sum())
        return replace(self.inner.plan(mine), before=before, after=int(counts.sum()) - before - n)


@dataclass(frozen=True, slots=True)
class Exchange:
    """One ``all_to_all_single`` of rows: ``send`` in blocks of ``in_splits`` rows to the group's ranks,
    ``out`` filled with ``out_splits`` rows from each (the executor starts it, :meth:`start`)."""

    out: torch.Tensor
    send: torch.Tensor
    out_splits: list[int]
    in_splits: list[int]
    group: Any

    def start(self, async_op: bool = True) -> Any:
        return dist.all_to_all_single(self.out, self.send, self.out_splits, self.in_splits, group=self.group,
                                      async_op=async_op)


def exchange(rows: torch.Tensor, plan: RowPlan, back: bool = False) -> Exchange | None:
    """The exchange that takes ``rows`` (no autograd) to the experts' ranks (``back``: from them back
    to the tokens' ranks); None where nothing moves."""
    if plan.send_splits is None:
        return None
    out_splits, in_splits = (plan.send_splits, plan.recv_splits) if back else (plan.recv_splits, plan.send_splits)
    out = rows.new_empty(sum(out_splits), *rows.shape[1:])
    return Exchange(out, rows.detach().contiguous(), out_splits, in_splits, plan.group)


class _Exchanged(torch.autograd.Function):
    """:func:`exchange` inside autograd, blocking; its backward is the exchange the other way."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, plan: RowPlan, back: bool) -> torch.Tensor:
        ctx.plan, ctx.back = plan, back
        req = exchange(rows, plan, back)
        req.start(async_op=False)
        return req.out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        req = exchange(g, ctx.plan, not ctx.back)
        req.start(async_op=False)
        return req.out, None, None


def exchanged(rows: torch.Tensor, plan: RowPlan, back: bool = False) -> torch.Tensor:
    """``rows`` after the exchange (blocking, differentiable); ``rows`` where nothing moves."""
    return rows if plan.send_splits is None else _Exchanged.apply(rows, plan, back)


def sent_rows(rows: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """The expert-sorted rows (T*k, h) this rank's experts run: its TP slice of them."""
    if plan.before or plan.after:
        return rows[plan.before:rows.shape[0] - plan.after]
    return rows


def expert_rows(got: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """Received rows (by source rank, then local expert) -> sorted by local expert."""
    return got if plan.order is None else got[plan.order]


def returned_rows(out: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """The experts' output rows back in the order they were received."""
    return out if plan.inverse is None else out[plan.inverse]


def combined_rows(rows: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """This TP slice's rows back among all T*k rows (the other slices' rows zero)."""
    if plan.before or plan.after:
        return F.pad(rows, (0, 0, plan.before, plan.after))
    return rows


def moe_forward(h: torch.Tensor, logits: torch.Tensor, experts: Experts, *, top_k: int, norm_topk_prob: bool,
                num_experts: int, dispatcher: Dispatcher = LOCAL) -> torch.Tensor:
    """The MoE MLP of normed hidden states ``h`` (..., hidden) given their router ``logits`` (..., E),
    the exchanges blocking (module doc)."""
    shape = h.shape
    h2 = h.reshape(-1, shape[-1])  # (T, hidden)
    weights, chosen = route(logits.reshape(-1, logits.shape[-1]), top_k, norm_topk_prob)
    rows, order, counts = permute(h2, chosen, num_experts)  # (T*k, hidden)
    plan = dispatcher.plan(counts)
    got = exchanged(sent_rows(rows, plan), plan)
    out = returned_rows(experts(expert_rows(got, plan), plan.counts), plan)
    out = combined_rows(exchanged(out, plan, back=True), plan)
    return unpermute(out, order, weights, h2.shape[0]).view(shape)
