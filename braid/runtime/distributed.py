"""Process-group setup, with timeouts and failure reports between ranks.

:class:`ProcessGroups` owns the pp, tp, dp, cp and dp x cp groups of a
:class:`braid.core.topology.Topology` (no module-level state: the object travels to whoever
needs a group). The backend follows the device: gloo on CPU, NCCL on CUDA.

Failure reports. A rank that raises records its exception in the job's store
(:meth:`Abort.fail`). The record is claimed with one ``compare_set`` on an absent key, so
the *first* failing rank wins it and ranks that fail afterwards (often because of the
first) never overwrite it. Every wait of the executor on a communication handle checks
the record before blocking (at most every ``check_every_s``) and waits at most
``timeout_s`` (:meth:`Abort.wait`), so the
other ranks raise :class:`PeerFailure` naming the first failing rank and its exception
text instead of hanging in a receive or an all-reduce whose peer is gone. A wait that
fails with no record is told apart by what happened: a peer that closed its connection
(its process exited or was killed; gloo notices at once) raises :class:`PeerLost`, a wait
that ran out of time raises :class:`CommTimeout`. A lost peer is named: every rank holds a
listening socket for as long as its process lives (:mod:`braid.runtime.liveness`), the rank
that sees the close asks every peer's, and the ranks whose socket is closed are recorded as
lost on their behalf, so that every survivor names the same rank. Collectives outside the
executor go through the same machinery: tensor all-reduces through :meth:`Abort.all_reduce`
(a bounded :meth:`Abort.wait`), object collectives and barriers inside
:meth:`Abort.collective` (the record read first, a raw closed connection or expired wait
translated, :meth:`Abort.translate`). On CUDA, waits are stream-ordered and the NCCL
watchdog (same timeout) is the backstop.

Stores and the start of a job (every rank there, or the missing one named): :mod:`braid.runtime.store`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from braid.models.tied import reduce_tied_gradients
from braid.models.tp_partial import reduce_partial_gradients
from braid.runtime.errors import CommTimeout, PeerFailure, PeerLost, describe_exception, first_line, lost_text
from braid.runtime.store import Joined, arrive, create_store, join, store_gone

__all__ = ["Abort", "CommTimeout", "Dist", "PeerFailure", "PeerLost", "ProcessGroups", "backend_for", "create_store",
           "describe_exception", "exit_with_parent", "reduce_gradients"]
from braid.core.topology import RankCoords, Topology

if TYPE_CHECKING:
    from braid.tp.comm import TPComm

log = logging.getLogger(__name__)

ABORT_WAIT_S = 30.0  # how long a failed CUDA rank waits for NCCL's abort of its groups (Dist.close)

ABORT_KEY = "braid/abort"
TIMED_OUT_PREFIX = "braid/timed_out/"  # + rank: that rank's wait ran out (Abort.silent_ranks)
_MAX_REASON = 2000
LOST_SETTLE_S = 1.0  # after a closed connection, how long every peer may still answer before none is named lost


def backend_for(device: torch.device) -> str:
    """gloo on CPU, NCCL on CUDA."""
    return "nccl" if device.type == "cuda" else "gloo"


_CLOSED_WORDS = ("closed by peer", "connection reset", "connection closed", "broken pipe", "connection refused",
                 "got 0 bytes", "remote server shutdown", "socket closed", "connection was likely closed")
_TIMEOUT_WORDS = ("timed out", "timeout")


def _mentions_closed(err: BaseException) -> bool:
    text = str(err).lower()
    return any(w in text for w in _CLOSED_WORDS)


def _mentions_timeout(err: BaseException) -> bool:
    text = str(err).lower()
    return any(w in text for w in _TIMEOUT_WORDS)


@dataclass(slots=True)
class Abort:
    """A job-wide failure record in the store, consulted around every communication wait."""

    store: dist.Store
    rank: int
    timeout_s: float = 120.0
    cuda: bool = False  # stream-ordered waits (NCCL): the watchdog bounds them
    # The record is read before a blocking wait at most this often: each read is a round trip
    # to the store (~0.2 ms on one host), and a pipeline step waits dozens of times.
    check_every_s: float = 0.05
    world_size: int | None = None  # known: a timeout names the ranks that stayed silent, a lost peer is named
    grace_s: float = 3.0  # how long a peer's liveness socket has to accept (braid.runtime.liveness)
    _checked_at: float = field(default=float("-inf"), init=False, repr=False)
    # the store's first failure: once its host is gone no store op is tried again (each would log a C++ stack)
    _gone: BaseException | None = field(default=None, init=False, repr=False)

    def signal(self, reason: str, lost: list[int] | None = None) -> bool:
        """Record that this rank failed with ``reason`` (or, with ``lost``, that those ranks were
        lost: recorded on their behalf), unless another rank already recorded a failure.

        Returns True when this record is the one kept (it came first). Never raises: the
        store itself may be gone.
        """
        entry = {"rank": lost[0] if lost else self.rank, "reason": reason[:_MAX_REASON], **({"lost": lost} if lost else {})}
        record = json.dumps(entry)
        if self._gone is not None:
            return False
        try:
            # compare_set on an absent key with expected "" sets it; on a present key it
            # leaves the value and returns it: an atomic "first writer wins".
            kept = self.store.compare_set(ABORT_KEY, "", record)
        except Exception:  # noqa: BLE001 - the store may be gone with the rank that hosted it
            log.debug("rank %d could not record its failure", self.rank, exc_info=True)
            return False
        return kept.decode(errors="replace") == record

    def fail(self, err: BaseException) -> bool:
        """Record ``err`` as this rank's failure (first writer wins); a :class:`PeerFailure`
        is a report of another rank's failure and is recorded only when it is a
        :class:`PeerLost` (a peer that vanished without a record). Returns :meth:`signal`'s answer."""
        if isinstance(err, PeerFailure) and not isinstance(err, PeerLost):
            return False
        if not isinstance(err, (PeerLost, CommTimeout)) and _mentions_closed(err):
            # a collective outside :meth:`wait` (a barrier, an all_gather_object) met a dead peer
            err = self._lost(err, None)
        elif not isinstance(err, PeerLost) and (isinstance(err, CommTimeout) or _mentions_timeout(err)):
            # a wait that ran out while a peer is gone (a rank whose neighbours are alive but
            # stopped waiting for the dead one): the lost peer is the cause, not this timeout
            lost = self._lost(err, None)
            if lost.lost:
                err = lost
        return self.signal(describe_exception(err), err.lost if isinstance(err, PeerLost) else None)

    @contextlib.contextmanager
    def on_failure(self) -> Iterator[None]:
        """Record any exception raised inside the block (:meth:`fail`) and re-raise it."""
        try:
            yield
        except BaseException as err:
            self.fail(err)
            raise

    def clear(self) -> None:
        """Forget an earlier failure (tests that reuse a job after a failure case)."""
        from braid.runtime.liveness import left_key

        self.store.delete_key(ABORT_KEY)
        self.store.delete_key(left_key(self.rank))

    def _leave(self) -> None:
        """This rank stops because of another: say so before its liveness socket closes, so that survivors
        asking later do not name it lost (:func:`braid.runtime.liveness.lost_ranks`). Not once the store is gone."""
        if self.world_size and self._gone is None:
            from braid.runtime.liveness import mark_left

            mark_left(self.store, self.rank)

    def _record(self) -> dict | None:
        """The failure record (``rank``, ``reason`` and, for lost ranks, ``lost``), or None if none.

        Raises :class:`PeerLost` when the store cannot be reached (its host has exited).
        """
        if self._gone is not None:
            raise store_gone(self.rank, self._gone)
        try:
            if not self.store.check([ABORT_KEY]):
                return None
            raw = self.store.get(ABORT_KEY).decode(errors="replace")
        except Exception as err:  # noqa: BLE001 - DistNetworkError, DistStoreError, RuntimeError by version
            self._gone = err
            raise store_gone(self.rank, err) from err
        try:
            rec = json.loads(raw)
            lost = [int(r) for r in rec.get("lost") or []]
            return {"rank": int(rec["rank"]), "reason": str(rec["reason"]), "lost": lost}
        except (ValueError, KeyError, TypeError, AttributeError):
            return {"rank": -1, "reason": raw, "lost": []}

    def first_failure(self) -> tuple[int, str] | None:
        """``(rank, exception text)`` of the rank that failed first, or None if none has.

        Raises :class:`PeerLost` when the store cannot be reached (its host has exited).
        """
        rec = self._record()
        return None if rec is None else (rec["rank"], rec["reason"])

    def check(self) -> None:
        """Raise :class:`PeerFailure` naming the first failing rank if any rank has recorded one
        (:class:`PeerLost` when the record is of lost ranks)."""
        rec = self._record()
        if rec is None:
            return
        r, reason, lost = rec["rank"], rec["reason"], rec["lost"]
        if r != self.rank:
            self._leave()
        if lost:
            raise PeerLost(lost_text(self.rank, lost),
                           r, reason, lost)
        raise PeerFailure(f"rank {self.rank} stops: rank {r} failed first: {reason}", r, reason)

    def wait(self, work: dist.Work | None) -> None:
        """Wait for an async work handle at most ``timeout_s``.

        A recorded failure of another rank becomes :class:`PeerFailure`; otherwise a closed
        connection becomes :class:`PeerLost` and an expired wait :class:`CommTimeout`. gloo
        send/recv handles cannot be polled (``is_completed`` stays false until ``wait``),
        so the record is checked before blocking (unless it was read less than
        ``check_every_s`` ago), and again when the wait fails. A peer that exits or closes
        its groups after recording fails the wait at once; one that recorded within that
        window and stays connected is reported after ``timeout_s``.
        """
        if work is None:
            return
        if self.cuda:
            work.wait()
            return
        t0 = time.monotonic()
        if t0 - self._checked_at >= self.check_every_s:
            self.check()
            self._checked_at = t0
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            elapsed = time.monotonic() - t0
            self.check()
            raise self.classify(err, elapsed) from err

    def all_reduce(self, tensor: "torch.Tensor", op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   group: dist.ProcessGroup | None = None) -> None:
        """``dist.all_reduce`` in place, through :meth:`wait`: bounded by ``timeout_s``, the record
        read first, a lost peer or an expired wait reported as such (not gloo's raw error)."""
        self.wait(dist.all_reduce(tensor, op=op, group=group, async_op=True))

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Around blocking collectives that have no work handle to :meth:`wait` on (object
        collectives, barriers; or a whole phase that calls them): the record is read first,
        and a communication failure inside leaves as :meth:`wait`'s would
        (:class:`PeerFailure`, :class:`PeerLost` naming the lost rank, :class:`CommTimeout`).
        Other exceptions pass unchanged."""
        if not self.cuda:
            self.check()
        t0 = time.monotonic()
        try:
            yield
        except RuntimeError as err:
            new = self.translate(err, time.monotonic() - t0)
            if new is err:
                raise
            raise new from err

    def translate(self, err: BaseException, elapsed_s: float = 0.0) -> BaseException:
        """``err`` as :meth:`wait` would report it when it is a raw communication failure (a
        closed connection, an expired wait): a recorded failure of another rank first, else
        :meth:`classify`'s answer. Anything else (a bug, a :class:`PeerFailure`) is returned as it is."""
        if not (type(err) is RuntimeError or isinstance(err, dist.DistError)):  # gloo raises the plain type
            return err
        if not (_mentions_closed(err) or _mentions_timeout(err)):
            return err
        try:
            self.check()
        except PeerFailure as recorded:
            return recorded
        return self.classify(err, elapsed_s)

    def classify(self, err: BaseException, elapsed_s: float) -> Exception:
        """The exception a failed communication of this rank becomes (see :meth:`wait`)."""
        line = first_line(err)
        if _mentions_closed(err):
            return self._lost(err, elapsed_s)
        if _mentions_timeout(err) or elapsed_s >= 0.95 * self.timeout_s:
            silent = self.silent_ranks()
            who = (f"silent: rank {', '.join(map(str, silent))} (alive, but {'it' if len(silent) == 1 else 'they'} did not "
                   "time out waiting too: look there)" if silent else "a peer is alive but did not send or join")
            return CommTimeout(f"rank {self.rank}: communication did not finish within {self.timeout_s:g} s "
                               f"({who}; raise the timeout if it is only slow): {line}", silent)
        return RuntimeError(f"rank {self.rank}: communication failed after {elapsed_s:.1f} s: {line}")

    def silent_ranks(self, grace_s: float = 5.0) -> list[int]:
        """After a timeout: the ranks that did not time out themselves within ``grace_s``.

        Every rank whose wait runs out records it in the store; a rank stuck outside
        communication (a hang in its own code, a debugger, a stopped process) records
        nothing, so it is the one the others were waiting for. Empty when the world size is
        unknown or the store is gone.
        """
        if not self.world_size or self._gone is not None:
            return []
        try:
            self.store.set(f"{TIMED_OUT_PREFIX}{self.rank}", "1")
            deadline = time.monotonic() + min(grace_s, self.timeout_s)
            while True:
                quiet = [r for r in range(self.world_size)
                         if r != self.rank and not self.store.check([f"{TIMED_OUT_PREFIX}{r}"])]
                if not quiet or time.monotonic() >= deadline:
                    return quiet
                time.sleep(0.1)
        except Exception:  # noqa: BLE001 - the store may be gone with the rank that hosted it
            return []

    def _lost(self, err: BaseException, elapsed_s: float | None) -> PeerLost:
        """A closed connection: the peers' liveness sockets name the lost ranks (:mod:`braid.runtime.liveness`)."""
        from braid.runtime.liveness import lost_ranks

        after = f" after {elapsed_s:.1f} s" if elapsed_s is not None else ""
        within = min(self.grace_s, self.timeout_s)
        lost = lost_ranks(self.store, self.rank, self.world_size, within) if self.world_size and self._gone is None else None
        settle = time.monotonic() + LOST_SETTLE_S
        while lost == [] and time.monotonic() < settle:
            # The connection closed, yet every peer still accepts: a killed process closes its
            # sockets one after another as it exits, so its liveness socket can outlast the
            # connection that told this rank by a few milliseconds. Ask again.
            time.sleep(0.02)
            lost = lost_ranks(self.store, self.rank, self.world_size, within)
        if lost:  # the same words as a survivor that reads the record (check)
            self._leave()
            return PeerLost(lost_text(self.rank, lost),
                            lost[0], "lost", lost)
        return PeerLost(f"rank {self.rank}: a peer closed its connection{after} (its process exited or was killed; "
                        f"see that rank's log): {first_line(err)}")


