"""(Double-)ring attention over the context-parallel group, zigzag causal balance.

LoongTrain Sec. 3.2-3.3. The CP group of size ``d_cp`` holds the sequence in *zigzag*
order: it is cut into ``2*d_cp`` chunks and CP rank ``c`` holds chunks ``c`` and
``2*d_cp-1-c`` (in that order). Key/value blocks travel the ring; every rank merges the
partial outputs with the log-sum-exp in fp32. With causal masking every non-diagonal block
is exactly half work: a block from an earlier rank is seen by all local queries through
its first half only, a block from a later rank only by the local second half.

Double ring: CP rank ``c = o*w + i`` sits at inner index ``i`` of outer ring ``o``. Each
outer step runs a full inner ring (``w`` blocks) while the next outer block is prefetched
from the outer neighbour; ``w = d_cp`` is the plain ring. In the backward, dK/dV
accumulators travel with the blocks: once round the inner ring, then along the outer ring,
so the total for every block lands on its owner. Every transfer is posted before the
compute it overlaps with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from braid.attention.kernels import BlockKernel, get_kernel


@dataclass(frozen=True, slots=True, eq=False)
class RingSpec:
    """One rank's view of its (double) ring: CP position, groups and neighbours (global ranks)."""

    d_cp: int
    w: int
    cp_rank: int
    inner_group: dist.ProcessGroup | None = None
    outer_group: dist.ProcessGroup | None = None
    inner_next: int = -1
    inner_prev: int = -1
    outer_next: int = -1
    outer_prev: int = -1

    def __post_init__(self) -> None:
        if self.d_cp < 1 or self.w < 1 or self.d_cp % self.w:
            raise ValueError(f"inner ring size w={self.w} must divide d_cp={self.d_cp}")
        if not 0 <= self.cp_rank < self.d_cp:
            raise ValueError(f"cp_rank {self.cp_rank} outside 0..{self.d_cp - 1}")

    @property
    def n_outer(self) -> int:
        return self.d_cp // self.w

    def source(self, t: int, s: int) -> int:
        """CP rank whose K/V block this rank holds at outer step ``t``, inner step ``s``."""
        o, i = divmod(self.cp_rank, self.w)
        return ((o - t) % self.n_outer) * self.w + (i - s) % self.w


class ForwardCache(Protocol):
    """Returns a stored (out, lse) or computes and stores it (Selective Checkpoint++)."""

    def fetch(self, compute: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]: ...


def _exchange(send: torch.Tensor, recv: torch.Tensor, to: int, frm: int, group: dist.ProcessGroup | None
              ) -> list[Any]:
    ops = [dist.P2POp(dist.isend, send, to, group), dist.P2POp(dist.irecv, recv, frm, group)]
    return dist.batch_isend_irecv(ops)


