"""Process-group setup, with timeouts and failure propagation between ranks.

:class:`ProcessGroups` owns the pp, tp, dp, cp and dp x cp groups of a
:class:`braid.topology.Topology` (no module-level state: the object travels to whoever
needs a group). The backend follows the device: gloo on CPU, NCCL on CUDA.

Failure propagation. A rank that raises sets an abort key in the job's TCPStore
(:meth:`Abort.signal`). Every wait of the executor on a communication handle checks that
key before blocking and waits at most ``timeout_s`` (:meth:`Abort.wait`), so the other
ranks raise :class:`PeerFailure` at their next wait, or after the timeout, instead of
hanging in a receive or an all-reduce whose peer is gone. Collectives the executor does
not wait on itself (the loss's small all-reduces) are
bounded by the process-group ``timeout`` too. A rank blocked in a receive from a dead peer
therefore fails within ``timeout_s`` and its error names the rank that failed first. On CUDA, waits are stream-ordered and the NCCL
watchdog (same timeout) is the backstop.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from braid.models.tied import reduce_tied_gradients
from braid.topology import RankCoords, Topology

log = logging.getLogger(__name__)

ABORT_KEY = "braid/abort"


class PeerFailure(RuntimeError):
    """Another rank failed; this rank stops instead of waiting forever."""


def backend_for(device: torch.device) -> str:
    """gloo on CPU, NCCL on CUDA."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(slots=True)
class Abort:
    """A job-wide abort flag in the TCPStore, consulted around every communication wait."""

    store: dist.Store
    rank: int
    timeout_s: float = 120.0
    cuda: bool = False  # stream-ordered waits (NCCL): the watchdog bounds them

    def signal(self, reason: str) -> None:
        """Tell every rank that this one failed (idempotent, never raises)."""
        try:
            self.store.set(ABORT_KEY, f"rank {self.rank}: {reason}"[:2000])
        except Exception:  # the store itself may be gone; nothing more to do
            log.exception("could not set the abort flag")

    def clear(self) -> None:
        """Forget an earlier failure (tests that reuse a job after a failure case)."""
        self.store.delete_key(ABORT_KEY)

    def check(self) -> None:
        """Raise :class:`PeerFailure` if any rank has signalled a failure."""
        if self.store.check([ABORT_KEY]):
            raise PeerFailure(f"rank {self.rank} stops because {self.store.get(ABORT_KEY).decode(errors='replace')}")

    def wait(self, work: dist.Work | None) -> None:
        """Wait for an async work handle at most ``timeout_s``; a peer's failure becomes :class:`PeerFailure`.

        gloo send/recv handles cannot be polled (``is_completed`` stays false until
        ``wait``), so the flag is checked before blocking, and after a timed-out wait to
        name the rank that failed.
        """
        if work is None:
            return
        if self.cuda:
            work.wait()
            return
        self.check()
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            self.check()
            raise TimeoutError(f"rank {self.rank}: communication did not finish within {self.timeout_s} s ({err})") from err


@dataclass(slots=True)
class Dist:
    """An initialised job: rank, world size, device, store, abort flag and timeout."""

    rank: int
    world_size: int
    device: torch.device
    store: dist.Store
    abort: Abort
    timeout_s: float

    @staticmethod
    def init(
        rank: int,
        world_size: int,
        *,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        device: torch.device | str = "cpu",
        timeout_s: float = 120.0,
    ) -> "Dist":
        """Create the TCPStore and the default process group (backend from the device).

        ``master_port``/``master_addr`` default to ``MASTER_PORT``/``MASTER_ADDR``; under
        torchrun the agent's store is joined as a client.
        """
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        port = int(master_port if master_port is not None else os.environ.get("MASTER_PORT", "29500"))
        addr = os.environ.get("MASTER_ADDR", master_addr) if master_port is None else master_addr
        timeout = datetime.timedelta(seconds=timeout_s)
        is_master = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        store = dist.TCPStore(addr, port, world_size, is_master=is_master, timeout=timeout)
        dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world_size, timeout=timeout)
        return Dist(rank, world_size, device, store, Abort(store, rank, timeout_s, device.type == "cuda"), timeout_s)

    @staticmethod
    def from_env(device: torch.device | str = "cpu", timeout_s: float = 120.0) -> "Dist":
        """Initialise from torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_*`` variables."""
        return Dist.init(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device=device, timeout_s=timeout_s)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


TP_MAX_CTAS = 4


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

    @staticmethod
    def create(topo: Topology, rank: int | None = None, timeout_s: float = 120.0,
               tp_max_ctas: int | None = TP_MAX_CTAS) -> "ProcessGroups":
        """Create every group of the layout (collective: all ranks call it, same order).

        ``tp_max_ctas`` caps the thread blocks NCCL gives the TP group's all-reduces. A
        braided block runs each all-reduce *while* the other micro-batch's GEMMs run; an
        uncapped NCCL kernel holds its SMs while it waits for the peer and slows those
        GEMMs. Measured on 2 H200s (``benchmarks/bench_braided_overlap.py``, Qwen2-7B-sized
        layers, seq 4096, TP=2): uncapped, braided ran 1.33x slower than unbraided; with 4
        channels it ran 0.97x (faster) with 72% of the all-reduce time hidden. Only the TP
        group is capped, so data-parallel and pipeline traffic keep full bandwidth. Ignored
        on gloo; ``None`` leaves NCCL's default.
        """
        if not dist.is_initialized():
            raise RuntimeError("ProcessGroups.create needs an initialised default process group (Dist.init)")
        world = dist.get_world_size()
        if world != topo.world_size:
            raise ValueError(f"topology is for {topo.world_size} ranks but {world} processes were started")
        rank = dist.get_rank() if rank is None else rank
        timeout = datetime.timedelta(seconds=timeout_s)
        mine: dict[str, dist.ProcessGroup] = {}
        ranks_of: dict[str, list[int]] = {}
        for dim in ("pp", "tp", "dp", "cp", "dp_cp"):
            opts = _nccl_options(tp_max_ctas) if dim == "tp" else None
            for ranks in topo.groups(dim):
                g = dist.new_group(ranks, timeout=timeout, pg_options=opts)
                if rank in ranks:
                    mine[dim], ranks_of[dim] = g, ranks
        return ProcessGroups(
            topo, rank, topo.coords(rank), mine["pp"], mine["tp"], mine["dp"], mine["cp"], mine["dp_cp"],
            ranks_of["pp"], ranks_of["tp"], ranks_of["dp_cp"],
        )


def _nccl_options(max_ctas: int | None) -> object | None:
    """NCCL process-group options capping CTAs, or None (gloo, or no cap asked for)."""
    if max_ctas is None or dist.get_backend() != "nccl":
        return None
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.max_ctas = int(max_ctas)
    return opts


def reduce_gradients(params: list[torch.nn.Parameter], groups: ProcessGroups, abort: Abort) -> None:
    """Reduce gradients over data- and context-parallel ranks (after the program, before the optimizer).

    Averaged over the ``dp`` data-parallel replicas, *summed* over the ``cp``
    sequence-parallel ranks: under sequence parallelism each rank's loss is its tokens'
    share of the global mean (:mod:`braid.models.sequence_parallel`), so its gradient is
    a share of the true gradient, not an estimate of it. First, the copies of a tied
    embedding (first and last pipeline stage) get the sum of their gradients
    (:func:`braid.models.tied.reduce_tied_gradients`).
    """
    params = list(params)
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
