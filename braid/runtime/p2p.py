"""Point-to-point transfers between pipeline ranks.

A maximal run of consecutive ``Send``/``Recv`` instructions is issued as one
``dist.batch_isend_irecv``; the executor waits for a receive only when the compute that
consumes it comes up; a send's tensor goes once its batch was waited or is complete
(``Executor._drop_sent``), the rest at the end of the program. The compiler orders
communication so this cannot deadlock, and the simulator models the same semantics. Every message carries a tag derived from (kind, micro-batch, receiving stage),
so gloo matches messages by identity; NCCL ignores tags and relies on the order.

Staged transfers (:class:`Staging`). NCCL runs a transfer on its own stream, and the caching
allocator marks the tensor as used there. A block so marked and freed while a CUDA graph captures
is not reused until the capture ends (the allocator cannot query an event inside a capture), so in
a captured step every message's tensor -- a sent output, a receive buffer -- adds its bytes to the
graph's pool: on two H100s, 148 MiB a micro-batch at tp=1 x pp=2 (7b-layer, seq 4096), a pool
growing with m where an eager step's peak does not. A captured step therefore sends and receives
through buffers it keeps: a sent tensor is copied into a free staging buffer, a receive lands in one
and is copied out on the compute stream; a buffer is free again once its transfer was waited (the
compute stream ordered after it). So the buffers in use are the messages in flight, a number the
schedule bounds, not one per message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from braid.core.ir import CommKind, Recv, Send


@dataclass(slots=True)
class Transfer:
    """One message of a batch; ``buffer`` is the sent tensor or the receive buffer."""

    instr: Send | Recv
    index: int  # instruction index in the program
    buffer: torch.Tensor
    dst_stage: int
    staged: bool = False  # ``buffer`` is a :class:`Staging` buffer, given back when the transfer is waited


class Staging:
    """Staging buffers kept across messages and steps (module doc), free lists by shape, dtype and device."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self.made = 0  # buffers allocated so far (each lives as long as this object)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A free buffer of this kind, or a new one."""
        free = self._free.setdefault((tuple(shape), dtype, device), [])
        if free:
            return free.pop()
        self.made += 1
        return torch.empty(shape, dtype=dtype, device=device)

    def give(self, buf: torch.Tensor) -> None:
        """``buf`` is free again: its transfer was waited (the caller's stream is ordered after it)."""
        self._free.setdefault((tuple(buf.shape), buf.dtype, buf.device), []).append(buf)

    def send(self, t: torch.Tensor) -> torch.Tensor:
        """A staging buffer holding a copy of ``t`` (copied on the current stream)."""
        buf = self.take(t.shape, t.dtype, t.device)
        buf.copy_(t)
        return buf

    def received(self, buf: torch.Tensor) -> torch.Tensor:
        """What a staged receive hands on: a copy of ``buf`` made on the current stream; ``buf`` is free again."""
        out = buf.clone()
        self.give(buf)
        return out


def message_tag(comm: CommKind, mb: int, dst_stage: int, num_stages: int) -> int:
    """Unique tag of a message: what travels (A/G), for which micro-batch, to which stage."""
    return ((mb * num_stages + dst_stage) * 2) + (0 if comm is CommKind.ACT else 1)


def issue(transfers: list[Transfer], global_rank_of: Callable[[int], int], num_stages: int) -> list[dist.Work]:
    """Issue a batch of sends and receives as one ``batch_isend_irecv``; returns the work handles."""
    if not transfers:
        return []
    ops = []
    for t in transfers:
        fn = dist.isend if isinstance(t.instr, Send) else dist.irecv
        tag = message_tag(t.instr.comm, t.instr.mb, t.dst_stage, num_stages)
        ops.append(dist.P2POp(fn, t.buffer, global_rank_of(t.instr.peer), tag=tag))
    return dist.batch_isend_irecv(ops)
