"""The pieces a model chunk keeps per micro-batch and unit: entries into the autograd graph that
hold no tensor, saved-tensor boxes (counted, offloaded), backward state, and the chunk-state error."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge

Handle = torch.Tensor | GradientEdge  # a piece's input/output: an edge, or (the loss) a tensor
IGNORE_INDEX = -100

class ChunkStateError(RuntimeError):
    """A unit task whose inputs are missing (an executor invariant was broken)."""


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """A leaf copy-free alias of ``t`` (vision chunk's merge unit); the LM units use :meth:`ModelChunk._enter`."""
    return t.detach().requires_grad_()


class _Entry(torch.autograd.Function):
    """Identity that starts a piece's autograd graph at ``x`` without holding ``x``.

    The output is a view of ``x`` (no copy) that requires grad through ``anchor`` (a
    0-dim tensor; it gets no gradient). Its backward node saves nothing, so once the
    forward is done ``x``'s storage is held only by the saved-tensor boxes; the gradient
    w.r.t. ``x`` is captured at the node's :class:`GradientEdge`.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _masked_mean(ce: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean per-token loss over labels != -100 (prompt/image/padding positions take no loss), as ``F.cross_entropy``."""
    valid = labels != IGNORE_INDEX
    return (ce * valid).sum() / valid.sum().clamp(min=1)  # no host sync: the count stays a tensor


@dataclass(slots=True)
class _Piece:
    """One autograd sub-graph of a unit: input and output handles (edges, which hold no
    activation data), and eager parameters (norm weights)."""

    inputs: tuple[Handle, ...]
    outputs: tuple[Handle, ...]
    params: tuple[nn.Parameter, ...] = ()


@dataclass(slots=True)
class _Box:
    """Saved activations of one (micro-batch, unit): tensors, or :class:`Parked` stand-ins while on the host."""

    tensors: list[Any] = field(default_factory=list)
    # Sequence sharding: slot -> the whole sequence gathered again from the slot's tokens (see
    # ModelChunk._saving), once per box however many linears saved it.
    gathered: dict[int, torch.Tensor] = field(default_factory=dict)

    def storages(self) -> dict[int, int]:
        """Device storages the box holds: data pointer -> bytes (each storage once)."""
        out = {}
        for t in self.tensors:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()  # one storage object per tensor (sampled after every instruction on CPU)
                out[st.data_ptr()] = st.nbytes()
        return out

    def live_bytes(self) -> int:
        return sum(self.storages().values())


@dataclass(slots=True)
class _FusedOp:
    """One micro-batch's forward through a fused chunk: the ends of its single autograd graph.

    ``input``: the edge of the chunk input (entered through :class:`_Entry`; None where the
    chunk starts with the embedding); ``params``: the eager parameters (norm weights) whose
    gradients the one backward call returns; ``output``: the output's edge, or (head) the
    loss; ``boxes``: the saved-tensor boxes.

    ``joint``: the op's backward computes the weight gradients too (its backward op is a
    ``BW``, :meth:`ModelChunk.set_joint`): the linears ran as plain modules, ``input`` is a
    leaf tensor, and one ``backward`` call accumulates every parameter's gradient.
    """

    input: GradientEdge | torch.Tensor | None
    params: list[nn.Parameter] = field(default_factory=list)
    output: Handle | None = None
    boxes: list[tuple] = field(default_factory=list)
    joint: bool = False


@dataclass(slots=True)
class _Backward:
    grads: tuple[torch.Tensor, ...] = ()
    residual: torch.Tensor | None = None
    pending: tuple[_Piece, torch.Tensor, torch.Tensor | None, tuple] | None = None

