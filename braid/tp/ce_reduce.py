"""The TP all-reduce and reduce-scatter built from NCCL's copy-engine collectives (``nccl-ce``).

NCCL 2.28.9 drives four collectives with the GPU's copy engines instead of kernels: AllGather,
AlltoAll, Gather and Scatter (``src/ce_coll.cc``, ``ncclCeImplemented``); no reduction. It
takes that path only when (``src/enqueue.cc``, ``taskAppend``) the communicator's CTA policy is
exactly ``NCCL_CTA_POLICY_ZERO``, the communicator spans one node, every peer is reachable over
CUDA P2P with cuMem (``symmetricSupport``), and *both* the send and the receive buffer lie in
windows registered with ``NCCL_WIN_COLL_SYMMETRIC``; otherwise it runs its kernels, silently.
The zero-CTA policy alone (``nccl-zero-cta``) registers no window, so NCCL runs kernels there.

So the all-reduce of ``t`` (``n`` elements, ``w`` ranks, ``h = ceil(n / w)``, this rank ``r``)
runs as five steps on two registered buffers, ``x`` and ``a``, of ``w * h`` elements each:

1. copy ``t`` into ``x[:n]`` (the tail ``x[n:]`` is padding);
2. all-to-all ``x -> a`` (copy engines): ``a[j*h:(j+1)*h]`` is rank ``j``'s ``x[r*h:(r+1)*h]``;
3. sum the ``w`` rows of ``a`` into ``x[r*h:(r+1)*h]`` -- the only work on SMs, one reduction
   kernel. ``x`` is free again: the all-to-all has ended on this rank's stream, so its reads
   of ``x`` have, and a peer writes into ``x`` only in step 4, which NCCL's copy-engine path
   starts only once every rank has reached it;
4. all-gather ``x`` in place (copy engines): every rank's summed slice;
5. copy ``x[:n]`` back into ``t``.

Steps 1-3 alone are the reduce-scatter of sequence parallelism (:mod:`braid.tp.seq_shard`),
whose input is already laid out by destination rank. Each rank sends ``(w-1)/w`` of the
tensor in step 2 and again in step 4: the NVLink bytes of a ring all-reduce. Padding
positions sum among themselves and never reach ``t``.

Rounding: ``torch.sum`` accumulates bfloat16 and float16 in float32 and rounds once to the
output dtype (its reductions' accumulate type, on CPU and CUDA); float32 and float64 sum in
their own precision. NCCL's ring instead rounds after every step in the tensor's dtype, so
over more than two ranks the results differ in the last bits; two-rank sums (one rounding of
``a + b``) are equal.

:func:`ce_all_reduce_` and :func:`ce_reduce_scatter` are the algorithm on any buffers and
process group (gloo tests it on CPU with plain tensors). :class:`CEBuffers` owns the buffers of
one TP group: on CUDA one ``torch.cuda.MemPool`` per (size, dtype), allocated through NCCL's
allocator, holding both buffers in one allocation and registered as a symmetric window
(``register_mem_pool(pool, symm=True)``, a collective) once it exists, so no registered pool
grows; the steps run on a side stream and the caller gets an event. Sets are made on first
use, eagerly, and kept for the group's life: two padded copies of each distinct (numel, dtype)
the TP group reduces, device memory the planner's cost model does not count. A CUDA graph
capture that needs a size not made yet raises :class:`CEBufferError` (a graphed step's eager
warm-up makes every size the step uses).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from braid.tp.seq_shard import Scatter, all_gather_into


WINDOW_ALIGN = 4096  # bytes: where a staging set's second buffer starts inside its window


class CEBufferError(RuntimeError):
    """A staging set that cannot be made: inside a CUDA graph capture, or on a torch that cannot register
    symmetric windows."""


def padded_numel(n: int, world: int) -> int:
    """``n`` rounded up to a multiple of ``world``: the staging size of an all-reduce of ``n`` elements."""
    return n + (-n) % world


def ce_reduce_scatter(out: torch.Tensor, src: torch.Tensor, x: torch.Tensor, a: torch.Tensor, group: Any) -> None:
    """Steps 1-3 of the module doc: ``out`` (flat, ``h``) = the sum over ``group`` of every rank's
    ``src[r*h:(r+1)*h]``, with ``src`` (flat, ``w * h``) staged in ``x`` and received in ``a``
    (both ``w * h``). ``out`` may be a slice of ``x``."""
    if src is not x:
        x.copy_(src)
    dist.all_to_all_single(a, x, group=group)  # (w*h) -> (w, h): row j is rank j's slice for this rank
    torch.sum(a.view(dist.get_world_size(group), -1), 0, out=out)


def ce_all_to_all(out: torch.Tensor, src: torch.Tensor, x: torch.Tensor, a: torch.Tensor, group: Any) -> None:
    """``out`` (flat) = the all-to-all of ``src`` (flat, ``w`` equal blocks) over ``group``, staged in ``x``
    and received in ``a`` (both ``src.numel()``): the expert-parallel exchange of padded rows."""
    x.copy_(src)
    dist.all_to_all_single(a, x, group=group)
    out.copy_(a)


def ce_all_gather(out: torch.Tensor, local: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    """``out`` (flat, ``w * n``) = every rank's ``local`` (flat, ``n``) in rank order, staged in ``x``
    (``w * n``): this rank's slice copied in, the in-place all-gather of step 4, copied out (sequence
    sharding's all-gather, :mod:`braid.tp.seq_shard`)."""
    n, r = local.numel(), dist.get_rank(group)
    mine = x[r * n:(r + 1) * n]
    mine.copy_(local)
    all_gather_into(x, mine, group, async_op=False)
    out.copy_(x)


