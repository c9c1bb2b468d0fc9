"""Expert parallelism: the experts of every MoE layer sharded over ``ep`` ranks carved from the data-parallel ranks.

Layout (megatron-core's folding): the ``dp`` data-parallel ranks of one (pp, cp, tp) slot are
cut into ``dp / ep`` expert-parallel groups of ``ep`` consecutive ranks. Rank ``i`` of a group
holds experts ``[i E/ep, (i+1) E/ep)`` of every MoE layer; the ranks holding the same experts
(one per group) form its expert-data-parallel group. Everything that is not an expert is
replicated over all ``dp`` ranks as before.

Token flow (dropless, :class:`AllToAllDispatch`, :mod:`braid.models.moe_dispatch`): each rank
routes and sorts its own tokens' top-k slots by expert (:func:`braid.models.moe.permute`),
exchanges the per-expert counts (one blocking ``all_to_all_single`` of E integers), sends each
block of rows to the rank holding its experts (``all_to_all_single`` with variable splits: the
*dispatch*), regroups what it received by local expert on the device, runs its experts, and
sends the outputs back the same way (the *combine*). In a cut chunk the dispatch and the combine
end the units pre_mlp and experts and run asynchronously beside other units
(:mod:`braid.core.braiding`). The all-to-all's backward is the all-to-all with the splits
swapped, so an expert's weight gradient on its holder sums the contributions of every token of
the group routed to it.

Padded (``--moe-dispatch padded``, :class:`PaddedAllToAllDispatch`): the counts exchange stays, but
nothing is read on the host: every rank sends each peer a block of ``C`` rows (the most it could
ever send one peer, so nothing is dropped), its real rows first and zeros after; the receiver
knows from the exchanged counts, on the device, which rows are real and regroups them by local
expert with the padding last. The row exchanges then have equal splits, a static shape, and the
step can be a CUDA graph (:mod:`braid.runtime.graphs`); they move ``ep * C`` rows instead of the
real ones. Every rank of an expert-parallel group must hold the same tokens per micro-batch (the
blocks' size): the examples' and the profiler's micro-batches have one shape.

Gradients (:func:`reduce_gradients_ep`): non-expert parameters are averaged over the ``dp``
ranks as without EP (:func:`braid.runtime.distributed.reduce_gradients`); an expert's
gradient, already summed over its expert-parallel group by the all-to-all, is summed over the
expert-data-parallel group and divided by ``dp``: the same mean over every token of the step.

Every DP rank of a pipeline stage runs the same program, so the ranks of an expert-parallel
group reach each MoE layer's all-to-all in the same order: the collectives pair up.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from braid.core.topology import Topology
from braid.io.cli import check_moe_dispatch
from braid.models.moe import Experts
from braid.models.moe_dispatch import ExpertSlice, RowPlan
from braid.runtime.distributed import reduce_gradients

EXPERT_ATTR = "braid_expert"  # set on a parameter that holds an expert-parallel rank's share of the experts


def check_expert_layout(ep: int, dp: int, *, experts: int | None = None, cp: int = 1, tp: int = 1) -> None:
    """``ValueError`` (one line) unless ``ep`` experts-parallel ranks fit ``dp`` data-parallel ranks and ``experts`` experts
    (None: not checked; 0: a dense model, which has none to shard)."""
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"--ep must be a positive integer, got {ep!r}")
    if experts == 0 and ep > 1:
        raise ValueError(f"--ep {ep} shards the experts of a mixture-of-experts model; this one is dense "
                         "(pick one with --model, e.g. qwen3-moe-tiny)")
    if dp % ep:
        raise ValueError(f"--ep {ep} must divide the data-parallel ranks (dp={dp}): expert-parallel ranks are carved from them")
    if experts is not None and ep > 1 and experts % (ep * tp):
        what = f"--ep {ep} x --tp {tp} ({ep * tp})" if tp > 1 else f"--ep {ep}"
        raise ValueError(f"{what} must divide the model's {experts} experts per layer")
    if ep > 1 and cp > 1:
        raise ValueError(f"--ep {ep} runs with cp=1 only (got cp={cp})")


EP_BACKENDS = ("nccl", "nccl-ce")


def check_ep_backend(backend: str, *, max_ctas: int | None = None, dispatch: str = "padded") -> None:
    """``ValueError`` (one line) for an EP backend this run cannot use: an unknown one, ``nccl-ce`` with a
    thread-block cap (it runs no thread blocks) or with variable splits (the copy engines exchange equal
    blocks between registered windows: ``--moe-dispatch padded``)."""
    if backend not in EP_BACKENDS:
        raise ValueError(f"unknown EP backend {backend!r}; choose one of {', '.join(EP_BACKENDS)}")
    if backend == "nccl-ce" and max_ctas:
        raise ValueError("--ep-backend nccl-ce runs no thread blocks; --ep-max-ctas applies to nccl only")
    if backend == "nccl-ce" and dispatch != "padded":
        raise ValueError("--ep-backend nccl-ce exchanges equal blocks of rows: it needs --moe-dispatch padded")


def expert_rank_groups(topo: Topology, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel groups, expert-data-parallel groups) of global ranks: every group of the layout, in one order."""
    check_expert_layout(ep, topo.dp, cp=topo.cp, tp=topo.tp)
    ep_groups, edp_groups = [], []
    for ranks in topo.groups("dp"):  # ordered by dp index
        ep_groups += [ranks[i:i + ep] for i in range(0, len(ranks), ep)]
        edp_groups += [ranks[i::ep] for i in range(ep)]
    return ep_groups, edp_groups


