"""Run a benchmark worker on two spawned processes and collect what they put on a queue."""

from __future__ import annotations

import os
import socket
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
    for p in procs:
        p.join()
    return got
