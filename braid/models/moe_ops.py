"""A cut chunk's mixture-of-experts units: each ends where expert parallelism's rows change ranks.

The units of an MoE layer (:data:`braid.core.braiding.MOE_LAYER_UNITS`; the table in
:mod:`braid.core.braiding`) as :class:`braid.models.chunk.ModelChunk` runs them with the unit cuts.
Each is its own autograd piece, as the dense units are; a unit that ends with an all-to-all
returns the :class:`braid.models.moe_dispatch.Exchange` to start (None where nothing moves) and
the executor starts it asynchronously, as it starts a TP all-reduce: the next unit of the op
reads the exchanged rows once the executor has waited for it.

* F ``pre_mlp``: norm, router, top-k, permutation (:meth:`braid.models.seam.ExpertLayer.route_rows`),
  the plan of the rows (:meth:`braid.models.moe_dispatch.Dispatcher.plan`, whose counts exchange
  blocks: it is small and the row exchange needs its splits) -> the dispatch.
* F ``experts``: regroup by local expert, the experts, back in arrival order -> the combine.
* F ``mlp``: the other TP slices' rows as zeros, un-permutation and weighted sum, the fused
  residual -> the TP all-reduce (as a dense MLP's).
* B ``mlp``: gradients of the combined rows (-> the combine's backward exchange, to the experts'
  ranks) and of the slot weights (kept for B ``pre_mlp``).
* B ``experts``: the experts' input gradients (weight gradients stashed for W) -> the dispatch's
  backward exchange, to the tokens' ranks.
* B ``pre_mlp``: as a dense Pre-MLP's backward (:class:`braid.models.chunk.ModelChunk`), its
  outputs being the sent rows and the slot weights.

A layer's :class:`braid.models.moe_dispatch.RowPlan` for a micro-batch lives from its F ``pre_mlp``
to its B ``experts``. :class:`MoeOps` is a part of ``ModelChunk`` (it uses the chunk's state).
"""

from __future__ import annotations

from typing import Any

import torch

from braid.core.braiding import Unit
from braid.models.chunk_parts import ChunkStateError, _Backward, _Piece
from braid.models.moe import unpermute
from braid.models.moe_dispatch import Exchange, RowPlan, combined_rows, exchange, expert_rows, returned_rows, sent_rows
from braid.models.seam import ExpertLayer, fused_residual
from braid.tp.autograd_calls import edge, grad
from braid.tp.layers import split_weight_grads

MOE_SIDE = (Unit.PRE_MLP, Unit.EXPERTS, Unit.MLP)  # the units this part runs in an MoE layer


def _arrived(req: Exchange | None, rows: torch.Tensor) -> torch.Tensor:
    """What the next unit reads: the exchange's output (filled once the executor has waited for it), or the rows."""
    return rows if req is None else req.out


class MoeOps:
    """The MoE units of :class:`braid.models.chunk.ModelChunk` in cut mode (module doc)."""

    def _init_moe(self) -> None:
        self._routings: dict[tuple[int, int], tuple[RowPlan, torch.Tensor, torch.Size]] = {}  # (mb, layer) -> plan, order, shape

    def moe_moves(self) -> bool:
        """Whether an MoE layer of the chunk sends rows to other ranks (expert parallelism)."""
        return any(isinstance(lay, ExpertLayer) and lay.dispatcher.moves for lay in self._layer_seq)

    def moe_host_free(self) -> bool:
        """Whether every MoE layer of the chunk plans and exchanges its rows without a host read
        (:attr:`braid.models.moe_dispatch.Dispatcher.host_free`: a CUDA graph can capture them)."""
        return all(getattr(lay.dispatcher, "host_free", False) for lay in self._layer_seq if isinstance(lay, ExpertLayer))

    def _moe_unit(self, unit: Unit, layer: int) -> bool:
        return layer in self.spec.moe and unit in MOE_SIDE

    def _moe_forward(self, mb: int, unit: Unit, layer: int) -> Exchange | torch.Tensor | Any:
        lay = self._layer_seq[layer]
        key = (mb, unit, layer)
        if unit is Unit.PRE_MLP:
            with self._saving(*key):
                x, h, norm, full = self._normed(mb, unit, layer)
                hl = self._enter(full)  # (b, s, h)
                rows, weights, order, counts = lay.route_rows(hl)  # (T*k, h), (T, k)
                plan = lay.dispatcher.plan(counts, rows.shape[0])
                send = sent_rows(rows, plan)
            self._gather = None
            self._saved[key] = [_Piece((edge(x),), (edge(h),), (norm.weight,)), _Piece((edge(hl),), (edge(send), edge(weights)))]
            self._routings[(mb, layer)] = (plan, order, hl.shape)
            req = exchange(send, plan)
            self._fwd[mb] = (_arrived(req, send.detach()), weights.detach(), x.detach())
            return req
        got, weights, residual = self._fwd[mb]
        plan, order, shape = self._plan(mb, layer)
        if unit is Unit.EXPERTS:
            with self._saving(*key):
                leaf = self._enter(got)
                out = returned_rows(lay.run_experts(expert_rows(leaf, plan), plan.counts), plan)
            self._saved[key] = [_Piece((edge(leaf),), (edge(out),))]
            req = exchange(out, plan, back=True)
            self._fwd[mb] = (_arrived(req, out.detach()), weights, residual)
            return req
        with self._saving(*key):  # mlp: the combine
            rows, w = self._enter(got), self._enter(weights)
            moe = unpermute(combined_rows(rows, plan), order, w, shape[0] * shape[1]).view(shape)  # (b, s, h)
            out = fused_residual(lay, moe, residual)  # partial over TP
        self._saved[key] = [_Piece((edge(rows), edge(w)), (edge(out),))]
        return self._reduction(mb, out)

    def _plan(self, mb: int, layer: int) -> tuple[RowPlan, torch.Tensor, torch.Size]:
        got = self._routings.get((mb, layer))
        if got is None:
            raise ChunkStateError(f"micro-batch {mb}: no routing of MoE layer {layer} (its pre_mlp forward not run?)")
        return got

    def _moe_backward(self, mb: int, unit: Unit, layer: int, st: _Backward) -> Exchange | None:
        """B of ``experts`` or ``mlp`` (B ``pre_mlp`` is the dense path's: ``st.grads`` are its outputs' gradients)."""
        pieces = self._take(mb, unit, layer)
        key = (mb, unit, layer)
        plan = self._plan(mb, layer)[0]
        if unit is Unit.MLP:
            g, gf = self._grad_whole(mb, st)
            d_rows, d_weights = grad(pieces[0].outputs, pieces[0].inputs, (gf,))
            st.residual = g  # d out / d x through the fused residual: the explicit +1
            req = exchange(d_rows, plan)  # the combine's backward: to the experts' ranks
            st.grads = (_arrived(req, d_rows), d_weights)
        else:
            d_out, d_weights = st.grads
            with split_weight_grads(self._deferred(unit, layer), mb):
                (d_got,) = grad(pieces[0].outputs, pieces[0].inputs, (d_out,))
            del self._routings[(mb, layer)]
            req = exchange(d_got, plan, back=True)  # the dispatch's backward: to the tokens' ranks
            st.grads = (_arrived(req, d_got), d_weights)
        self._boxes.pop(key, None)
        return req
