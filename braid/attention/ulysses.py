"""SeqAlltoAll over the head-parallel group (Ulysses; LoongTrain Sec. 3.1).

Turns a sequence-sharded tensor (all heads, S/d_hp of the tokens) into a head-sharded one
(H/d_hp of the heads, all S tokens of the HP group) and back, with one
``dist.all_to_all_single``. Rank ``j`` of the HP group holds sequence piece ``j`` before
the exchange and head group ``j`` after it; the gathered sequence is the pieces in HP-rank
order. The backward of one direction is the other direction.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _a2a(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_head(x: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """(B, H, S_loc, D) sequence-sharded -> (B, H/size, size*S_loc, D) head-sharded; no autograd."""
    if size == 1:
        return x
    b, h, s, d = x.shape
    if h % size:
        raise ValueError(f"{h} heads cannot be split over a head-parallel group of {size}")
    # (size[dst head group], B, H/size, S_loc, D): chunk j goes to HP rank j
    send = x.reshape(b, size, h // size, s, d).transpose(0, 1).contiguous()
    recv = _a2a(send, group)  # (size[src seq piece], B, H/size, S_loc, D)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def head_to_seq(x: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """(B, H/size, size*S_loc, D) head-sharded -> (B, H, S_loc, D) sequence-sharded; no autograd."""
    if size == 1:
        return x
    b, hl, sf, d = x.shape
    if sf % size:
        raise ValueError(f"sequence of {sf} cannot be split over a head-parallel group of {size}")
    s = sf // size
    # (size[dst seq piece], B, H/size, S_loc, D)
    send = x.reshape(b, hl, size, s, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = _a2a(send, group)  # (size[src head group], B, H/size, S_loc, D)
    return recv.transpose(0, 1).reshape(b, size * hl, s, d)


class SeqToHead(torch.autograd.Function):
    """Autograd-aware :func:`seq_to_head`; its backward is :func:`head_to_seq`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return seq_to_head(x, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return head_to_seq(grad.contiguous(), ctx.group, ctx.size), None, None


class HeadToSeq(torch.autograd.Function):
    """Autograd-aware :func:`head_to_seq`; its backward is :func:`seq_to_head`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return head_to_seq(x, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return seq_to_head(grad.contiguous(), ctx.group, ctx.size), None, None
