"""Point-to-point transfers between pipeline ranks.

A maximal run of consecutive ``Send``/``Recv`` instructions is issued as one
``dist.batch_isend_irecv``; the executor waits for a receive only when the compute that
consumes it comes up, and for sends at the end of the program. The compiler orders
communication so this cannot deadlock, and the simulator models the same semantics. Every message carries a tag derived from (kind, micro-batch, receiving stage),
so gloo matches messages by identity; NCCL ignores tags and relies on the order.
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
