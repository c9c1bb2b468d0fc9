"""Asynchronous activation offload: saved tensors to pinned host memory and back (paper Sec. 4.4).

The enhanced braided schedule moves a fraction ``alpha`` of each chunk-0 micro-batch's
saved activations to host memory right after its forward and brings them back shortly
before its backward (``OFFLOAD``/``RELOAD`` instructions, inserted by :mod:`braid.core.offload`).
This module does the moving. It works on *slots* -- mutable lists of saved tensors, the
boxes a :class:`braid.models.chunk.ModelChunk` fills from ``saved_tensors_hooks`` -- so it
knows nothing about the model.

What moves (``offload(key, slots, keep, frac)``):

* the unit is a device *storage*: every saved tensor that views it is parked together
  and rebuilt as the same view on reload (so two saves of one tensor never become two
  copies, and a view keeps its strides);
* storages in ``keep`` (held elsewhere -- autograd leaves, outputs, parameters) are never
  moved: copying them would free nothing and double them on reload;
* the target is ``frac`` of the key's saved bytes (all distinct storages, kept ones
  included, as the simulator counts them); storages are picked largest first, each taken
  when it brings the moved total nearer the target (deterministic: ties by first save).

How (CUDA): the device-to-host copies run on a dedicated D2H stream that first waits for
an event recorded on the compute stream after the forward that produced the tensors; the
device tensors stay referenced until the copy has read them, so the allocator never hands
their memory to anything else before. They are released (:meth:`ActivationOffloader.advance`,
called before every compute instruction) as soon as the copy's event has fired, and at the
latest once ``RELEASE_AFTER`` compute instructions have run after the offload: there the
compute stream waits for the copy and the memory returns to its pool. That bound matters
because the host runs ahead of the GPU, so an event query alone would keep the memory
until the host next waits; the simulator models the same rule (memory freed at the start
of that instruction, which waits for the copy if it is late). A reload allocates the device storage on the compute stream (memory
re-taken when the reload is issued), copies on a host-to-device stream that waits for that
allocation and for the offload's completion, and records an event that the consuming
backward waits for with ``stream.wait_event`` (:meth:`ActivationOffloader.wait`). Host
buffers come from a :class:`HostPool` of pinned buffers reused across steps. On CPU the
very same logic runs synchronously, without streams or events, so CI tests it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, MutableSequence, Sequence

import torch

from braid.core.offload import RELEASE_AFTER

log = logging.getLogger(__name__)

Mark = Callable[[], Any]


class OffloadStateError(RuntimeError):
    """An offload/reload/wait that breaks the order OFFLOAD -> RELOAD -> backward."""


@dataclass(slots=True)
class HostBuffer:
    """One host (pinned on CUDA) byte buffer; ``ready`` is the event after which it may be overwritten."""

    data: torch.Tensor
    ready: Any = None


class HostPool:
    """Host byte buffers kept per exact size and reused: after the first step of a fixed
    program every request finds a free buffer of its size, so nothing is allocated again."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: dict[int, list[HostBuffer]] = {}
        self.allocations = 0
        self.allocated_bytes = 0
        self.in_use = 0

    def acquire(self, nbytes: int) -> HostBuffer:
        free = self._free.get(nbytes)
        self.in_use += 1
        if free:
            return free.pop()
        self.allocations += 1
        self.allocated_bytes += nbytes
        return HostBuffer(torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin))

    def forget_events(self) -> None:
        """Drop the free buffers' ``ready`` events (between steps, once the device has synchronised):
        a CUDA graph capture must not wait on an event recorded outside it, nor an eager step on one inside."""
        for bufs in self._free.values():
            for b in bufs:
                b.ready = None

    def release(self, buf: HostBuffer, ready: Any = None) -> None:
        buf.ready = ready
        self.in_use -= 1
        self._free.setdefault(buf.data.numel(), []).append(buf)


@dataclass(slots=True)
class Parked:
    """Stands in a slot for a saved tensor whose storage is on the host: how to rebuild the view."""

    group: "_Group"
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(slots=True)
class _Group:
    """One device storage moved to the host, and the slots that view it."""

    nbytes: int
    device: torch.device
    host: HostBuffer
    where: list[tuple[MutableSequence[Any], int]] = field(default_factory=list)


@dataclass(slots=True)
class _Moved:
    groups: list[_Group]
    d2h_done: Any = None  # CUDA event after the D2H copies (None on CPU)
    h2d_done: Any = None  # CUDA event after the H2D copies
    reloaded: bool = False