def exit_with_parent(parent_pid: int, every_s: float = 1.0) -> None:
    """End this process when ``parent_pid`` (the launcher that spawned it) is gone.

    A spawned rank outlives a launcher that is killed (``SIGKILL``, or ``SIGTERM`` from a
    ``timeout``, which skips the launcher's clean-up): with all ranks alive, its job would
    run to the end, holding its GPU and port. A daemon thread checks the parent every
    ``every_s`` and exits the process (code 3), even from inside a blocked collective.
    """
    import threading

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(every_s)
        os._exit(3)

    threading.Thread(target=watch, name="braid-exit-with-parent", daemon=True).start()


@dataclass(slots=True)
class Dist:
    """An initialised job: rank, world size, device, store, abort record and timeout."""

    rank: int
    world_size: int
    device: torch.device
    store: dist.Store
    abort: Abort
    timeout_s: float
    alive: socket.socket | None = None  # this rank's liveness socket (braid.runtime.liveness), open while it lives

    @staticmethod
    def init(
        rank: int,
        world_size: int,
        *,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        device: torch.device | str = "cpu",
        timeout_s: float = 120.0,
        joined: Joined | None = None,
    ) -> "Dist":
        """Join the job's store (:func:`braid.runtime.store.join`, unless ``joined`` already did), wait for every
        rank (:func:`braid.runtime.store.arrive`) and create the default process group (backend from the device).

        ``master_port``/``master_addr`` default to ``MASTER_PORT``/``MASTER_ADDR``; under
        torchrun the agent's store is joined as a client.
        """
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if joined is None:
            joined = join(rank, world_size, master_addr=master_addr, master_port=master_port)
        store = joined.store
        timeout = datetime.timedelta(seconds=timeout_s)
        if world_size > 1:
            arrive(joined, timeout_s)  # a dead or missing rank is named here, not after the process group's timeout
            store.set_timeout(timeout)
        # device_id binds the NCCL communicator to this rank's GPU and creates it now (not at the
        # first collective), so a wrong device or a missing peer shows up here, within the timeout.
        kw = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world_size, timeout=timeout, **kw)
        abort = Abort(store, rank, timeout_s, device.type == "cuda", world_size=world_size)
        return Dist(rank, world_size, device, store, abort, timeout_s, joined.alive)

    @staticmethod
    def from_env(device: torch.device | str = "cpu", timeout_s: float = 120.0, joined: Joined | None = None) -> "Dist":
        """Initialise from torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_*`` variables (or a launcher's that sets them)."""
        return Dist.init(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device=device, timeout_s=timeout_s,
                         joined=joined)

    def close(self, error: BaseException | None = None) -> None:
        """Tear down the process groups. A rank that failed mid-step (``error``: what it raised) may hold NCCL
        collectives no peer will join (the others failed elsewhere, or a replayed CUDA graph's collectives wait on
        the device): destroying those communicators waits for the collectives for ever, so such a rank aborts them
        (torch's ``_abort_process_group``, every group at once) and its exception reaches the user. NCCL's abort can
        itself wait on a kernel that never ends (seen: 300 s, then no return), so the rank's error is printed first,
        one line on stderr, and the abort is given :data:`ABORT_WAIT_S` before the rank leaves it behind."""
        if not dist.is_initialized():
            return
        if error is not None and self.device.type == "cuda":
            first = (str(error).splitlines() or [""])[0]
            print(f"rank {self.rank}: {type(error).__name__}: {first}; aborting its NCCL groups", file=sys.stderr, flush=True)
            done = threading.Event()

            def abort() -> None:
                from torch.distributed.distributed_c10d import _abort_process_group

                try:
                    _abort_process_group()
                except Exception:  # noqa: BLE001 - the rank's own failure is the one to report, not its teardown's
                    log.warning("rank %d: aborting its process groups after its failure failed", self.rank, exc_info=True)
                done.set()

            threading.Thread(target=abort, name="braid-nccl-abort", daemon=True).start()
            if not done.wait(ABORT_WAIT_S):
                print(f"rank {self.rank}: aborting its NCCL groups did not finish within {ABORT_WAIT_S:g} s; "
                      "left behind", file=sys.stderr, flush=True)
        else:
            dist.destroy_process_group()


