"""The SwiGLU product and the down-projection as one autograd function that keeps gate and up only.

An MLP written as ``down_proj(silu(gate) * up)`` keeps three ``ffn/t``-wide tensors per token
for its backward: gate and up (SwiGLU's backward reads them) and their product (the
down-projection's weight gradient reads it). The product is a few element-wise operations of
the other two, so this function does not keep it: the backward makes it again in the same
kernel that computes SwiGLU's gradient (``bwd`` returns the inputs' gradients and the product),
then hands the product to the down-projection's weight gradient -- computed at once, or stashed
for a later W task (:class:`braid.tp.layers.DeferredWeightGrad`), where it is what an unfused
MLP stashes too. The bytes an MLP keeps from forward to backward drop from three ``ffn/t``
tensors to two; what a split backward keeps until W is unchanged. ``bwd`` writes gate's and up's
gradients into their own memory (:func:`braid.models.qwen2.swiglu_grad`): the backward allocates
the product alone, not three ``ffn/t`` tensors beside the two it is about to free.

The values are those of the unfused MLP: the forward's product and the backward's come from
the same operators on the same inputs, and the eager ``bwd`` applies autograd's own formulas
(:func:`braid.models.qwen2.swiglu_grad`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from braid.tp.autograd_calls import fast_apply
from braid.tp.layers import _ParallelLinear


class _SwiGLUDownFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mod: _ParallelLinear, fwd: Callable[..., torch.Tensor], bwd: Callable[..., tuple[torch.Tensor, ...]],
                weight: torch.Tensor, bias: torch.Tensor | None, *acts: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*acts)  # gate and up (or both joined): not their product
        ctx.mod, ctx.bwd = mod, bwd
        return nn.functional.linear(fwd(*acts), weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        acts = ctx.saved_tensors
        *grad_acts, product = ctx.bwd(*acts, grad_out.matmul(ctx.mod.weight))
        grads = ctx.mod._stash_or_grad(product, grad_out)
        return (None, None, None, grads[0], grads[1] if len(grads) > 1 else None, *grad_acts)


_swiglu_down = fast_apply(_SwiGLUDownFn)


def swiglu_down(down: _ParallelLinear, fwd: Callable[..., torch.Tensor], bwd: Callable[..., tuple[torch.Tensor, ...]],
                *acts: torch.Tensor) -> torch.Tensor:
    """``down(fwd(*acts))`` whose backward keeps only ``acts``.

    ``fwd``: the SwiGLU product of ``acts`` (gate and up, or the joined projection); ``bwd(*acts,
    grad_product)``: the gradients of ``acts`` (it may write them into ``acts``: nothing reads them after it)
    and the product itself, recomputed. Outside autograd
    (no grad, or inputs that need none) it is the plain composition.
    """
    if not torch.is_grad_enabled() or not any(a.requires_grad for a in acts):
        return down(fwd(*acts))
    return _swiglu_down(down, fwd, bwd, down.weight, down.bias, *acts)
