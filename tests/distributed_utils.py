"""Start N gloo processes once, run many test cases inside them, propagate failures.

``DistPool(world_size)`` spawns the ranks (free port, gloo), each waiting for cases on a
queue. ``pool.run(fn, *args)`` runs ``fn(ctx, *args)`` on every rank (``fn`` must be a
module-level function so it pickles by name) and returns the per-rank results; any rank's
exception becomes an ``AssertionError`` here with that rank's traceback. ``ctx`` is a
:class:`RankContext` that caches process groups per topology, so many cases reuse them.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import queue
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankContext:
    """What a case gets on its rank: the initialised job and a cache of process groups."""

    rank: int
    world_size: int
    dist: Any  # braid.runtime.distributed.Dist
    groups: dict = field(default_factory=dict)

    def process_groups(self, topo):
        """The groups of ``topo``, kept until a case asks for another topology. Only one layout's groups
        are kept: on NCCL each group holds its communicator's buffers (a layout's groups took 1.6 GiB
        per rank at tp=2 on H100s, ``benchmarks/bench_memory_terms.py``), and a session of GPU cases
        that kept every layout's ran out of device memory."""
        from braid.runtime.distributed import ProcessGroups

        if topo not in self.groups:
            self.release_groups()
            self.groups[topo] = ProcessGroups.create(topo, timeout_s=self.dist.timeout_s)
        return self.groups[topo]

    def release_groups(self) -> None:
        """Destroy the cached layout's groups and the expert groups cached beside them, and drop what
        else cases cached with them (SP contexts), every rank between the same two cases. The
        2D-Attention pool's groups stay: they are keyed by their ranks, reused by every layout, and
        named after them (see ``GroupPool``)."""
        import torch.distributed as dist

        from braid.runtime.distributed import ProcessGroups
        from braid.runtime.expert_parallel import ExpertGroups

        doomed: dict[int, dist.ProcessGroup] = {}
        for key in [k for k in self.groups if k != SHARED_POOL]:
            held = self.groups.pop(key)
            if isinstance(held, ProcessGroups):
                doomed |= {id(g): g for g in (held.pp, held.tp, held.dp, held.cp, held.dp_cp)}
            elif isinstance(held, ExpertGroups):
                doomed |= {id(g): g for g in (held.ep_group, held.edp_group)}
        held = None
        # nccl-ce's staging (braid.tp.ce_reduce.CEBuffers, held by the layout's TP comm and the expert groups) lives in
        # memory pools registered with the groups' communicators: free it while they still exist. Freed after them,
        # the next empty_cache raised "NCCL communicator was aborted" and the pool's ranks died.
        gc.collect()
        import torch

        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        for g in doomed.values():
            dist.destroy_process_group(g)


SHARED_POOL = "attention-group-pool"  # RankContext.groups key of the 2D-Attention GroupPool
DEAD_GRACE_S = 2.0  # after a rank died: how long answers its live peers already sent may take to arrive


def reset_rank(ctx: RankContext) -> int:
    """Between two test modules that share a pool (``conftest.pools``): drop Dynamo's compiled code, so that a
    module's compiled cases compile as on fresh ranks (and no module meets the recompile limit with another's
    graphs, where Dynamo would run the code eagerly). The cached process groups stay, as they do between the
    cases of one module. Returns how many process groups this rank holds: a group made among its members only
    (``use_local_synchronization``, the 2D-Attention pool's) is named after that count, so the ranks must agree
    on it (megatron-core's parallel state leaves groups on some ranks only; the fixture then starts fresh ranks)."""
    import torch.distributed.distributed_c10d as c10d

    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
    gc.collect()
    return len(c10d._world.pg_names)


