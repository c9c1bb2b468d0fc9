"""The bytes a model chunk holds for a micro-batch, counted from the tensors themselves (issue #51).

:class:`StorageLedger` (a ``TorchDispatchMode``) notes every storage an aten op creates during a
step, with the (chunk, micro-batch, phase, unit) of the task that was running; :func:`watch` sets
that tag around each of the chunks' calls and, at three program points of each (chunk, micro-batch),
sums the bytes of its storages still alive: after its forward (``"F"``), after an activation
backward that leaves W to a later op (``"B"``), and after its last weight gradient (``"W"``).
Whatever keeps a storage alive -- a saved-tensor box, an autograd node, a weight-gradient stash,
the chunk's hand-off state, the executor's transfers -- it is counted once (by storage), so the
count does not rest on braid's own bookkeeping (:meth:`braid.models.chunk.ModelChunk.live_bytes`
counts the boxes and stashes) nor on any caching allocator: a storage counts from the op that
made it until its last reference goes.

The same chunk and data under two schedules should hold the same bytes per micro-batch at each
point; a tensor kept twice, or a boundary tensor kept alive by a pending handle, shows as a
difference (:func:`excess`; ``tests/test_held_bytes.py`` holds braided_v to zb_v's). A storage
counts for the (chunk, micro-batch) whose task made it: a chunk's output handed to the next
chunk of the same rank stays its maker's, a received one becomes its receiver's; what the executor
makes outside the chunks' calls counts only once handed to a chunk (a receive buffer). The executor's
TP reductions are waited until gloo has let go of them (:class:`SettledComm`); the gathers a chunk
starts itself under sequence sharding are not, so there a point can count a gathered buffer a
few milliseconds too long on a busy host. :func:`unit_saved_bytes` is the other view, the one
the cost model's activation terms take: what each forward unit adds to the chunk's saved-tensor boxes.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from braid.core.braiding import Phase, Unit, UnitTask
from braid.core.ir import Braided, Compute, OpKind, Program, compute_ops
from braid.tp.layers import DeferredWeightGrad


def _storage(t: Any) -> torch.UntypedStorage | None:
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # no storage (sparse, a nested wrapper)
        return None


@dataclass(frozen=True, slots=True)
class Tag:
    """Whose task created a storage: chunk, micro-batch, phase (F, B, W) and unit (None: the op's end)."""

    chunk: int
    mb: int
    phase: str
    unit: str | None = None


class StorageLedger(TorchDispatchMode):
    """Every storage created by an aten op while active, with the :class:`Tag` current at the time
    (None: outside a watched call -- a received buffer, a parameter update).

    A storage is noted by the first op that returns it (views and in-place results share it), and
    counted while it is alive (a weak reference: the ledger keeps nothing alive).
    """

    def __init__(self) -> None:
        super().__init__()
        self.tag: Tag | None = None
        self._notes: dict[int, tuple[StorageWeakRef, int, Tag | None]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # An output that shares an input's storage (a view, an in-place or out= result, a collective's
        # buffer) is no new storage: a parameter seen first through its .t() is not the task's.
        given = {s._cdata for s in map(_storage, pytree.tree_leaves((args, kwargs))) if s is not None}
        for st in map(_storage, pytree.tree_leaves(out)):
            if st is not None and st._cdata not in given:
                self._note(st)
        return out

    def _note(self, st: torch.UntypedStorage) -> None:
        key = st._cdata
        old = self._notes.get(key)
        if old is None or old[0].expired():  # a storage pointer reused after a free is a new storage
            self._notes[key] = (StorageWeakRef(st), st.nbytes(), self.tag)

    @contextlib.contextmanager
    def tagged(self, tag: Tag | None) -> Iterator[None]:
        prev, self.tag = self.tag, tag
        try:
            yield
        finally:
            self.tag = prev

    def adopt(self, t: torch.Tensor, tag: Tag) -> None:
        """Give ``t``'s storage ``tag`` if it was made outside any watched call (a received buffer)."""
        st = _storage(t)
        got = None if st is None else self._notes.get(st._cdata)
        if got is not None and got[2] is None and not got[0].expired():
            self._notes[st._cdata] = (got[0], got[1], tag)

    def held(self, keep: Callable[[Tag], bool]) -> int:
        """Bytes of the live storages whose tag ``keep`` accepts."""
        total = 0
        for key, (ref, n, tag) in list(self._notes.items()):
            if ref.expired():
                del self._notes[key]
            elif tag is not None and keep(tag):
                total += n
        return total

    def held_by_unit(self, keep: Callable[[Tag], bool]) -> dict[tuple[str, str | None], int]:
        """:meth:`held`, split by (phase, unit) of the creating task."""
        out: dict[tuple[str, str | None], int] = {}
        for ref, n, tag in self._notes.values():
            if tag is not None and not ref.expired() and keep(tag):
                out[(tag.phase, tag.unit)] = out.get((tag.phase, tag.unit), 0) + n
        return out


@dataclass(slots=True)
class HeldRecord:
    """What :func:`watch` measured: ``held[(chunk, mb, point)]`` bytes (points ``"F"``, ``"B"``, ``"W"``,
    see the module doc), and ``by_unit`` the same split by the creating task's (phase, unit)."""

    held: dict[tuple[int, int, str], int] = field(default_factory=dict)
    by_unit: dict[tuple[int, int, str], dict[tuple[str, str | None], int]] = field(default_factory=dict)

    def per_point(self, chunk: int, point: str) -> dict[int, int]:
        """Micro-batch -> bytes of ``chunk`` at ``point``."""
        return {mb: n for (c, mb, p), n in self.held.items() if c == chunk and p == point}


_WRAPPED = ("run", "follow", "lead", "run_op", "end_forward", "end_backward", "set_input", "set_output_grad")


def _split_ops(program: Program) -> set[tuple[int, int]]:
    """(chunk, mb) of the program's B ops: their W comes in a later op."""
    return {(op.chunk, op.mb) for ins in program.instructions if isinstance(ins, (Compute, Braided))
            for op in compute_ops(ins) if op.kind is OpKind.B}


@contextlib.contextmanager
def watch(chunks: dict[int, Any], program: Program, ledger: StorageLedger) -> Iterator[HeldRecord]:
    """Tag the storages each chunk call creates and record the held bytes at each program point.

    Wraps the chunks' calls (:data:`_WRAPPED`, as instance attributes, removed on exit; the executor binds
    ``run`` at its first step, so enter this before it). A tensor handed to a chunk from outside any
    chunk call (a received activation or gradient) becomes that chunk's and micro-batch's.
    """
    rec = HeldRecord()
    split = _split_ops(program)
    waiting_w: set[tuple[int, int]] = set()  # after a B op, before its W op's last task

    def snap(c: int, mb: int, point: str) -> None:
        mine = lambda t: t.chunk == c and t.mb == mb  # noqa: E731
        rec.held[(c, mb, point)] = ledger.held(mine)
        rec.by_unit[(c, mb, point)] = ledger.held_by_unit(mine)

    def stashed(ch: Any, mb: int) -> bool:
        return any(m.has_stash(mb) for m in ch.modules() if isinstance(m, DeferredWeightGrad))

    def wrap(c: int, ch: Any) -> None:
        orig = {name: getattr(ch, name, None) for name in _WRAPPED}

        def run(mb: int, task: UnitTask) -> Any:
            with ledger.tagged(Tag(c, mb, task.phase.value, f"{task.unit.value}:{task.layer}")):
                out = orig["run"](mb, task)
            if task.phase is Phase.W and (c, mb) in waiting_w and not stashed(ch, mb):
                waiting_w.discard((c, mb))
                snap(c, mb, "W")
            return out

        def ahead(name: str) -> Callable:  # sequence sharding: a unit's head run before its task (follow, lead)
            def call(mb: int, task: UnitTask) -> Any:
                with ledger.tagged(Tag(c, mb, task.phase.value, f"{task.unit.value}:{task.layer}")):
                    return orig[name](mb, task)
            return call

        def run_op(mb: int, kind: OpKind) -> Any:
            with ledger.tagged(Tag(c, mb, "B" if kind is OpKind.BW else kind.value)):
                out = orig["run_op"](mb, kind)
            if kind is OpKind.W:
                waiting_w.discard((c, mb))
                snap(c, mb, "W")
            return out

        def end_forward(mb: int) -> None:
            with ledger.tagged(Tag(c, mb, "F")):
                orig["end_forward"](mb)
            snap(c, mb, "F")

        def end_backward(mb: int) -> None:
            with ledger.tagged(Tag(c, mb, "B")):
                orig["end_backward"](mb)
            if (c, mb) in split:  # its W op comes later: the "W" point is after its last task
                waiting_w.add((c, mb))
                snap(c, mb, "B")
            else:
                snap(c, mb, "W")

        def set_input(mb: int, x: torch.Tensor) -> None:  # a received input is this chunk's from here on
            ledger.adopt(x, Tag(c, mb, "F", "received"))
            orig["set_input"](mb, x)

        def set_output_grad(mb: int, g: torch.Tensor) -> None:
            ledger.adopt(g, Tag(c, mb, "B", "received"))
            orig["set_output_grad"](mb, g)

        for name, fn in (("run", run), ("follow", ahead("follow")), ("lead", ahead("lead")), ("run_op", run_op),
                         ("end_forward", end_forward), ("end_backward", end_backward), ("set_input", set_input),
                         ("set_output_grad", set_output_grad)):
            if orig[name] is not None:
                setattr(ch, name, fn)

    for c, ch in chunks.items():
        wrap(c, ch)
    try:
        yield rec
    finally:
        for ch in chunks.values():
            for name in _WRAPPED:
                ch.__dict__.pop(name, None)


class SettledComm:
    """The executor's TP reductions (a :class:`braid.tp.comm.TPComm`), each of whose waits also waits
    until the collective's work is gone, so that what it held is not counted at the next program point.

    gloo runs a collective on a worker thread, which drops its hold on the work only when it next
    gets the CPU: on a busy host the work -- and the tensor it reduced, which the chunk has already
    let go -- outlived the wait by milliseconds, and a point taken then counted that tensor for its
    micro-batch (a 4 KiB output gradient at random points of the tiny preset at tp=2). After the
    wait the handle is dropped and the reference counts of the reduced tensors and their storages
    are polled until one falls (the work held each tensor or a view of it; nothing else runs meanwhile).
    Only a c10d work is polled: the copy-engine backends' handles (:class:`braid.tp.ce_reduce.EventWork`,
    ``nccl-ce``, sequence parallelism's default) keep Python references, which these counts do not see and
    their wait drops; polled, they timed out.
    """

    def __init__(self, inner: Any, timeout_s: float = 10.0) -> None:
        self.inner, self.timeout_s = inner, timeout_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def reduce(self, t: Any) -> "_Settled":
        tensors = [x for x in (t if isinstance(t, tuple) else (t,)) if isinstance(x, torch.Tensor)]  # a Scatter: (src, out)
        return _Settled(self.inner.reduce(t), tensors, self.timeout_s)


class _Settled:
    """A work handle whose :meth:`wait` returns once the work itself is gone (see :class:`SettledComm`)."""

    def __init__(self, work: Any, tensors: list[torch.Tensor], timeout_s: float) -> None:
        self.work, self.tensors, self.timeout_s = work, tensors, timeout_s

    def _counts(self) -> list[int]:
        return [n for x in self.tensors for n in (x._use_count(), torch._C._storage_Use_Count(x.untyped_storage()._cdata))]

    def wait(self, timeout: Any = None) -> bool:
        if self.work is None:
            return True
        ok = self.work.wait() if timeout is None else self.work.wait(timeout)
        if not isinstance(self.work, dist.Work):  # a Python handle (EventWork, Done): its wait let go what it kept
            self.work, self.tensors = None, []
            return ok
        held = self._counts()
        self.work = None
        deadline = time.monotonic() + self.timeout_s
        while all(a >= b for a, b in zip(self._counts(), held)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"a TP reduction's work outlived its wait by {self.timeout_s} s")
            time.sleep(1e-4)
        self.tensors = []
        return ok


def held_per_microbatch(executor: Any, tokens: Sequence[Any], labels: Sequence[torch.Tensor], warmup: int = 1
                        ) -> HeldRecord:
    """The bytes each (chunk, micro-batch) of ``executor``'s rank holds at each point (:func:`watch`) of one
    step, after ``warmup`` steps (a first step makes what later steps reuse: RoPE tables, ``.grad``).

    ``executor`` must not have run yet: its unit steps bind the chunks' calls at its first step. Its TP
    reductions are settled (:class:`SettledComm`) for the measured step. Gradients accumulate as in any step.
    """
    chunks, program = executor.chunks, executor.program
    ledger = StorageLedger()
    comm = executor.tp_comm
    with watch(chunks, program, ledger) as rec:
        for _ in range(warmup):
            executor.run(tokens, labels)
        executor.tp_comm = SettledComm(comm)
        try:
            rec.held.clear()
            rec.by_unit.clear()
            with ledger:
                executor.run(tokens, labels)
        finally:
            executor.tp_comm = comm
    forwards = {(op.chunk, op.mb) for ins in program.instructions if isinstance(ins, (Compute, Braided))
                for op in compute_ops(ins) if op.kind is OpKind.F}
    missing = sorted(forwards - {(c, mb) for c, mb, p in rec.held if p == "F"})
    if missing:
        raise ValueError(f"no held bytes recorded after the forward of (chunk, micro-batch) {missing[:4]}: "
                         "the executor had run before (its steps were bound to the chunks' unwatched calls)")
    return rec


def excess(over: HeldRecord, base: HeldRecord, points: Sequence[str] = ("F", "B")) -> dict[tuple[int, int, str], tuple[int, int]]:
    """The (chunk, micro-batch, point)s at which ``over`` holds more bytes than ``base`` (both measured):
    ``(over's, base's)`` bytes; points that only one of them has (a ``B`` where the other ran a ``BW``) are not compared."""
    return {k: (n, base.held[k]) for k, n in over.held.items() if k[2] in points and k in base.held and n > base.held[k]}


def unit_saved_bytes(chunk: Any, mb: int, tasks: Sequence[UnitTask], reduce: Callable[[Any], None] | None = None
                     ) -> dict[tuple[Unit, int], int]:
    """What each forward unit task of ``mb`` adds to ``chunk``'s saved-tensor boxes (each storage once,
    :meth:`~braid.models.chunk.ModelChunk.live_bytes`): the count the cost model's per-unit ``act`` is.
    ``reduce(out)``: completes a unit's TP reduction (tp > 1). The chunk must hold no other micro-batch's boxes."""
    out = {}
    for task in tasks:
        before = chunk.live_bytes()
        got = chunk.run(mb, task)
        if got is not None and reduce is not None:
            reduce(got)
        out[(task.unit, task.layer)] = chunk.live_bytes() - before
    return out
