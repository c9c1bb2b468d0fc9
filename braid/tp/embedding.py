"""Vocab-parallel embedding and cross-entropy (Megatron-style), with a deferrable weight gradient.

Each TP rank holds the rows ``[start, end)`` of the vocabulary. The embedding returns a
partial sum (zeros for tokens outside the shard) that the executor all-reduces at the end
of the ``embed`` unit. The loss never gathers the full logits: the max and the sum of
exponentials, and the target logit, are all-reduced over the TP group (paper Sec. 3; the
LM head is column-parallel over the vocabulary).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from braid.tp.layers import DeferredWeightGrad, _check_split


class _EmbeddingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_ids: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor, mod: "VocabParallelEmbedding") -> torch.Tensor:
        # Saved: the local ids with -1 for other shards' tokens, one int64 per token (what
        # nn.Embedding saves, so the plain module of a joint micro-batch keeps the same bytes).
        ctx.save_for_backward(local_ids.masked_fill(mask, -1))
        ctx.mod = mod
        out = weight[local_ids]  # (b, s, h)
        return out.masked_fill_(mask.unsqueeze(-1), 0.0)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (ids,) = ctx.saved_tensors
        (dw,) = ctx.mod._stash_or_grad(ids, grad_out)
        return None, None, dw, None


class VocabParallelEmbedding(DeferredWeightGrad):
    """Rows ``[tp_rank*V/tp, (tp_rank+1)*V/tp)`` of the embedding table; output is a partial sum over TP."""

    def __init__(self, weight: torch.Tensor, vocab_start: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone().contiguous())
        self.vocab_start = vocab_start
        self._init_deferred()

    @classmethod
    def from_full(cls, emb: nn.Embedding, tp_rank: int, tp_size: int) -> "VocabParallelEmbedding":
        n = _check_split(emb.weight.shape[0], tp_size, tp_rank, "vocab size")
        return cls(emb.weight.detach()[tp_rank * n : (tp_rank + 1) * n], tp_rank * n)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.native.on:  # the whole vocabulary (tp=1): nn.Embedding's forward and backward
            return nn.functional.embedding(tokens, self.weight)
        n = self.weight.shape[0]
        local = tokens - self.vocab_start
        mask = (local < 0) | (local >= n)
        return _EmbeddingFn.apply(local.masked_fill(mask, 0), mask, self.weight, self)

    def _deferred_params(self) -> list[nn.Parameter | None]:
        return [self.weight]

    def _weight_grads(self, inp: torch.Tensor, grad_out: torch.Tensor) -> list[torch.Tensor | None]:
        # ``inp``: local ids with -1 for tokens of other shards. Their rows of the gradient are
        # zeroed rather than dropped: selecting the kept rows (``g[keep]``) sizes a tensor by a
        # count on the device, which stops the host until the device catches up, twice per
        # micro-batch. embedding_dense_backward is what nn.Embedding's backward runs
        # (deterministic, accumulated in fp32 on CUDA), so tp=1 matches the unsharded model.
        ids = inp.reshape(-1)
        other = (ids < 0).unsqueeze(-1)
        g = grad_out.reshape(-1, grad_out.shape[-1]).masked_fill(other, 0)
        dw = torch.ops.aten.embedding_dense_backward(g, ids.clamp(min=0), self.weight.shape[0], -1, False)
        return [dw]


def ce_row_max(logits: torch.Tensor) -> torch.Tensor:
    """Per-token max of the shard's logits (tokens, V/tp), in fp32 (fp64 for an fp64 model)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32)).amax(dim=-1)


