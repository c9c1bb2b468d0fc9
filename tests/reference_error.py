"""How far a distributed result may lie from the single-process reference: one bound, derived once.

Every equivalence test (loss, gradients, parameters after AdamW) compares through
:func:`assert_matches_reference`; nothing else in the suite picks a tolerance for it.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

# The reduction-depth factor c of :func:`bound` (see there). Measured: the distributed error is
# at most ~41x the estimate ``|want - want64| + u * scale`` (float64 and float32, every suite
# that uses it; the worst is a DTensor vocabulary-parallel embedding gradient), so K leaves a
# margin of 25, while in float64 the bound stays near 1e-12 of the scale: any real bug (a lost
# micro-batch, a wrong shard, a missing all-reduce: relative errors of 1e-3 and up) lies far
# outside it.
K = 1024.0


def bound(want: torch.Tensor, want64: torch.Tensor | None = None, *, scale: float = 0.0, amplify: float = 0.0,
          cap: float = math.inf) -> torch.Tensor:
    """The element-wise bound on ``|got - want|`` for a ``got`` computed like ``want`` in another order.

    Derivation. Let x be the exact value, ``want`` the single-process reference in dtype d
    (unit roundoff u = ``torch.finfo(d).eps``) and ``got`` the distributed result: the same
    operations in another order (TP partial sums and an all-reduce, micro-batch gradients
    accumulated in another order, fused or cut units). Standard floating-point analysis gives
    each a forward error ``|y - x| <= c * u * S``, S the magnitude of the terms summed, c the
    reduction depth; so ``|got - want| <= |got - x| + |want - x|``, two errors of the same kind.

    * ``|want - x|`` is measured, element by element: ``|want - want64|`` with ``want64`` the
      same reference run in float64 (its own error is ~1e-16 relative). When ``want`` is
      already float64 (the CPU suites run the whole equivalence in float64), this term is 0.
    * ``u * scale`` is the floor for elements where the reference's error happens to cancel
      while ``got``'s does not. S is the size of the summed terms, not of the sum: a gradient
      that (nearly) cancels, like a K projection's bias under softmax, sums terms as large as
      the other gradients. So scale = the larger of ``max |want|`` over the tensor and the
      caller's ``scale``: the largest entry of any tensor of the same kind (every gradient,
      every parameter) of the reference.
    * ``amplify`` adds what an earlier step multiplies rounding by: AdamW's update
      ``m/(sqrt(v)+eps)`` has slope up to ``1/eps`` in the gradient, so a gradient error
      ``u*G`` moves a parameter by up to ``lr*u*G/eps`` per step (:func:`adamw_amplify`).
    * ``cap`` is a bound that holds whatever the rounding: AdamW moves an element by at most
      ``lr * C_t`` per step (:func:`adamw_cap`), so two runs from the same start differ by at
      most twice the sum of that; the element-wise minimum of the two bounds is used.

    Result: ``min(cap, K * (|want - want64| + u * (scale + amplify)))``. K bounds c: the
    worst case of a sum of n terms is n*u*S (Higham, Accuracy and Stability of Numerical
    Algorithms, 2nd ed., Sec. 4.2); the longest sums here are a weight gradient's over a step's
    tokens, m*mbs*seq <= 2*8*9 = 144 in the CPU suites, times the layers the error passes.
    """
    u = torch.finfo(want.dtype).eps
    want = want.detach()
    own = (want - want64.detach().to(want)).abs() if want64 is not None else torch.zeros_like(want)
    scale = max(scale, float(want.abs().max()) if want.numel() else 0.0)
    return (K * (own + u * (scale + amplify))).clamp(max=cap)


def assert_matches_reference(got: torch.Tensor | float, want: torch.Tensor | float, want64: torch.Tensor | float | None = None,
                             *, what: str, scale: float = 0.0, amplify: float = 0.0, cap: float = math.inf) -> None:
    """Raise ``AssertionError`` naming ``what`` and the worst element if ``got`` is outside :func:`bound`."""
    want_t, got_t = _tensor(want), _tensor(got).to(_tensor(want).device)
    want64_t = None if want64 is None else _tensor(want64).to(want_t.device)
    assert got_t.shape == want_t.shape, f"{what}: shape {tuple(got_t.shape)}, reference {tuple(want_t.shape)}"
    assert torch.isfinite(got_t).all(), f"{what}: non-finite values"
    lim = bound(want_t, want64_t, scale=scale, amplify=amplify, cap=cap)
    err = (got_t.detach() - want_t.detach()).abs()
    if (err <= lim).all():
        return
    over = err - lim
    i = int(over.flatten().argmax())
    n_bad = int((err > lim).sum())
    raise AssertionError(f"{what}: {n_bad}/{err.numel()} elements outside the rounding bound; worst at flat index {i}: "
                         f"|{float(got_t.flatten()[i]):.9g} - {float(want_t.flatten()[i]):.9g}| = {float(err.flatten()[i]):.3g} "
                         f"> {float(lim.flatten()[i]):.3g} (reference's own error {_own(want_t, want64_t, i):.3g}, "
                         f"{want_t.dtype}, amplify {amplify:.3g})")


def _tensor(x: torch.Tensor | float) -> torch.Tensor:
    """A Python float is a float64 value (``torch.as_tensor`` would round it to float32)."""
    return x.detach() if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=torch.float64)


def _own(want: torch.Tensor, want64: torch.Tensor | None, i: int) -> float:
    return 0.0 if want64 is None else float((want.flatten()[i].double() - want64.flatten()[i].double()).abs())


def adamw_amplify(grad_scale: float, *, lr: float, eps: float, steps: int) -> float:
    """What ``steps`` AdamW steps add to a parameter's rounding scale (see :func:`bound`):
    ``steps * lr * G / eps``, ``G`` the reference's largest gradient entry."""
    return steps * lr * grad_scale / eps


def adamw_cap(*, lr: float, steps: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """Largest difference AdamW can make between two runs of one parameter element after ``steps``.

    Step t's update is ``lr * m_hat/(sqrt(v_hat)+eps)`` with ``m_hat = sum a_i g_i`` and
    ``v_hat = sum b_i g_i^2`` (bias-corrected EMA weights a, b, each summing to 1); by
    Cauchy-Schwarz ``|m_hat| <= sqrt(sum a_i^2/b_i) * sqrt(v_hat)``, so ``|update| <= lr * C_t``
    with ``C_t = sqrt(sum a_i^2/b_i)`` (1 at t=1). Decoupled weight decay scales both runs'
    difference by ``1 - lr*wd <= 1``. Two runs: at most ``2 * lr * sum_t C_t``.
    """
    b1, b2 = betas
    total = 0.0
    for t in range(1, steps + 1):
        a = [(1 - b1) * b1 ** (t - i) / (1 - b1**t) for i in range(1, t + 1)]
        b = [(1 - b2) * b2 ** (t - i) / (1 - b2**t) for i in range(1, t + 1)]
        total += math.sqrt(sum(x * x / y for x, y in zip(a, b)))
    return 2 * lr * total


def loss_amplify(grads: Iterable[torch.Tensor], *, lr: float, eps: float, steps: int) -> float:
    """What ``steps`` AdamW steps add to the next loss's rounding scale: to first order the loss
    moves by ``sum_j |g_j| * dp_j``, each parameter's drift ``dp_j`` as in :func:`adamw_amplify`."""
    grads = [g.detach().double() for g in grads]
    g_max = max(float(g.abs().max()) for g in grads)
    return sum(float(g.abs().sum()) for g in grads) * adamw_amplify(g_max, lr=lr, eps=eps, steps=steps)