@dataclass(slots=True)
class ExpertGroups:
    """This rank's expert-parallel (``ep``) and expert-data-parallel (``edp``) groups."""

    ep: int
    ep_rank: int
    ep_group: Any
    edp_group: Any
    edp_size: int
    ce: Any = None  # the copy-engine backend's staging of the EP group (braid.tp.ce_reduce.CEBuffers); None: NCCL's kernels

    @staticmethod
    def create(topo: Topology, rank: int, ep: int, timeout_s: float = 120.0, max_ctas: int | None = None,
               backend: str = "nccl", device: torch.device | str | None = None) -> "ExpertGroups":
        """Create every expert group of the layout (collective: all ranks call it, same order). ``max_ctas``
        caps the thread blocks of the EP group's NCCL kernels (its all-to-all braided beside compute, as
        :meth:`braid.runtime.distributed.ProcessGroups.create` caps the TP group's); None: NCCL's default.
        ``backend`` (:data:`EP_BACKENDS`): ``nccl-ce`` runs the padded exchanges on the copy engines, no
        thread blocks at all (NCCL 2.28's zero-CTA all-to-all between registered windows; staging
        buffers of ``device``, made on first use, :class:`braid.tp.ce_reduce.CEBuffers`)."""
        from braid.tp.ce_reduce import CEBuffers
        from braid.tp.comm import nccl_group_options

        check_ep_backend(backend, max_ctas=max_ctas)
        ep_groups, edp_groups = expert_rank_groups(topo, ep)
        timeout = datetime.timedelta(seconds=timeout_s)
        mine: dict[str, tuple[Any, list[int]]] = {}
        if backend == "nccl-ce":
            ep_opts = nccl_group_options("nccl-ce", None)
        else:
            ep_opts = nccl_group_options("nccl-capped", max_ctas) if max_ctas is not None else None
        for kind, rows in (("ep", ep_groups), ("edp", edp_groups)):
            for ranks in rows:
                g = dist.new_group(ranks, timeout=timeout, pg_options=ep_opts if kind == "ep" else None)
                if rank in ranks:
                    mine[kind] = (g, ranks)
        ep_group, ep_ranks = mine["ep"]
        edp_group, edp_ranks = mine["edp"]
        ce = None
        if backend == "nccl-ce" and ep > 1:
            dev = device if device is not None else ("cuda" if dist.get_backend(ep_group) == "nccl" else "cpu")
            ce = CEBuffers(ep_group, torch.device(dev))
        return ExpertGroups(ep, ep_ranks.index(rank), ep_group, edp_group, len(edp_ranks), ce)


