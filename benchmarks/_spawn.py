"""Run a benchmark worker on two spawned processes and collect what they put on a queue."""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable

import torch.multiprocessing as mp


def spawn_two(worker: Callable[..., None], args: Any, *, results: int = 1, timeout_s: float = 1800) -> list[Any]:
    """Start ``worker(rank, args, port, queue)`` on ranks 0 and 1; return ``results`` items from the queue."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=timeout_s) for _ in range(results)]
    # The results are in: a rank still closing (NCCL's destroy_process_group can hang) gets a
    # short grace, then is killed, so a finished run is never lost to its teardown.
    stop = time.monotonic() + 10.0
    for p in procs:
        p.join(timeout=max(0.0, stop - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)
    return got
