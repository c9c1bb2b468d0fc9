"""The rounding bound of ``reference_error``: rounding passes, a real bug does not, AdamW's cap holds."""

from __future__ import annotations

import pytest
import torch

from reference_error import adamw_cap, assert_matches_reference, bound


def _grads(model: torch.nn.Module, batches: list[torch.Tensor], order: list[int]) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    for i in order:
        (model(batches[i]).square().mean() / len(batches)).backward()
    return model.weight.grad.detach().clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_another_summation_order_passes_and_a_lost_micro_batch_fails(dtype) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32).to(dtype)
    model64 = torch.nn.Linear(64, 32).double()
    model64.load_state_dict(model.state_dict())
    batches = [torch.randn(16, 64) for _ in range(5)]
    want = _grads(model, [b.to(dtype) for b in batches], [0, 1, 2, 3, 4])
    want64 = None if dtype == torch.float64 else _grads(model64, [b.double() for b in batches], [0, 1, 2, 3, 4])
    got = _grads(model, [b.to(dtype) for b in batches], [4, 2, 0, 3, 1])  # accumulated in another order
    assert_matches_reference(got, want, want64, what="reordered")
    lost = _grads(model, [b.to(dtype) for b in batches], [0, 1, 2, 3])  # micro-batch 4 never ran
    with pytest.raises(AssertionError, match="lost: .* elements outside the rounding bound"):
        assert_matches_reference(lost, want, want64, what="lost")


def test_bound_grows_with_the_references_own_error_and_is_capped() -> None:
    want = torch.tensor([1.0, 1.0], dtype=torch.float32)
    want64 = torch.tensor([1.0, 1.0 + 1e-4], dtype=torch.float64)
    lim = bound(want, want64)
    assert lim[1] > lim[0] > 0
    assert float(bound(want, want64, amplify=1e9, cap=0.5).max()) == 0.5
    assert_matches_reference(1.0 + 1e-15, 1.0, what="a float is float64")  # not rounded to float32 first
    with pytest.raises(AssertionError):
        assert_matches_reference(1.0 + 1e-9, 1.0, what="a float is float64")


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_adamw_moves_an_element_at_most_half_the_cap_per_run(steps: int) -> None:
    """torch's AdamW from one start with adversarial gradients (tiny, huge, sign flips) never moves
    an element farther than ``adamw_cap / 2`` (the cap bounds two runs' difference)."""
    lr = 1e-2
    g = torch.Generator().manual_seed(steps)
    p = torch.zeros(4096, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=lr, eps=1e-8, weight_decay=0.0)
    for _ in range(steps):
        p.grad = torch.randn(4096, generator=g) * 10.0 ** torch.randint(-8, 4, (4096,), generator=g)
        opt.step()
    assert float(p.detach().abs().max()) <= adamw_cap(lr=lr, steps=steps) / 2 * (1 + 1e-6)
    assert adamw_cap(lr=lr, steps=1) == pytest.approx(2 * lr)