@dataclass(frozen=True, slots=True)
class CopyRecord:
    """What one offload or reload did: bytes copied and clock marks around the copies."""

    nbytes: int
    start: Any = None
    end: Any = None


def _as_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class ActivationOffloader:
    """Moves saved activations of ``key`` (e.g. (chunk, micro-batch)) between device and host.

    One per executor (rank); its :class:`HostPool` lives as long as it does, so buffers
    are reused across steps. ``device`` is where the activations live: a CUDA device gets
    the two copy streams, anything else runs the copies synchronously.
    """

    def __init__(self, device: torch.device | str, pool: HostPool | None = None) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.pool = pool if pool is not None else HostPool(pin=self.cuda)
        self._moved: dict[Hashable, _Moved] = {}
        self._d2h_pending: list[list[Any]] = []  # [completion event, device tensors, instructions left]
        self._copied = False  # a copy stream was used since the last finish()
        # A CUDA graph captures the step (braid.runtime.graphs): no event query, no stream sync.
        self.capturing = False
        if self.cuda:
            self.d2h = torch.cuda.Stream(self.device)
            self.h2d = torch.cuda.Stream(self.device)

    # -- offload -------------------------------------------------------------------------
    def _select(self, slots: Sequence[MutableSequence[Any]], keep: set[int], frac: float) -> list[tuple[torch.UntypedStorage, list]]:
        """Candidate storages of the slots (largest first, nearest to ``frac`` of all saved bytes)."""
        seen: dict[int, tuple[torch.UntypedStorage, list]] = {}
        total = 0
        for slot in slots:
            for i, t in enumerate(slot):
                if not isinstance(t, torch.Tensor) or (self.cuda and t.device.type != "cuda"):
                    continue
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr not in seen:
                    seen[ptr] = (st, [])
                    total += st.nbytes()
                seen[ptr][1].append((slot, i))
        cands = [(st, where) for ptr, (st, where) in seen.items() if ptr not in keep and st.nbytes() > 0]
        cands.sort(key=lambda c: -c[0].nbytes())  # stable: ties keep save order
        target = frac * total
        picked, moved = [], 0
        for st, where in cands:
            n = st.nbytes()
            if moved + n <= target or target - moved > n / 2:
                picked.append((st, where))
                moved += n
        return picked

    def offload(self, key: Hashable, slots: Sequence[MutableSequence[Any]], keep: set[int], frac: float = 1.0,
                mark: Mark | None = None) -> CopyRecord:
        """Park ``frac`` of the saved bytes in ``slots`` on the host (storages in ``keep`` stay)."""
        if not 0.0 < frac <= 1.0:
            raise ValueError(f"offload fraction must be in (0, 1], got {frac}")
        if key in self._moved:
            raise OffloadStateError(f"activations of {key} are offloaded twice (no reload in between)")
        self.poll()
        picked = self._select(slots, keep, frac)
        groups = [_Group(st.nbytes(), st.device, self.pool.acquire(st.nbytes())) for st, _ in picked]
        moved = _Moved(groups)
        start = end = None
        if self.cuda:
            self._copied = True
            produced = torch.cuda.Event()
            produced.record()  # on the compute stream, after the forward that saved the tensors
            with torch.cuda.stream(self.d2h):
                self.d2h.wait_event(produced)
                start = mark() if mark else None
                flats = []
                for g, (st, _) in zip(groups, picked):
                    if g.host.ready is not None:
                        self.d2h.wait_event(g.host.ready)  # the buffer's last reload has read it
                    flat = _as_bytes(st, g.device)
                    g.host.data.copy_(flat, non_blocking=True)
                    flats.append(flat)
                moved.d2h_done = torch.cuda.Event()
                moved.d2h_done.record()
                end = mark() if mark else None
            self._d2h_pending.append([moved.d2h_done, flats, RELEASE_AFTER])  # device memory lives until the copy is done
        else:
            start = mark() if mark else None
            for g, (st, _) in zip(groups, picked):
                g.host.data.copy_(_as_bytes(st, g.device))
            end = mark() if mark else None
        for g, (_, where) in zip(groups, picked):
            for slot, i in where:
                t = slot[i]
                slot[i] = Parked(g, t.dtype, t.storage_offset(), tuple(t.size()), tuple(t.stride()))
                g.where.append((slot, i))
        self._moved[key] = moved
        return CopyRecord(sum(g.nbytes for g in groups), start, end)

    # -- reload --------------------------------------------------------------------------
    def reload(self, key: Hashable, mark: Mark | None = None) -> CopyRecord:
        """Bring the parked storages of ``key`` back to the device (asynchronously on CUDA)."""
        moved = self._moved.get(key)
        if moved is None or moved.reloaded:
            raise OffloadStateError(f"reload of {key}: "
                                    + ("already reloaded" if moved is not None else "nothing was offloaded"))
        self.poll()
        # Allocated on the compute stream: the memory is re-taken now, and its previous users
        # (queued compute) are done before the H2D stream writes it (it waits for `allocated`).
        devs = [torch.empty(g.nbytes, dtype=torch.uint8, device=g.device) for g in moved.groups]
        start = end = None
        if self.cuda:
            self._copied = True
            allocated = torch.cuda.Event()
            allocated.record()
            with torch.cuda.stream(self.h2d):
                self.h2d.wait_event(allocated)
                self.h2d.wait_event(moved.d2h_done)
                start = mark() if mark else None
                for g, dev in zip(moved.groups, devs):
                    dev.copy_(g.host.data, non_blocking=True)
                moved.h2d_done = torch.cuda.Event()
                moved.h2d_done.record()
                end = mark() if mark else None
        else:
            start = mark() if mark else None
            for g, dev in zip(moved.groups, devs):
                dev.copy_(g.host.data)
            end = mark() if mark else None
        for g, dev in zip(moved.groups, devs):
            for slot, i in g.where:
                p = slot[i]
                slot[i] = torch.empty(0, dtype=p.dtype, device=g.device).set_(dev.untyped_storage(), p.offset, p.size, p.stride)
            self.pool.release(g.host, moved.h2d_done)
        moved.reloaded = True
        return CopyRecord(sum(g.nbytes for g in moved.groups), start, end)

    # -- ordering ------------------------------------------------------------------------
    def is_offloaded(self, key: Hashable) -> bool:
        """Whether ``key`` has activations on the host that no reload has been issued for."""
        m = self._moved.get(key)
        return m is not None and not m.reloaded

    def wait(self, key: Hashable) -> None:
        """Make the compute stream wait for ``key``'s reload (before the B/W/BW that uses it)."""
        m = self._moved.get(key)
        if m is None:
            return
        if not m.reloaded:
            raise OffloadStateError(f"activations of {key} are on the host: no reload was issued before their use")
        if m.h2d_done is not None:
            torch.cuda.current_stream(self.device).wait_event(m.h2d_done)
        del self._moved[key]

    def pending_bytes(self) -> int:
        """Device bytes of offloaded storages not yet released (their D2H copy is in flight)."""
        return sum(f.nbytes for item in self._d2h_pending for f in item[1])

    def poll(self) -> None:
        """Drop the device storages whose D2H copy has completed (their memory is freed now)."""
        if self._d2h_pending and not self.capturing:
            self._d2h_pending = [x for x in self._d2h_pending if not x[0].query()]

    def advance(self) -> None:
        """Before a compute instruction: release what :meth:`poll` releases, and the storages
        of offloads ``RELEASE_AFTER`` compute instructions old, after making the compute
        stream wait for their copy (so the freed memory is safe for the kernels that follow)."""
        if not self._d2h_pending:
            return
        keep = []
        stream = None
        for item in self._d2h_pending:
            ev = item[0]
            if not self.capturing and ev.query():  # captured: released by instruction count alone
                continue
            item[2] -= 1
            if item[2] < 0:
                stream = stream or torch.cuda.current_stream(self.device)
                stream.wait_event(ev)
                continue
            keep.append(item)
        self._d2h_pending = keep

    def finish(self) -> list[Hashable]:
        """End of a step: wait for the copy streams, free what they held; returns keys still on the host.

        A step that copied nothing waits for nothing: the host stays ahead of the device. Under
        capture nothing is waited for here: the capturer joins the copy streams."""
        if self.cuda and self._copied and not self.capturing:
            self.d2h.synchronize()
            self.h2d.synchronize()
        self._copied = False
        self._d2h_pending.clear()
        left = [k for k, m in self._moved.items() if not m.reloaded]
        for k in [k for k, m in self._moved.items() if m.reloaded]:
            del self._moved[k]
        return left