def _worker(rank: int, world: int, port: int, timeout_s: float, device: str, tasks, results, parent: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if device == "cuda":
        # CUDA loads a kernel's module at its first launch ("lazy loading", the default), and loading waits
        # for the device's queue to drain (cuLibraryLoadData under the context lock): a first launch behind
        # an NCCL kernel that waits for a peer which waits for this rank deadlocks. The test cases launch new
        # kernels in every case (new shapes, fp32 and fp64 references) beside in-flight P2P and all-reduces;
        # on 4-GPU hosts test_two_gpus_match_reference hung this way 2 runs of 2, and passed with eager loading.
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # DistPool.run dumps a stuck rank's stacks
    import torch

    torch.set_num_threads(1)
    from braid.runtime.distributed import Dist, exit_with_parent

    exit_with_parent(parent)  # a killed test process leaves no rank holding a GPU or a port

    d = Dist.init(rank, world, master_port=port, timeout_s=timeout_s, device=f"cuda:{rank}" if device == "cuda" else "cpu")
    ctx = RankContext(rank, world, d)
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args = item
        try:
            out = (rank, True, fn(ctx, *args))
        except BaseException:  # report everything, keep serving
            out = (rank, False, traceback.format_exc())
        # what the case left in reference cycles, and the allocator's cache: the next case (or a test's
        # own subprocess on this device) starts from what is really in use
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            print(f"[gpu pool rank {rank}] after {getattr(fn, '__name__', fn)}: device in use {(total - free) / 2**20:.0f} MiB, "
                  f"allocator reserved {torch.cuda.memory_reserved() / 2**20:.0f} MiB", file=sys.stderr, flush=True)
        results.put(out)
    d.close()


class DistPool:
    """``world_size`` gloo processes that serve test cases until :meth:`close`."""

    def __init__(self, world_size: int, timeout_s: float = 60.0, device: str = "cpu") -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.closed = False  # set by close(), also after a timeout: a fixture then starts a new pool
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, timeout_s, device, self.tasks[r], self.results, os.getpid()), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def _drain(self, waiting: set[int], grace_s: float) -> dict[int, tuple[bool, Any]]:
        """Answers of the ranks in ``waiting`` that arrive within ``grace_s``."""
        out: dict[int, tuple[bool, Any]] = {}
        end = time.monotonic() + grace_s
        while waiting - set(out) and time.monotonic() < end:
            try:
                rank, ok, val = self.results.get(timeout=max(0.0, min(0.2, end - time.monotonic())))
            except queue.Empty:
                continue
            out[rank] = (ok, val)
        return out

    def run(self, fn: Callable, *args: Any, timeout_s: float = 120.0) -> list[Any]:
        """Run ``fn(ctx, *args)`` on every rank; returns results by rank, raises on any failure.

        A rank whose process has died is reported at once (with its exit code), not after
        ``timeout_s``: its peers' answers never come."""
        for q in self.tasks:
            q.put((fn, args))
        got: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.world_size:
            try:
                rank, ok, val = self.results.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(self.procs) if not p.is_alive()}
                if dead:  # answers the live ranks already sent (a busy host can delay them past the poll) still count
                    got.update(self._drain(set(range(self.world_size)) - set(got) - set(dead), DEAD_GRACE_S))
                if dead or time.monotonic() >= deadline:
                    missing = sorted(set(range(self.world_size)) - set(got))
                    self._dump_stacks(missing)
                    self.kill()  # a rank still stuck (or waiting on a dead peer) would hold a clean close for its join timeout
                    why = f"rank processes died (exit codes {dead})" if dead else f"no answer within {timeout_s} s"
                    # A rank that failed first often leaves its peers waiting for it: say what it raised.
                    errors = "".join(f"\n--- rank {r} failed first ---\n{v}" for r, (ok, v) in sorted(got.items()) if not ok)
                    raise AssertionError(f"{fn.__name__}: ranks {missing} did not answer: {why}{errors}") from None
                continue
            got[rank] = (ok, val)
        errors = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(got.items()) if not ok]
        if errors:
            raise AssertionError(f"{fn.__name__} failed:\n" + "\n".join(errors))
        return [got[r][1] for r in range(self.world_size)]

    def _dump_stacks(self, ranks: list[int]) -> None:
        """Have the live ``ranks`` print every thread's stack to stderr (what a hang looks like)."""
        for r in ranks:
            if self.procs[r].is_alive():
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(2.0)

    def stop(self) -> None:
        """Ask every live rank to end (close it to wait for them): pools stopped together end together."""
        self.closed = True
        for q, p in zip(self.tasks, self.procs):
            if p.is_alive():
                q.put(None)

    def kill(self) -> None:
        """End the ranks at once, without their clean-up: for ranks whose state is of no further use."""
        self.closed = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join()

    def close(self) -> None:
        self.stop()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