def ce_all_reduce_(flat: torch.Tensor, x: torch.Tensor, a: torch.Tensor, group: Any) -> None:
    """Sum ``flat`` (1-D) over ``group`` in place through ``x`` and ``a`` (each
    :func:`padded_numel` of it): the five steps of the module doc."""
    n = flat.numel()
    w, r = dist.get_world_size(group), dist.get_rank(group)
    h = x.numel() // w
    x[:n].copy_(flat)
    mine = x[r * h:(r + 1) * h]
    ce_reduce_scatter(mine, x, x, a, group)
    all_gather_into(x, mine, group, async_op=False)  # in place: this rank's slice is already there
    flat.copy_(x[:n])


def capture_refusal(numel: int, dtype: torch.dtype, capturing: bool) -> None:
    """Raise :class:`CEBufferError` (one line) when a staging set of ``numel`` x ``dtype`` would be made
    during a CUDA graph capture: registration is a collective and the pool must exist before capture."""
    if capturing:
        raise CEBufferError(f"nccl-ce: no registered staging buffers for {numel} x {str(dtype).removeprefix('torch.')} "
                            "on this TP group, and a CUDA graph capture is in progress; run the step eagerly first "
                            "(a graphed step's warm-up does), so that every size is registered before capture")


def staging_pair(numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` and ``a`` of a staging set, ``numel`` elements each, as views of one zeroed allocation;
    ``a`` starts at the first :data:`WINDOW_ALIGN`-byte boundary after ``x``."""
    stride = -(-numel * dtype.itemsize // WINDOW_ALIGN) * WINDOW_ALIGN // dtype.itemsize  # x rounded up to WINDOW_ALIGN bytes
    buf = torch.zeros(stride + numel, dtype=dtype, device=device)
    return buf[:numel], buf[stride:]


class EventWork:
    """A work handle for a collective that ran on a side stream: ``wait`` makes the current stream
    wait for it (stream-ordered, like NCCL's). ``keep``: the caller's tensors the side stream reads
    or writes, held until then -- made on the caller's stream, they must not be handed to its next
    tensors before it is ordered after the side stream (held, not marked with ``record_stream``,
    whose blocks a CUDA-graph capture does not reuse before it ends)."""

    __slots__ = ("event", "keep")

    def __init__(self, event: torch.cuda.Event, keep: Any = None) -> None:
        self.event, self.keep = event, keep

    def wait(self, timeout: object | None = None) -> bool:  # noqa: ARG002 - same signature as dist.Work.wait
        self.event.wait(torch.cuda.current_stream())
        self.keep = None
        return True

    def is_completed(self) -> bool:
        return self.event.query()


class Done:
    """The work handle of a collective that ran synchronously (the copy-engine algorithms on a CPU group)."""

    __slots__ = ()

    def wait(self, timeout: object | None = None) -> bool:  # noqa: ARG002 - same signature as dist.Work.wait
        return True

    def is_completed(self) -> bool:
        return True


class Staging(NamedTuple):
    """One staging set: ``x`` (input, then the gathered sum) and ``a`` (all-to-all output), ``numel``
    elements each; ``pool``: the registered ``torch.cuda.MemPool`` holding them (None on CPU)."""

    x: torch.Tensor
    a: torch.Tensor
    pool: Any = None


class CEBuffers:
    """The copy-engine all-reduce of one rank on one TP group (module doc): its staging sets, keyed
    by (padded numel, dtype) and kept for the group's life, and on CUDA the side stream that runs it.

    Every rank of the group must ask for the same sizes in the same order (they do: the TP ranks
    run the same units), since making a CUDA set is collective. On CPU the sets are plain tensors
    and the steps run synchronously on gloo (tests)."""

    def __init__(self, group: Any, device: torch.device) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # a memory pool needs the index
            device = torch.device("cuda", torch.cuda.current_device())
        self.group, self.device = group, device
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.sets: dict[tuple[int, torch.dtype], Staging] = {}
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._comm_ready = False

    def staging(self, numel: int, dtype: torch.dtype) -> Staging:
        """The set for ``numel`` (a multiple of the group size) elements of ``dtype``, made on first use."""
        got = self.sets.get((numel, dtype))
        if got is None:
            got = self.sets[(numel, dtype)] = (self._registered(numel, dtype) if self.cuda
                                               else Staging(*staging_pair(numel, dtype, self.device)))
        return got

    def _registered(self, numel: int, dtype: torch.dtype) -> Staging:
        """A new CUDA set: a pool of its own from NCCL's allocator, both buffers allocated in it at once,
        then the pool registered as a symmetric window and the copy-engine collectives run once on it."""
        capture_refusal(numel, dtype, torch.cuda.is_current_stream_capturing())
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if not self._comm_ready:  # registration needs the group's communicator to exist
                dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)
                self._comm_ready = True
            backend = self.group._get_backend(self.device)
            pool = torch.cuda.MemPool(backend.mem_allocator)
            # One allocation for both buffers, so the pool is one segment and one window: torch registers a
            # pool's segments in address order, which need not be the same on every rank, and NCCL pairs the
            # ranks' windows by registration order.
            with torch.cuda.use_mem_pool(pool, self.device):
                x, a = staging_pair(numel, dtype, self.device)
            try:
                backend.register_mem_pool(pool, symm=True)
            except TypeError as err:  # a torch whose register_mem_pool has no symm flag (before symmetric windows)
                raise CEBufferError(f"nccl-ce: this torch cannot register symmetric windows ({err}); "
                                    "use nccl-capped") from err
            # NCCL's first copy-engine collective on a communicator initialises its CE state (a collective):
            # run it now, eagerly, and warm both collectives on the new windows.
            dist.all_to_all_single(a, x, group=self.group)
            h = numel // self.world
            all_gather_into(x, x[self.rank * h:(self.rank + 1) * h], self.group, async_op=False)
        return Staging(x, a, pool)

    def all_reduce(self, t: torch.Tensor) -> EventWork | Done:
        """Sum ``t`` (contiguous) over the group in place. CUDA: the steps run on the side stream after
        the caller's stream; returns a handle whose ``wait`` orders the caller after them (on CPU, and
        for an empty ``t``, they have ended)."""
        flat = t.view(-1)
        if flat.numel() == 0:
            return Done()
        s = self.staging(padded_numel(flat.numel(), self.world), t.dtype)
        return self._run(lambda: ce_all_reduce_(flat, s.x, s.a, self.group), t)

    def reduce_scatter(self, req: Scatter) -> EventWork | Done:
        """``req.out`` = this rank's tokens of the sum of every rank's ``req.src`` (:mod:`braid.tp.seq_shard`);
        a handle as :meth:`all_reduce`'s."""
        src, out = req.src.view(-1), req.out.view(-1)
        s = self.staging(src.numel(), src.dtype)
        return self._run(lambda: ce_reduce_scatter(out, src, s.x, s.a, self.group), req.src, req.out)

    def all_gather(self, out: torch.Tensor, local: torch.Tensor) -> EventWork | Done:
        """``out`` (``w`` times ``local``'s elements) = every rank's ``local`` in rank order, through a staging
        set's ``x`` on the copy engines; a handle as :meth:`all_reduce`'s."""
        src, dst = local.reshape(-1), out.view(-1)
        if dst.numel() != self.world * src.numel() or src.dtype != dst.dtype:
            raise ValueError(f"nccl-ce all-gather: {src.numel()} {src.dtype} elements per rank into {dst.numel()} "
                             f"{dst.dtype}; the output holds {self.world} times the input")
        if src.numel() == 0:
            return Done()
        s = self.staging(dst.numel(), src.dtype)
        return self._run(lambda: ce_all_gather(dst, src, s.x, self.group), local, out)

    def all_to_all(self, out: torch.Tensor, send: torch.Tensor) -> EventWork | Done:
        """``out`` = the group's all-to-all of ``send`` (contiguous, the same size as ``out``, in equal
        blocks per rank) through a staging set: copied in, exchanged and copied out on the copy engines
        (an expert-parallel exchange of padded rows, :mod:`braid.models.moe_dispatch`). CUDA: on the side
        stream, a handle that holds both tensors until its ``wait``; CPU: run now."""
        src, dst = send.reshape(-1), out.view(-1)
        if src.numel() != dst.numel() or src.numel() % self.world or src.dtype != dst.dtype:
            raise ValueError(f"nccl-ce all-to-all: {src.numel()} {src.dtype} elements into {dst.numel()} {dst.dtype}; "
                             f"both the same, in {self.world} equal blocks")
        if src.numel() == 0:
            return Done()
        s = self.staging(src.numel(), src.dtype)
        return self._run(lambda: ce_all_to_all(dst, src, s.x, s.a, self.group), send, out)

    def _run(self, steps: Any, *used: torch.Tensor) -> EventWork | Done:
        """Run ``steps``: on CPU now (gloo, synchronous), a done handle; on CUDA on the side stream after
        the caller's stream, a handle on the event after them, holding ``used`` (the caller's tensors the
        steps read or write) until its ``wait``. The collectives in ``steps`` are synchronous, so the
        side stream waits for NCCL's stream after each; one side stream per group keeps a size's two
        buffers used by one collective at a time."""
        if not self.cuda:
            steps()
            return Done()
        cur, side = torch.cuda.current_stream(self.device), self.stream
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            steps()
            ev = torch.cuda.Event()
            ev.record(side)
        return EventWork(ev, used)