class AllToAllDispatch:
    """The :class:`braid.models.moe_dispatch.Dispatcher` of one expert-parallel rank (see the module doc)."""

    moves = True
    host_free = False  # the splits are read on the host

    def __init__(self, groups: ExpertGroups, num_experts: int) -> None:
        self.groups, self.num_experts = groups, num_experts
        self.local = num_experts // groups.ep

    def plan(self, counts: torch.Tensor, rows: int | None = None) -> RowPlan:
        """The rows' plan, after exchanging the per-expert counts: a small blocking all-to-all of E
        integers at the start of the dispatch, because the row exchange needs its splits on the
        host before it starts (``all_to_all_single`` with variable splits). A cut chunk runs it at
        the end of its pre_mlp unit, just before it hands the row exchange to the executor."""
        ep, el, group = self.groups.ep, self.local, self.groups.ep_group
        recv = torch.empty_like(counts)  # (ep * E/ep,): [source rank][local expert]
        dist.all_to_all_single(recv, counts, group=group)
        per_source = recv.view(ep, el)
        send_splits = counts.view(ep, el).sum(1).tolist()  # the splits are host integers (one sync per layer)
        recv_splits = per_source.sum(1).tolist()
        expert_of_row = torch.repeat_interleave(torch.arange(el, device=counts.device).repeat(ep), per_source.reshape(-1))
        order = torch.argsort(expert_of_row, stable=True)  # received (by source rank, then local expert) -> by local expert
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return RowPlan(per_source.sum(0), send_splits=send_splits, recv_splits=recv_splits, group=group, order=order,
                       inverse=inverse)


class PaddedAllToAllDispatch:
    """:class:`AllToAllDispatch` without a host read: every peer gets a block of :meth:`capacity` rows
    (see the module doc; :mod:`braid.models.moe_dispatch` moves the rows)."""

    moves = True
    host_free = True

    def __init__(self, groups: ExpertGroups, num_experts: int, top_k: int) -> None:
        self.groups, self.num_experts, self.top_k = groups, num_experts, top_k
        self.local = num_experts // groups.ep

    def capacity(self, rows: int) -> int:
        """Rows of a block for ``rows`` = T*k sorted rows: the most one peer can get. A token's top-k experts
        are distinct, so it sends a peer (``local`` experts) at most min(k, local) rows: T min(k, local)."""
        k = self.top_k
        return rows if rows % k else rows // k * min(k, self.local)

    def plan(self, counts: torch.Tensor, rows: int | None = None) -> RowPlan:
        """The rows' plan from the exchanged counts (a small blocking all-to-all of E integers, as
        :meth:`AllToAllDispatch.plan`'s), every index on the device."""
        if rows is None:
            raise TypeError("PaddedAllToAllDispatch.plan needs the rows this rank holds (T*k) to size its blocks")
        ep, el, group = self.groups.ep, self.local, self.groups.ep_group
        cap, dev = self.capacity(rows), counts.device
        recv = torch.empty_like(counts)  # (ep * E/ep,): [source rank][local expert]
        dist.all_to_all_single(recv, counts, group=group)
        per_source = recv.view(ep, el)
        # sender: sorted row i of global expert e goes to peer e // el, at its place among that peer's rows
        i = torch.arange(rows, device=dev)
        peer = torch.searchsorted(counts.cumsum(0), i, right=True) // el  # (T*k,)
        per_peer = counts.view(ep, el).sum(1)
        slots = peer * cap + i - (per_peer.cumsum(0) - per_peer)[peer]
        # receiver: row j of source s's block is of local expert `within[s, j]`, el where it is padding
        j = torch.arange(cap, device=dev).expand(ep, cap).contiguous()
        within = torch.searchsorted(per_source.cumsum(1), j, right=True).reshape(-1)  # (ep*cap,)
        order = torch.argsort(within, stable=True)  # by local expert, the padding last
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=dev)
        return RowPlan(per_source.sum(0), send_splits=[cap] * ep, recv_splits=[cap] * ep, group=group, order=order,
                       inverse=inverse, capacity=cap, slots=slots, real=within[order] < el, ce=self.groups.ce)