def ce_row_stats(logits: torch.Tensor, lmax: torch.Tensor, local: torch.Tensor, mask: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(target logit, sum of exponentials) per token, shifted by the global max ``lmax``; the target is 0
    where the label is another shard's (``mask``)."""
    shifted = logits.to(lmax.dtype) - lmax.unsqueeze(-1)
    target = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(mask, 0.0)
    return target, shifted.exp_().sum(-1)


def ce_logits_grad(logits: torch.Tensor, lmax: torch.Tensor, sum_exp: torch.Tensor, local: torch.Tensor,
                   mask: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
    """d loss / d logits = (softmax - one-hot of the label) * grad_loss, the softmax recomputed from the
    logits and the two per-token figures (none kept between forward and backward); in the logits' dtype."""
    soft = (logits.to(lmax.dtype) - lmax.unsqueeze(-1)).exp_().div_(sum_exp.unsqueeze(-1))  # one new tensor, in place after
    soft.scatter_add_(-1, local.unsqueeze(-1), (mask.to(soft.dtype) - 1).unsqueeze(-1))  # -1 at this shard's labels
    return soft.mul_(grad_loss.unsqueeze(-1)).to(logits.dtype)


def ce_logits_grad_fused(logits: torch.Tensor, lmax: torch.Tensor, sum_exp: torch.Tensor, local: torch.Tensor,
                         mask: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
    """:func:`ce_logits_grad`'s values (bit for bit), written element-wise for ``torch.compile``: the one-hot
    is a comparison with the column index instead of a scatter, so Inductor makes one kernel that writes
    only the result in the logits' dtype. (The scatter splits it: an fp32 softmax of the shard, 2x the
    logits' bytes in bf16, lived beside the result -- the workspace the memory model did not price.)
    Eager, this form makes more temporaries than :func:`ce_logits_grad`'s in-place one."""
    soft = (logits.to(lmax.dtype) - lmax.unsqueeze(-1)).exp().div(sum_exp.unsqueeze(-1))
    hit = (torch.arange(logits.shape[-1], device=logits.device) == local.unsqueeze(-1)) & ~mask.unsqueeze(-1)
    return (torch.where(hit, soft - 1, soft) * grad_loss.unsqueeze(-1)).to(logits.dtype)


class CEKernels(NamedTuple):
    """The vocab-parallel loss's three element-wise pieces, between its two all-reduces (eager by
    default; :mod:`braid.runtime.compiled` gives ``torch.compile``d ones, each a fused kernel or two,
    the logits' gradient from :func:`ce_logits_grad_fused`)."""

    row_max: Callable[[torch.Tensor], torch.Tensor] = ce_row_max
    row_stats: Callable[..., tuple[torch.Tensor, torch.Tensor]] = ce_row_stats
    logits_grad: Callable[..., torch.Tensor] = ce_logits_grad


EAGER_CE = CEKernels()


class _VocabParallelCE(torch.autograd.Function):
    """Kept for the backward: the logits in their own dtype and two fp32 figures per token (the max and
    the sum of exponentials), not an fp32 softmax of the shard: half the bytes in bf16, and the
    backward's one pass over the logits recomputes it."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, group: dist.ProcessGroup | None,
                kernels: CEKernels) -> torch.Tensor:
        # logits: (tokens, V/tp); labels: (tokens,)
        lmax = kernels.row_max(logits)
        if group is not None:
            dist.all_reduce(lmax, op=dist.ReduceOp.MAX, group=group)
        n = logits.shape[-1]
        local = labels - vocab_start
        mask = (local < 0) | (local >= n)
        local = local.masked_fill(mask, 0)
        target, sum_exp = kernels.row_stats(logits, lmax, local, mask)
        if group is not None:
            both = torch.stack([target, sum_exp])
            dist.all_reduce(both, group=group)
            target, sum_exp = both[0], both[1]
        ctx.save_for_backward(logits, lmax, sum_exp, local, mask)
        ctx.kernels = kernels
        return sum_exp.log() - target  # (tokens,)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, lmax, sum_exp, local, mask = ctx.saved_tensors
        return ctx.kernels.logits_grad(logits, lmax, sum_exp, local, mask, grad_loss.contiguous()), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int = 0, group: dist.ProcessGroup | None = None,
    kernels: CEKernels = EAGER_CE,
) -> torch.Tensor:
    """Per-token cross-entropy of vocab-sharded ``logits`` (``(..., V/tp)``); ``group=None`` means tp=1."""
    flat = logits.reshape(-1, logits.shape[-1])
    return _VocabParallelCE.apply(flat, labels.reshape(-1), vocab_start, group, kernels).view(labels.shape)
