"""Full activation recomputation per layer under TP and braiding (Megatron's
``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``).

A decoder layer is four units (Pre-Attn, Attn, Pre-MLP, MLP); the executor all-reduces
the Attn and MLP outputs over TP between them (:mod:`braid.core.braiding`). Under full
recomputation:

* **forward**: each unit runs without autograd, so nothing is saved, except the layer's
  input ``x`` (the Pre-Attn state), which goes into the layer's Pre-Attn saved-tensor box:
  counted in the memory series and moved by ``Offload``/``Reload`` like any activation. The
  executor's all-reduces run as always (they produce the next unit's input).
* **backward**: the layer's first backward unit task (its MLP unit) first re-runs the layer
  (:func:`rerun`): the four units' ordinary cut-mode forward under autograd, filling the
  pieces and boxes a forward without recomputation leaves, with the Attn unit's TP
  all-reduce (reduce-scatter under sequence sharding) done in between (blocking, on the chunk's TP group: every TP rank re-runs
  the same layer at the same point of the same program, so the collectives match). The
  MLP's forward all-reduce is not repeated: its result (the layer output) is not needed
  by the backward. Then the backward proceeds unit by unit, its all-reduces braided by the
  executor as without recomputation.

The re-run applies the same operators to the same inputs (the Attn sum over TP ranks
included), so activations, and with them every gradient, equal those of the run without
recomputation. The chunk runs cut (never fused) under full recomputation: the re-run needs
the unit structure. The cost transform the simulator and the planner use is
:func:`braid.cost.costs.full_recompute`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from braid.core.braiding import Unit
from braid.tp.seq_shard import reduce_now

ModelChunk = Any  # braid.models.chunk.ModelChunk, which imports this module

LAYER_UNITS = (Unit.PRE_ATTN, Unit.ATTN, Unit.PRE_MLP, Unit.MLP)
RERUN: tuple = ()  # left in ``ModelChunk._saved`` for a unit whose pieces the re-run builds (no pieces: nothing held)


def forward_unit(ch: ModelChunk, mb: int, unit: Unit, layer: int, new_box: Callable[[], Any]) -> torch.Tensor | None:
    """A layer unit's forward without autograd; returns the tensor to all-reduce (Attn, MLP) as the cut path does.

    ``new_box``: makes the chunk's saved-tensor box that keeps the layer input.
    """
    state = ch._fwd[mb]
    lay = ch._layer_seq[layer]
    key = (mb, unit, layer)
    with torch.no_grad():
        if unit in (Unit.PRE_ATTN, Unit.PRE_MLP):
            x = state[0]
            if unit is Unit.PRE_ATTN:  # the layer's input: all this layer keeps until its backward
                ch._boxes.setdefault(key, new_box()).tensors.append(x)
            outs = tuple(lay.unit_forward(unit, ch._gathered(lay.unit_norm(unit)(x)), positions=ch.positions))
            ch._fwd[mb] = outs + (x,)
            ch._saved[key] = RERUN
            return None
        *acts, residual = state
        out = lay.unit_forward(unit, *acts, residual=residual)  # partial over TP
    ch._saved[key] = RERUN
    return ch._reduction(mb, out)


def needs_rerun(ch: ModelChunk, mb: int, unit: Unit, layer: int) -> bool:
    """Whether ``unit``'s backward must first re-run the layer (its pieces are the marker)."""
    return unit is Unit.MLP and ch._saved.get((mb, unit, layer)) is RERUN


def problem(ch: ModelChunk, mb: int, layer: int) -> str | None:
    """Why layer ``layer`` of ``mb`` cannot be re-run now (None: it can); the chunk raises it as a state error."""
    box = ch._boxes.get((mb, Unit.PRE_ATTN, layer))
    if box is None or not box.tensors:
        return f"B{mb}: no saved input of layer {layer} to recompute from (forward not run?)"
    if not isinstance(box.tensors[0], torch.Tensor):  # a Parked stand-in (braid.runtime.offload)
        return f"micro-batch {mb}: layer {layer}'s saved input is on the host (no RELOAD before its backward)"
    if mb in ch._fwd:
        return f"B{mb}: recomputation of layer {layer} while its forward is still in flight"
    return None


def rerun(ch: ModelChunk, mb: int, layer: int) -> None:
    """Re-run layer ``layer`` of micro-batch ``mb`` under autograd from its saved input (module doc;
    :func:`problem` first)."""
    x = ch._boxes.pop((mb, Unit.PRE_ATTN, layer)).tensors[0]
    group = ch.tp_group if ch.tp_group is not None and dist.get_world_size(ch.tp_group) > 1 else None
    ch._fwd[mb] = (x,)
    ch._rerunning = True
    try:
        for unit in LAYER_UNITS:
            ch._saved.pop((mb, unit, layer), None)
            out = ch._forward(mb, unit, layer)
            if unit is Unit.ATTN and group is not None:
                reduce_now(out, group)  # as the executor's forward reduction (in place, or a reduce-scatter)
    finally:
        ch._rerunning = False
        ch._fwd.pop(mb, None)
