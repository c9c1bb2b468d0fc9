"""Block kernels against naive softmax attention: output, LSE and all three gradients."""

from __future__ import annotations

import pytest
import torch

from braid.attention.kernels import TorchCPUKernel, flash_attn_available, get_kernel, reference_attention
from braid.attention.ring import _merge

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def _inputs(h: int, h_kv: int, sq: int, sk: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, h, sq, 16, generator=g, dtype=dtype)
    k = torch.randn(2, h_kv, sk, 16, generator=g, dtype=dtype)
    v = torch.randn(2, h_kv, sk, 16, generator=g, dtype=dtype)
    dout = torch.randn(2, h, sq, 16, generator=g, dtype=dtype)
    return q, k, v, dout


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("h_kv", [4, 2, 1])
@pytest.mark.parametrize("causal, sk", [(True, 24), (False, 24), (False, 40)])
def test_cpu_kernel_matches_naive(dtype: torch.dtype, h_kv: int, causal: bool, sk: int) -> None:
    kern = get_kernel("cpu")
    q, k, v, dout = _inputs(4, h_kv, 24, sk, dtype)
    scale = 0.3
    out, lse = kern.fwd(q, k, v, causal, scale)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_attention(*leaves, causal=causal, scale=scale)
    ref_out.backward(dout)
    torch.testing.assert_close(out, ref_out.detach(), **TOL[dtype])
    torch.testing.assert_close(lse.to(dtype), ref_lse.detach(), **TOL[dtype])
    dq, dk, dv = kern.bwd(dout, q, k, v, out, lse, causal, scale)
    assert dk.shape == k.shape and dv.shape == v.shape  # GQA: gradients keep H_kv heads
    for got, leaf in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(got, leaf.grad, **TOL[dtype])


def test_merging_two_blocks_equals_one_block_with_final_lse_backward() -> None:
    """Splitting the keys in two and merging by LSE gives the full result; each block's
    backward fed the *final* out/LSE sums to the full gradients."""
    kern = TorchCPUKernel()
    q, k, v, dout = _inputs(4, 2, 16, 32, torch.float64, seed=3)
    out_full, lse_full = kern.fwd(q, k, v, False, 0.25)
    o1, l1 = kern.fwd(q, k[:, :, :12], v[:, :, :12], False, 0.25)
    o2, l2 = kern.fwd(q, k[:, :, 12:], v[:, :, 12:], False, 0.25)
    out, lse = o1.clone(), l1.contiguous().clone()
    _merge(out, lse, o2, l2)
    torch.testing.assert_close(out, out_full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_full, rtol=1e-12, atol=1e-12)
    g_full = kern.bwd(dout, q, k, v, out_full, lse_full, False, 0.25)
    g1 = kern.bwd(dout, q, k[:, :, :12], v[:, :, :12], out, lse, False, 0.25)
    g2 = kern.bwd(dout, q, k[:, :, 12:], v[:, :, 12:], out, lse, False, 0.25)
    torch.testing.assert_close(g1[0] + g2[0], g_full[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat([g1[1], g2[1]], dim=2), g_full[1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat([g1[2], g2[2]], dim=2), g_full[2], rtol=1e-10, atol=1e-10)


def test_merge_is_stable_for_far_apart_lse() -> None:
    out = torch.zeros(1, 1, 2, 4)
    lse = torch.tensor([[[0.0, 200.0]]])
    blk_out = torch.ones(1, 1, 2, 4)
    blk_lse = torch.tensor([[[200.0, 0.0]]])
    _merge(out, lse, blk_out, blk_lse)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out[0, 0, 0], torch.ones(4))  # the block dominates row 0
    torch.testing.assert_close(out[0, 0, 1], torch.zeros(4))  # the running value dominates row 1
    torch.testing.assert_close(lse, torch.tensor([[[200.0, 200.0]]]))


@pytest.mark.parametrize("device, backend, match", [
    ("cpu", "xformers", "unknown attention backend"),
    ("cpu", "flash_attn", "needs a CUDA device"),
    ("meta", "auto", "no attention kernel"),
])
def test_get_kernel_errors(device: str, backend: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        get_kernel(device, backend)  # type: ignore[arg-type]


def test_flash_attn_backend_without_the_package_is_one_clear_error(monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails as when it is not installed
    assert not flash_attn_available()
    with pytest.raises(ValueError, match=r"flash-attn package is not installed: pip install 'braid-pipeline\[flash\]'"):
        get_kernel("cuda", "flash_attn")
    assert isinstance(get_kernel("cpu"), TorchCPUKernel)  # the default backend needs no flash-attn


def test_kernel_rejects_bad_shapes() -> None:
    q = torch.zeros(1, 3, 8, 16)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        get_kernel("cpu").fwd(q, torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16), False, 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and flash_attn_available()), reason="needs CUDA and flash-attn")
def test_flash_attn_kernel_matches_torch_cuda() -> None:
    q, k, v, dout = (t.cuda().bfloat16() for t in _inputs(4, 2, 128, 128, torch.float32))
    fa, tc = get_kernel("cuda", "flash_attn"), get_kernel("cuda", "torch_flash")
    for causal in (True, False):
        o1, l1 = fa.fwd(q, k, v, causal, 0.25)
        o2, l2 = tc.fwd(q, k, v, causal, 0.25)
        torch.testing.assert_close(o1, o2, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(l1, l2, rtol=1e-3, atol=1e-3)
        for a, b in zip(fa.bwd(dout, q, k, v, o1, l1, causal, 0.25), tc.bwd(dout, q, k, v, o2, l2, causal, 0.25)):
            torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)
