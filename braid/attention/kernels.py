"""Block attention kernels behind one interface: forward with log-sum-exp, backward from it.

Ring attention (LoongTrain, Sec. 3.2-3.3) computes attention block by block and merges the
partial results with the log-sum-exp (LSE) of every query row, so a block kernel must
return the LSE and its backward must accept the *final* (merged) output and LSE. Every
backend here does exactly that, in one layout:

    q (B, H, Sq, D), k/v (B, H_kv, Sk, D)  ->  out (B, H, Sq, D), lse (B, H, Sq) float32+

``H`` must be a multiple of ``H_kv`` (grouped-query attention); ``bwd`` returns dK/dV with
``H_kv`` heads. ``causal`` masks top-left aligned and is only used with ``Sq == Sk`` by the
ring, so the alignment conventions of the backends never differ where it matters.
"""

from __future__ import annotations

import logging
from typing import Literal, Protocol

import torch

logger = logging.getLogger(__name__)

Backend = Literal["auto", "torch_flash", "torch_cudnn", "flash_attn"]
BACKENDS: tuple[str, ...] = ("auto", "torch_flash", "torch_cudnn", "flash_attn")


class BlockKernel(Protocol):
    """One attention block with LSE; see the module docstring for shapes."""

    name: str

    def fwd(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
            ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def bwd(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (batch, heads, seq, head_dim); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"k and v must have the same shape and share batch/head_dim with q; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")


class TorchCPUKernel:
    """torch's CPU flash-attention ops (``aten._scaled_dot_product_flash_attention_for_cpu``).

    Handles fp64/fp32/bf16/fp16 and grouped-query attention natively; the LSE is fp32 for
    low-precision inputs and in the input dtype otherwise.
    """

    name = "torch-cpu"

    def fwd(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_shapes(q, k, v)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse

    def bwd(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
        return dq, dk, dv


class TorchCUDAKernel:
    """torch's CUDA flash-attention ops (``aten._scaled_dot_product_flash_attention``).

    fp16/bf16 only (the flash kernel's limit); the LSE is fp32 (B, H, S). Grouped-query
    attention works without repeating K/V. Dropout is always 0 and batches are dense, so the
    backward's cumulative-length arguments are None (as the forward returns them) and its
    RNG arguments empty.
    """

    name = "torch-cuda"

    def fwd(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_shapes(q, k, v)
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the CUDA flash kernel needs float16 or bfloat16 inputs, got {q.dtype}; cast q/k/v")
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1]

    def bwd(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rng = torch.empty(0, dtype=torch.uint64, device=q.device)  # philox seed/offset: unused without dropout
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2],
            0.0, causal, rng, rng, scale=scale)
        return dq, dk, dv


class TorchCuDNNKernel:
    """torch's cuDNN attention ops (``aten._scaled_dot_product_cudnn_attention``).

    fp16/bf16; grouped-query attention native; the LSE comes back as (B, H, S, 1) fp32 and
    is returned as (B, H, S). Measured ~1.7x faster than the flash ops for fwd+bwd at 32K
    tokens on an H200 (torch 2.11), which is why ``auto`` picks it on CUDA.
    """

    name = "torch-cudnn"

    def fwd(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_shapes(q, k, v)
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the cuDNN attention kernel needs float16 or bfloat16 inputs, got {q.dtype}; cast q/k/v")
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        return res[0], res[1].squeeze(-1)

    def bwd(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rng = torch.zeros((), dtype=torch.int64, device=q.device)  # philox seed/offset: unused without dropout
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout.contiguous(), q, k, v, out, lse.contiguous().unsqueeze(-1), rng, rng, None, None, None,
            q.shape[2], k.shape[2], 0.0, causal, scale=scale)
        return dq, dk, dv


class FlashAttnKernel:
    """Adapter for the ``flash-attn`` package (v2.6+ internal functions), optional.

    Not exercised by this repository's tests unless ``flash_attn`` is installed (it has
    no wheel on the package index); its private ``_flash_attn_forward/_backward``
    signatures change between releases, so treat this backend as untested until a GPU
    test with the package passes. flash-attn works in (B, S, H, D); we transpose.
    """

    name = "flash-attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_interface  # optional dependency

        self._fa = flash_attn_interface

    def fwd(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_shapes(q, k, v)
        q_, k_, v_ = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        res = self._fa._flash_attn_forward(q_, k_, v_, 0.0, scale, causal, -1, -1, 0.0, None, False)
        return res[0].transpose(1, 2), res[1]

    def bwd(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_, k_, v_, o_, do_ = (t.transpose(1, 2).contiguous() for t in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(q_), torch.empty_like(k_), torch.empty_like(v_)
        self._fa._flash_attn_backward(do_, q_, k_, v_, o_, lse.contiguous(), dq, dk, dv,
                                      0.0, scale, causal, -1, -1, 0.0, None, False, None)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def flash_attn_available() -> bool:
    """Whether the optional ``flash-attn`` package can be imported."""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def get_kernel(device: torch.device | str, backend: Backend = "auto") -> BlockKernel:
    """The block kernel for ``device``.

    ``auto``: torch's cuDNN attention on CUDA, torch's flash ops on CPU. ``torch_flash`` /
    ``torch_cudnn`` force one of torch's CUDA kernels; ``flash_attn`` requires the package.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    dev = torch.device(device)
    if backend == "flash_attn":
        if dev.type != "cuda":
            raise ValueError("the flash_attn backend needs a CUDA device; use backend='auto' on CPU")
        if not flash_attn_available():
            raise ValueError("backend='flash_attn' but the flash-attn package is not installed: "
                             "pip install 'braid-pipeline[flash]', or use backend='auto'")
        return FlashAttnKernel()
    if dev.type == "cuda":
        return TorchCUDAKernel() if backend == "torch_flash" else TorchCuDNNKernel()
    if dev.type == "cpu":
        return TorchCPUKernel()
    raise ValueError(f"no attention kernel for device type {dev.type!r}; use cpu or cuda")


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax attention with LSE, autograd-friendly; the ground truth in tests and benchmarks.

    Computes in the inputs' dtype (pass fp64/fp32 for a reference). GQA by repeating K/V.
    """
    _check_shapes(q, k, v)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, H, Sq, Sk)
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.softmax(s, dim=-1), v), lse
