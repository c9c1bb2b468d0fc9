"""Multi-rank jobs without torchrun: spawn ``world`` processes (gloo on CPU, NCCL on GPU), run one
function on each, collect the results; a dying rank stops the others and is named."""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable

import torch


# ----------------------------------------------------------------------------------------
# Processes
# ----------------------------------------------------------------------------------------
def _worker(rank: int, world: int, port: int, device: str, fn: Callable, args: tuple, out, parent: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from braid.runtime.distributed import Dist, exit_with_parent

    exit_with_parent(parent)

    d = Dist.init(rank, world, master_port=port, device=f"cuda:{rank}" if device == "cuda" else "cpu", timeout_s=600)
    failed: BaseException | None = None
    try:
        out.put((rank, True, fn(d, *args)))
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which raises
        failed = err
        import traceback

        from braid.runtime.distributed import PeerFailure

        d.abort.fail(err)
        try:
            first = d.abort.first_failure()
        except PeerFailure:  # the store went with rank 0
            first = None
        out.put((rank, False, (traceback.format_exc(), first)))
    finally:
        d.close(failed)


_GRACE_AFTER_DEATH_S = 30.0
_GRACE_AFTER_RESULTS_S = 10.0  # for a rank to close once every rank has reported


class JobFailed(RuntimeError):
    """A spawned job failed: the first line names the cause, the rest holds each failed rank's traceback."""


def launch(world: int, device: str, fn: Callable, *args: Any, timeout_s: float = 3600.0) -> list[Any]:
    """Run ``fn(dist, *args)`` on ``world`` spawned ranks (``fn`` module-level); results by rank.

    A failure becomes a :class:`JobFailed` here whose first line names the rank that failed
    first and its exception text (or the rank whose process died without a report, e.g.
    killed), followed by every failed rank's traceback. A dead rank never makes this wait
    for ``timeout_s``: the others fail fast (:class:`~braid.runtime.distributed.PeerLost`).
    """
    import queue

    import torch.multiprocessing as mp

    if device == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"{world} ranks need {world} GPUs; {torch.cuda.device_count()} visible")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, device, fn, args, out, os.getpid())) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    died: dict[int, str] = {}  # rank -> how its process ended without a report
    dead_since: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) + len(died) < world:
            try:
                r, ok, val = out.get(timeout=1.0)
                got[r] = (ok, val)
                continue
            except queue.Empty:
                pass
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r in got or r in died or p.is_alive():
                    continue
                # a report put just before exiting may still be in the pipe: give it a moment
                if now - dead_since.setdefault(r, now) > 5.0:
                    died[r] = _exit_text(p.exitcode)
            if died and now - min(dead_since.values()) > _GRACE_AFTER_DEATH_S:
                # the job cannot finish without the dead rank; the others had time to fail on their own
                first = min((r for r in died if r in dead_since), key=dead_since.get)
                for r in sorted(set(range(world)) - set(got) - set(died)):
                    procs[r].kill()
                    died[r] = f"was stopped {_GRACE_AFTER_DEATH_S:g} s after rank {first} died"
            if now > deadline:
                missing = sorted(set(range(world)) - set(got) - set(died))
                raise JobFailed(f"ranks {missing} did not finish within {timeout_s} s")
    finally:
        # Once every rank has reported, a rank still closing (NCCL's destroy_process_group can
        # hang after unbatched P2P) holds nothing of the result: it gets a short grace, then is
        # killed, so a finished job is never lost to its teardown. One deadline for all ranks.
        stop = time.monotonic() + (_GRACE_AFTER_RESULTS_S if len(got) == world else _GRACE_AFTER_DEATH_S)
        for p in procs:
            p.join(timeout=max(0.0, stop - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    failed = {r: v for r, (ok, v) in sorted(got.items()) if not ok}
    if failed or died:
        firsts = [first for _, first in failed.values() if first is not None]
        lost = not firsts or firsts[0][1].startswith("PeerLost")
        if died and lost:  # nobody recorded why: the rank that died is the cause
            r = min((r for r in died if r in dead_since), key=dead_since.get)
            head = f"rank {r} died first: its process {died[r]} without a report"
        elif firsts:
            head = f"rank {firsts[0][0]} failed first: {firsts[0][1]}"
        else:
            head = f"ranks {sorted(failed)} failed"
        body = [f"--- rank {r} ---\n{tb}" for r, (tb, _) in failed.items()]
        body += [f"--- rank {r} ---\nits process {how}" for r, how in sorted(died.items())]
        raise JobFailed(head + "\n" + "\n".join(body))
    return [got[r][1] for r in range(world)]


def _exit_text(code: int | None) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it)."""
    import signal

    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
