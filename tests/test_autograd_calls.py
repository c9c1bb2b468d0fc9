"""The chunk runner's direct autograd calls give what the public functions give."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import get_gradient_edge

from braid.tp.autograd_calls import edge, fast_apply, grad


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, k: float) -> torch.Tensor:
        ctx.k = k
        return x * k

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g * ctx.k, None


class _WithSetup(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g


def test_grad_edge_and_apply_match_the_public_calls() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 4, generator=g, requires_grad=True), torch.randn(4, 5, generator=g, requires_grad=True)
    h = fast_apply(_Scale)(x, 2.0)
    y = h @ w
    e_y, e_h = edge(y), edge(h)
    ref = get_gradient_edge(y)
    assert e_y.node is ref.node and e_y.output_nr == ref.output_nr
    assert edge(x).node is get_gradient_edge(x).node  # a leaf: its gradient accumulator
    dy = torch.randn(3, 5, generator=g)
    want = torch.autograd.grad(y, (x, w), dy, retain_graph=True)
    got = grad((e_y,), (x, w), (dy,))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="not have been used"):
        grad((edge(x * 3),), (w,), (torch.ones(3, 4),))
    (dh,) = grad((edge(h @ w),), (e_h,), (dy,))
    assert torch.equal(dh, dy @ w.detach().t())
    with pytest.raises(TypeError, match="setup_context"):
        fast_apply(_WithSetup)