def moe_layers(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """The layers under ``modules`` (model chunks, models) that hold experts (have an ``experts`` :class:`Experts`)."""
    return [m for top in modules for m in top.modules() if isinstance(getattr(m, "experts", None), Experts)]


def shard_experts(modules: Iterable[nn.Module], ep_rank: int, ep: int, groups: ExpertGroups | None = None,
                  dispatch: str = "splits") -> None:
    """Cut every MoE layer under ``modules`` down, in place, to expert-parallel rank ``ep_rank``'s experts
    and mark those parameters (:data:`EXPERT_ATTR`); with ``groups``, its tokens then go through
    :class:`AllToAllDispatch` (``dispatch`` "splits") or :class:`PaddedAllToAllDispatch` ("padded", tp=1).
    Call before the first step (and before an executor is built on them).

    Under TP a layer holds its TP rank's slice of the experts (:class:`braid.models.moe.ExpertSlice`);
    expert parallelism then shards that slice, and the all-to-all runs between the ranks of the
    same TP index (their expert-parallel group) on the slice's rows."""
    if groups is not None and groups.ce is not None:
        check_ep_backend("nccl-ce", dispatch=dispatch)
    for layer in moe_layers(modules):
        total = layer.experts.count
        if total % ep:
            raise ValueError(f"--ep {ep} must divide the {total} experts per layer a rank holds")
        per = total // ep
        for lin in (layer.experts.gate_up, layer.experts.down):
            lin.weight = nn.Parameter(lin.weight.detach()[ep_rank * per:(ep_rank + 1) * per].clone())
            setattr(lin.weight, EXPERT_ATTR, True)
        if groups is not None:
            sliced = isinstance(layer.dispatcher, ExpertSlice)
            check_moe_dispatch(dispatch, ep=ep, tp=2 if sliced else 1)
            how = PaddedAllToAllDispatch(groups, total, layer.top_k) if dispatch == "padded" else AllToAllDispatch(groups, total)
            if sliced:
                layer.dispatcher.inner = how
            else:
                layer.dispatcher = how


def is_expert(p: torch.Tensor) -> bool:
    return bool(getattr(p, EXPERT_ATTR, False))


def reduce_gradients_ep(params: list[nn.Parameter], groups: Any, experts: ExpertGroups, abort: Any) -> None:
    """:func:`braid.runtime.distributed.reduce_gradients` for the dense parameters; expert gradients
    summed over the expert-data-parallel group and divided by ``dp`` (see the module doc)."""
    reduce_gradients([p for p in params if not is_expert(p)], groups, abort)
    mine = [p for p in params if is_expert(p) and p.grad is not None]
    dp = groups.topo.dp
    works = []
    for p in mine:
        p.grad.div_(dp)
        if experts.edp_size > 1:
            works.append(dist.all_reduce(p.grad, group=experts.edp_group, async_op=True))
    for w in works:
        abort.wait(w)


def gather_experts(chunks: dict[int, Any], groups: ExpertGroups, tp_group: Any = None) -> dict[str, torch.Tensor]:
    """Every expert stack of ``chunks`` whole, under its single-device name: this rank's share joined with its
    expert-parallel group's, then (``tp_group``) with the other TP ranks' slices (collective over both)."""
    from braid.models.global_names import global_name

    def joined(t: torch.Tensor, group: Any) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts)

    out = {}
    for ci in sorted(chunks):
        for local, p in chunks[ci].named_parameters():
            if is_expert(p):
                t = joined(p.detach(), groups.ep_group)
                out[global_name(chunks[ci], local)] = t if tp_group is None else joined(t, tp_group)
    return out


def expert_shards(shards: dict[nn.Parameter, Any], groups: ExpertGroups) -> dict[nn.Parameter, Any]:
    """``shards`` (:func:`braid.models.global_names.chunk_shards`) with every expert stack named as the
    ``ep_rank``-th of ``ep`` blocks along its expert dimension, split over the expert-parallel group
    (a checkpoint then holds whole stacks and resumes at another ``ep``); tp must be 1."""
    from dataclasses import replace

    return {p: replace(s, dim=0, index=groups.ep_rank, count=groups.ep, over="ep") if is_expert(p) and groups.ep > 1 else s
            for p, s in shards.items()}