@dataclass(slots=True)
class ProcessGroups:
    """The process groups of one rank under a topology (pp, tp, dp, cp and dp x cp).

    ``pp_ranks``: global ranks of this rank's pipeline, indexed by pipeline rank (the
    ``peer`` of Send/Recv instructions).
    """

    topo: Topology
    rank: int
    coords: RankCoords
    pp: dist.ProcessGroup
    tp: dist.ProcessGroup
    dp: dist.ProcessGroup
    cp: dist.ProcessGroup
    dp_cp: dist.ProcessGroup
    pp_ranks: list[int]
    tp_ranks: list[int]
    dp_cp_ranks: list[int]
    tp_backend: str = "gloo"  # how the TP all-reduce runs (braid.tp.comm)
    _tp_comm: "TPComm | None" = field(default=None, init=False, repr=False, compare=False)

    @property
    def tp_comm(self) -> "TPComm":
        """The TP all-reduce of this rank under :attr:`tp_backend`, made once: under ``nccl-ce`` it holds
        the group's registered staging buffers, which every user of the group shares."""
        from braid.tp.comm import TPComm

        if self._tp_comm is None:
            self._tp_comm = TPComm(self.tp_backend, self.tp if self.topo.tp > 1 else None)
        return self._tp_comm

    @staticmethod
    def create(topo: Topology, rank: int | None = None, timeout_s: float = 120.0,
               tp_max_ctas: int | None = None, tp_backend: str = "auto", seq_shard: bool = False) -> "ProcessGroups":
        """Create every group of the layout (collective: all ranks call it, same order).

        ``tp_backend``: how the TP all-reduce runs (:mod:`braid.tp.comm`; ``"auto"``:
        :func:`braid.tp.comm.resolve_tp_backend` of ``seq_shard``, the run's sequence sharding). ``tp_max_ctas`` caps the thread blocks NCCL gives the TP group's all-reduces. A
        braided block runs each all-reduce *while* the other micro-batch's GEMMs run; an
        uncapped NCCL kernel holds its SMs while it waits for the peer and slows those
        GEMMs (the measured defaults: :func:`braid.core.ctas.default_max_ctas`). Only the TP
        group is capped, so data-parallel and pipeline traffic keep full bandwidth. Ignored
        on gloo; ``None`` takes :func:`braid.core.ctas.default_max_ctas` of the TP size, ``0`` leaves NCCL's default.
        """
        if not dist.is_initialized():
            raise RuntimeError("ProcessGroups.create needs an initialised default process group (Dist.init)")
        world = dist.get_world_size()
        if world != topo.world_size:
            raise ValueError(f"topology is for {topo.world_size} ranks but {world} processes were started")
        from braid.core.ctas import max_ctas_for
        from braid.tp.comm import nccl_group_options, resolve_tp_backend

        rank = dist.get_rank() if rank is None else rank
        backend = resolve_tp_backend(tp_backend, "cuda" if dist.get_backend() == "nccl" else "cpu", seq_shard)
        ctas = max_ctas_for(tp_max_ctas, topo.tp)
        if backend == "nccl-capped" and ctas is None:
            backend = "nccl"
        timeout = datetime.timedelta(seconds=timeout_s)
        mine: dict[str, dist.ProcessGroup] = {}
        ranks_of: dict[str, list[int]] = {}
        for dim in ("pp", "tp", "dp", "cp", "dp_cp"):
            opts = nccl_group_options(backend, ctas) if dim == "tp" else None
            for ranks in topo.groups(dim):
                g = dist.new_group(ranks, timeout=timeout, pg_options=opts)
                if rank in ranks:
                    mine[dim], ranks_of[dim] = g, ranks
        return ProcessGroups(
            topo, rank, topo.coords(rank), mine["pp"], mine["tp"], mine["dp"], mine["cp"], mine["dp_cp"],
            ranks_of["pp"], ranks_of["tp"], ranks_of["dp_cp"], backend,
        )


