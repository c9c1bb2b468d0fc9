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

Two ways rows cross ranks. **Variable splits** (``RowPlan.slots`` None): each peer gets exactly
its rows, so the splits are host integers read from the exchanged counts every layer
(:class:`braid.runtime.expert_parallel.AllToAllDispatch`). **Padded** (``RowPlan.capacity`` set,
:class:`braid.runtime.expert_parallel.PaddedAllToAllDispatch`): every peer gets a block of
``capacity`` rows, its real rows first and zeros after, so the splits are a static shape and
nothing is read on the host (a CUDA graph can capture it). :func:`sent_rows` scatters the sorted
rows into the blocks (``slots``), :func:`expert_rows` regroups the arrived blocks by local expert
with the padding last and zeroed (``order``, ``real``), :func:`returned_rows` zeroes the padding
rows' outputs (and so their gradients), :func:`combined_rows` gathers the rows back out of the
returned blocks. Exact: the real rows meet the same experts in the same order as with splits.

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

    Padded exchanges (module doc): ``capacity`` rows per peer block (the splits are ``capacity``
    each); ``slots`` (T*k,): the block slot of each sorted row; ``real`` (ep*capacity,): which
    rows in the experts' order (``order`` applied) are real, the padding being after the last group.
    """

    counts: torch.Tensor
    before: int = 0
    after: int = 0
    send_splits: list[int] | None = None
    recv_splits: list[int] | None = None
    group: Any = None
    order: torch.Tensor | None = None
    inverse: torch.Tensor | None = None
    capacity: int | None = None
    slots: torch.Tensor | None = None
    real: torch.Tensor | None = None
    ce: Any = None  # padded under the copy-engine EP backend: the group's staging (braid.tp.ce_reduce.CEBuffers)

    @property
    def moves(self) -> bool:
        return self.send_splits is not None


class Dispatcher(Protocol):
    """Plans where the expert-sorted rows of one rank go (:class:`RowPlan`)."""

    @property
    def moves(self) -> bool:
        """Whether rows cross ranks (an all-to-all per exchange)."""
        ...

    @property
    def host_free(self) -> bool:
        """Whether :meth:`plan` and the exchanges read nothing on the host (a CUDA graph can capture the layer)."""
        ...

    def plan(self, counts: torch.Tensor, rows: int | None = None) -> RowPlan:
        """Rows per global expert ``counts`` (E,) -> the plan of this micro-batch's rows; ``rows``: how many
        expert-sorted rows this rank holds (T*k, a static shape: a padded dispatcher sizes its blocks by it)."""
        ...


class LocalDispatch:
    """Every expert on this device: nothing moves."""

    moves = False
    host_free = True

    def plan(self, counts: torch.Tensor, rows: int | None = None) -> RowPlan:
        return RowPlan(counts)


LOCAL = LocalDispatch()


class ExpertSlice:
    """This TP rank's experts ``[first, first + count)``: the tokens are the same on every TP rank, so
    each runs its own experts on their rows and leaves the others' rows zero; the MLP unit's TP
    all-reduce then sums the ranks' parts (no token moves). ``inner``: how the slice's rows reach
    its experts (expert parallelism within the slice; default: they are all here)."""

    host_free = False  # the slice's rows are read on the host (where they start and end)

    def __init__(self, first: int, count: int, inner: Dispatcher = LOCAL) -> None:
        self.first, self.count, self.inner = first, count, inner

    @property
    def moves(self) -> bool:
        return self.inner.moves

    def plan(self, counts: torch.Tensor, rows: int | None = None) -> RowPlan:
        before = int(counts[:self.first].sum())  # rows are sorted by expert: one host read per layer
        mine = counts[self.first:self.first + self.count]
        n = int(mine.sum())
        return replace(self.inner.plan(mine, n), before=before, after=int(counts.sum()) - before - n)


@dataclass(frozen=True, slots=True)
class Exchange:
    """One ``all_to_all_single`` of rows: ``send`` in blocks of ``in_splits`` rows to the group's ranks,
    ``out`` filled with ``out_splits`` rows from each (the executor starts it, :meth:`start`)."""

    out: torch.Tensor
    send: torch.Tensor
    out_splits: list[int]
    in_splits: list[int]
    group: Any
    ce: Any = None  # the copy-engine EP backend's staging: equal blocks exchanged by the copy engines

    def start(self, async_op: bool = True) -> Any:
        if self.ce is not None:
            work = self.ce.all_to_all(self.out, self.send)
            if async_op:
                return work
            work.wait()
            return None
        return dist.all_to_all_single(self.out, self.send, self.out_splits, self.in_splits, group=self.group,
                                      async_op=async_op)


def exchange(rows: torch.Tensor, plan: RowPlan, back: bool = False) -> Exchange | None:
    """The exchange that takes ``rows`` (no autograd) to the experts' ranks (``back``: from them back
    to the tokens' ranks); None where nothing moves."""
    if plan.send_splits is None:
        return None
    out_splits, in_splits = (plan.send_splits, plan.recv_splits) if back else (plan.recv_splits, plan.send_splits)
    out = rows.new_empty(sum(out_splits), *rows.shape[1:])
    return Exchange(out, rows.detach().contiguous(), out_splits, in_splits, plan.group, plan.ce)


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
    """The expert-sorted rows (T*k, h) this rank's experts run: its TP slice of them; padded, the
    blocks to send (ep*capacity, h): each peer's rows first, zeros after."""
    if plan.slots is not None:
        blocks = rows.new_zeros(len(plan.send_splits) * plan.capacity, *rows.shape[1:])
        return blocks.index_copy(0, plan.slots, rows)  # differentiable in rows: its gradient is the slots' rows
    if plan.before or plan.after:
        return rows[plan.before:rows.shape[0] - plan.after]
    return rows


def _zero_padding(rows: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """Padding rows zero (a mask on the device; a NaN there stays out, in the gradient too)."""
    return rows if real is None else torch.where(real.unsqueeze(-1), rows, rows.new_zeros(()))


def expert_rows(got: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """Received rows (by source rank, then local expert) -> sorted by local expert (padded: the padding
    last, zero, and its gradient zero)."""
    return got if plan.order is None else _zero_padding(got[plan.order], plan.real)


def returned_rows(out: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """The experts' output rows back in the order they were received (padded: the padding rows zero,
    whatever the grouped GEMM left there)."""
    return out if plan.inverse is None else _zero_padding(out, plan.real)[plan.inverse]


def combined_rows(rows: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """This TP slice's rows back among all T*k rows (the other slices' rows zero); padded, the real
    rows gathered out of the returned blocks."""
    if plan.slots is not None:
        return rows[plan.slots]
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
    plan = dispatcher.plan(counts, rows.shape[0])
    got = exchanged(sent_rows(rows, plan), plan)
    out = returned_rows(experts(expert_rows(got, plan), plan.counts), plan)
    out = combined_rows(exchanged(out, plan, back=True), plan)
    return unpermute(out, order, weights, h2.shape[0]).view(shape)
