"""Sequence sharding's unit heads, run by the executor as the reduce-scatter before them ends.

Under sequence parallelism inside TP (:mod:`braid.tp.seq_shard`) a unit that ends with the TP
reduction is followed, in its op, by one that starts with a norm (or a norm backward) on the
rank's tokens and then all-gathers the sequence. The executor runs that *head*
(:meth:`braid.models.seq_shard_ops.SeqShardOps.follow`) as soon as the reduce-scatter ends and
leaves the all-gather in flight; the next unit of the op waits for it where it would have
waited for the all-reduce. So a braided block hides both collectives behind its partner's
units, and :mod:`braid.core.braiding` stays the one place that says what overlaps what.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from braid.core.braiding import UnitTask


class _Joined:
    """The work of an all-gather that a side stream started after a reduce-scatter: ``wait``
    orders the current stream after both. It holds the reduce-scatter's input and the tensors
    the head read or made (``keep``) until then: a tensor made on the caller's stream, which
    nothing yet orders after the side stream, freed earlier could have its memory handed to the
    caller's next tensors while the side stream still reads it. Held rather than marked with
    ``record_stream``: a block so marked is not reused inside a CUDA-graph capture (the
    allocator defers it to the capture's end), so every micro-batch's heads would add their
    bytes to a captured step's pool."""

    __slots__ = ("work", "side", "keep")

    def __init__(self, work: Any, side: Any, keep: Any) -> None:
        self.work, self.side, self.keep = work, side, keep

    def wait(self, timeout: Any = None) -> bool:  # noqa: ARG002 - same signature as dist.Work.wait
        self.work.wait()
        torch.cuda.current_stream().wait_stream(self.side)
        self.keep = None  # the caller's stream is now after the reduce-scatter
        return True


class Follower:
    """Runs a unit's head after the reduce-scatter ``work`` of its op's previous unit (module doc).

    On CUDA the head runs on a side stream ordered after the reduce-scatter, so the host goes
    on to the braided partner's units at once and both collectives run beside them; the
    tensors the head reads or makes are held until the caller's stream waits for the side
    stream (:class:`_Joined`): then a block made on the caller's stream is free to reuse there,
    and one made on the side stream is reused there only after its next ``wait_stream`` on the
    caller's, which every later head starts with (after whatever read it on the caller's). On
    CPU the host waits for the reduce-scatter first (``wait``: the executor's bounded wait);
    the all-gather still runs beside the next units.
    """

    def __init__(self, device: torch.device, wait: Callable[[Any], None]) -> None:
        self.device, self.wait = device, wait
        self._side: Any = None

    def __call__(self, work: Any, chunk: Any, mb: int, task: UnitTask, keep: Any = None) -> Any:
        """Start ``task``'s head on micro-batch ``mb`` of ``chunk`` after ``work`` (the reduce-scatter
        of ``keep``, which is held until the head's all-gather is waited for); returns that gather's work."""
        if self.device.type != "cuda":
            self.wait(work)
            return chunk.follow(mb, task)[0]
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        cur, side = torch.cuda.current_stream(self.device), self._side
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            work.wait()  # stream-ordered: the side stream waits for the reduce-scatter
            gather, touched = chunk.follow(mb, task)
        return _Joined(gather, side, (keep, touched))