def _wait(reqs: list[Any]) -> None:
    for r in reqs:
        r.wait()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _merge(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor) -> None:
    """In place: fold one block's (out, lse) into the running (out, lse); stable sigmoid form."""
    blk_out, blk_lse = blk_out.to(out.dtype), blk_lse.to(lse.dtype)
    out.sub_(torch.sigmoid(blk_lse - lse).unsqueeze(-1) * (out - blk_out))
    lse.sub_(F.logsigmoid(lse - blk_lse))


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: RingSpec, kernel: BlockKernel,
                 causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward over the ring: (out in q's dtype, lse in fp32 or wider). Shapes as the kernels'."""
    half = q.shape[2] // 2
    acc = _acc_dtype(q.dtype)
    out = lse = None
    outer_kv = torch.stack([k, v])  # (2, B, H_kv, S_loc, D): one message per hop
    for t in range(spec.n_outer):
        if t < spec.n_outer - 1:  # prefetch the next outer block during the whole inner ring
            outer_next = torch.empty_like(outer_kv)
            outer_reqs = _exchange(outer_kv, outer_next, spec.outer_next, spec.outer_prev, spec.outer_group)
        cur = outer_kv
        for s in range(spec.w):
            if s < spec.w - 1:
                nxt = torch.empty_like(cur)
                inner_reqs = _exchange(cur, nxt, spec.inner_next, spec.inner_prev, spec.inner_group)
            src = spec.source(t, s)
            kb, vb = cur[0], cur[1]
            if src == spec.cp_rank:  # the diagonal block, always first: initialises every row
                o_b, l_b = kernel.fwd(q, kb, vb, causal, scale)
                out, lse = o_b.to(acc), l_b.to(acc).contiguous()
            elif not causal:
                _merge(out, lse, *kernel.fwd(q, kb, vb, False, scale))
            elif src < spec.cp_rank:  # earlier chunk src is visible to all local rows
                _merge(out, lse, *kernel.fwd(q, kb[:, :, :half], vb[:, :, :half], False, scale))
            else:  # only the local late chunk sees the block (both of its chunks lie before it)
                _merge(out[:, :, half:], lse[:, :, half:], *kernel.fwd(q[:, :, half:], kb, vb, False, scale))
            if s < spec.w - 1:
                _wait(inner_reqs)
                cur = nxt
        if t < spec.n_outer - 1:
            _wait(outer_reqs)
            outer_kv = outer_next
    assert out is not None and lse is not None
    return out.to(q.dtype), lse


def _block_backward(kernel: BlockKernel, src: int, me: int, causal: bool, scale: float, half: int,
                    dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    lse_late: torch.Tensor, dq: torch.Tensor, dkv: torch.Tensor) -> None:
    kb, vb = kv[0], kv[1]
    if src == me or not causal:
        g = kernel.bwd(dout, q, kb, vb, out, lse, causal and src == me, scale)
        dq.add_(g[0])
        dkv[0].add_(g[1])
        dkv[1].add_(g[2])
    elif src < me:
        g = kernel.bwd(dout, q, kb[:, :, :half], vb[:, :, :half], out, lse, False, scale)
        dq.add_(g[0])
        dkv[0, :, :, :half].add_(g[1])
        dkv[1, :, :, :half].add_(g[2])
    else:
        g = kernel.bwd(dout[:, :, half:], q[:, :, half:], kb, vb, out[:, :, half:], lse_late, False, scale)
        dq[:, :, half:].add_(g[0])
        dkv[0].add_(g[1])
        dkv[1].add_(g[2])


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, spec: RingSpec, kernel: BlockKernel, causal: bool, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward over the ring from the *final* out/lse; returns (dq, dk, dv) in the inputs' dtypes."""
    half = q.shape[2] // 2
    acc = _acc_dtype(q.dtype)
    dout = dout.contiguous()
    lse_late = lse[:, :, half:].contiguous()
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    outer_kv = torch.stack([k, v])
    outer_req: list[Any] | None = None
    outer_in = outer_sent = total = None
    for t in range(spec.n_outer):
        if t < spec.n_outer - 1:
            outer_next = torch.empty_like(outer_kv)
            outer_reqs = _exchange(outer_kv, outer_next, spec.outer_next, spec.outer_prev, spec.outer_group)
        cur = outer_kv
        inner_req: list[Any] | None = None
        inner_in = inner_sent = None
        for s in range(spec.w):
            if s < spec.w - 1:
                nxt = torch.empty_like(cur)
                inner_reqs = _exchange(cur, nxt, spec.inner_next, spec.inner_prev, spec.inner_group)
            contrib = torch.zeros(cur.shape, dtype=acc, device=q.device)
            _block_backward(kernel, spec.source(t, s), spec.cp_rank, causal, scale, half,
                            dout, q, cur, out, lse, lse_late, dq, contrib)
            if inner_req is not None:  # the accumulator for this block from the inner predecessor
                _wait(inner_req)
                contrib.add_(inner_in)
            if spec.w > 1:
                inner_in, inner_sent = torch.empty_like(contrib), contrib
                inner_req = _exchange(inner_sent, inner_in, spec.inner_next, spec.inner_prev, spec.inner_group)
            else:
                total = contrib
            if s < spec.w - 1:
                _wait(inner_reqs)
                cur = nxt
        if inner_req is not None:  # after a full inner ring: the inner sum for my outer-current block
            _wait(inner_req)
            total = inner_in
        if outer_req is not None:  # the outer predecessors' sum for the same block
            _wait(outer_req)
            total = total + outer_in
        if spec.n_outer > 1:
            outer_in, outer_sent = torch.empty_like(total), total
            outer_req = _exchange(outer_sent, outer_in, spec.outer_next, spec.outer_prev, spec.outer_group)
        if t < spec.n_outer - 1:
            _wait(outer_reqs)
            outer_kv = outer_next
    if outer_req is not None:
        _wait(outer_req)
        total = outer_in
    assert total is not None
    return dq.to(q.dtype), total[0].to(k.dtype), total[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Autograd Function around :func:`ring_forward`/:func:`ring_backward`; returns (out, lse)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: RingSpec,
                kernel: BlockKernel, causal: bool, scale: float, cache: ForwardCache | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        def compute() -> tuple[torch.Tensor, torch.Tensor]:
            return ring_forward(q, k, v, spec, kernel, causal, scale)

        out, lse = compute() if cache is None else cache.fetch(compute)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.kernel, ctx.causal, ctx.scale = spec, kernel, causal, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor | None) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.spec, ctx.kernel, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: RingSpec, *, causal: bool,
                   scale: float, kernel: BlockKernel | None = None, cache: ForwardCache | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of the local zigzag shard against the whole CP group's sequence.

    q (B, H, S_loc, D), k/v (B, H_kv, S_loc, D) where ``S_loc = 2 * chunk``; returns
    (out (B, H, S_loc, D), lse (B, H, S_loc)). Autograd-aware in q, k, v.
    """
    if causal and q.shape[2] % 2:
        raise ValueError(f"causal zigzag ring needs an even local sequence, got {q.shape[2]}")
    kern = kernel if kernel is not None else get_kernel(q.device)
    return RingAttention.apply(q, k, v, spec, kern, causal, scale, cache)