def reduce_gradients(params: list[torch.nn.Parameter], groups: ProcessGroups, abort: Abort) -> None:
    """Reduce gradients over data- and context-parallel ranks (after the program, before the optimizer).

    Averaged over the ``dp`` data-parallel replicas, *summed* over the ``cp``
    sequence-parallel ranks: under sequence parallelism each rank's loss is its tokens'
    share of the global mean (:mod:`braid.models.sequence_parallel`), so its gradient is
    a share of the true gradient, not an estimate of it. First, parameters whose gradient
    is partial over TP ranks get its sum (:mod:`braid.models.tp_partial`), and the copies of
    a tied embedding (first and last pipeline stage) the sum of their gradients
    (:func:`braid.models.tied.reduce_tied_gradients`).
    """
    params = list(params)
    reduce_partial_gradients(params, groups.tp if groups.topo.tp > 1 else None, abort)
    reduce_tied_gradients(params, groups.pp_ranks, groups.coords.pp, abort)
    if len(groups.dp_cp_ranks) == 1:
        return
    n = groups.topo.dp
    works = []
    for p in params:
        if p.grad is not None:
            if n > 1:
                p.grad.div_(n)
            works.append(dist.all_reduce(p.grad, group=groups.dp_cp, async_op=True))
    for w in works:
        abort.wait(w)
