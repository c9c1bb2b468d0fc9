"""Selective activation recomputation (Megatron's ``--recompute-granularity selective``).

The attention core (softmax(QK^T)V -- on the math path the (s x s) probabilities, with
flash attention its log-sum-exp and output) holds much activation memory for little
compute: under recomputation it runs forward *without* autograd, saves only its inputs,
and runs again with autograd inside its own backward. (The MLP's other such piece, the
SwiGLU product ``silu(gate) * up``, a TP shard never keeps under any mode: its
down-projection remakes it in the backward, :mod:`braid.tp.swiglu_down`.)

The inputs are saved with ``ctx.save_for_backward``, so they pass through the chunk's
saved-tensor hooks like every other activation: counted in the unit's box, and moved to
the host and back by ``Offload``/``Reload`` (:mod:`braid.models.chunk`). The backward
recomputes with the same operators on the same inputs, so gradients are bit-identical
to the path without recomputation.

Full recomputation (a layer's whole forward re-run before its backward, its TP all-reduce
included) is :mod:`braid.models.full_recompute`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

MODES = ("none", "selective", "full")


class _Recomputed(torch.autograd.Function):
    """``fn(*inputs)`` with only the inputs saved; the backward re-runs ``fn`` under autograd."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return fn(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        saved = ctx.saved_tensors
        leaves = tuple(t.detach().requires_grad_(need) for t, need in zip(saved, ctx.needs_input_grad[1:]))
        with torch.enable_grad():
            out = ctx.fn(*leaves)
        wanted = [t for t in leaves if t.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, grad)) if wanted else iter(())
        return (None,) + tuple(next(got) if t.requires_grad else None for t in leaves)


def recomputed(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """``fn(*inputs)`` whose intermediate activations are recomputed in the backward (inputs are saved)."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in inputs):
        return fn(*inputs)
    return _Recomputed.apply(fn, *inputs)


def check_mode(mode: str) -> str:
    """``mode`` if the executor implements it; ``ValueError`` (one line: what to use) otherwise."""
    if mode not in MODES:
        raise ValueError(f"activation recomputation {mode!r} is not implemented; use one of {', '.join(MODES)}")
    return mode
