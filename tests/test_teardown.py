"""How a failed rank tears its process groups down (:meth:`braid.runtime.distributed.Dist.close`).

Destroying NCCL communicators waits for their collectives, so a CUDA rank that failed mid-step aborts them
instead; the abort can itself wait for ever, so the rank's error prints first and the abort is bounded.
Mocks stand in for torch's teardown calls: on CPU there is no NCCL to abort.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist


@pytest.mark.parametrize("device, failed, called", [("cuda", True, "abort"), ("cuda", False, "destroy"),
                                                     ("cpu", True, "destroy"), ("cpu", False, "destroy")])
def test_a_failed_nccl_rank_aborts_its_groups_instead_of_destroying_them(monkeypatch, device: str, failed: bool,
                                                                           called: str) -> None:
    """Destroying NCCL communicators waits for their collectives: after a failure mid-step (a peer failed elsewhere,
    a replayed graph's all-reduce waits on the device) that is for ever, and the rank's error never prints."""
    import torch.distributed.distributed_c10d as c10d

    from braid.runtime.distributed import Dist

    calls: list[str] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: calls.append("destroy"))
    monkeypatch.setattr(c10d, "_abort_process_group", lambda *a: calls.append("abort"))
    Dist(0, 2, torch.device(device), None, None, 1.0).close(RuntimeError("a step failed") if failed else None)
    assert calls == [called]


def test_a_failing_abort_does_not_replace_the_ranks_own_error(monkeypatch) -> None:
    """close runs in the train loop's finally: an abort that raises (a group NCCL's watchdog already tore down)
    is logged, and the exception that failed the rank is the one that leaves."""
    import torch.distributed.distributed_c10d as c10d

    from braid.runtime.distributed import Dist

    def broken(*a):
        raise RuntimeError("abort failed")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(c10d, "_abort_process_group", broken)
    with pytest.raises(ValueError, match="the rank's own"):
        try:
            raise ValueError("the rank's own")
        finally:
            Dist(0, 2, torch.device("cuda"), None, None, 1.0).close(ValueError("the rank's own"))


def test_a_failed_rank_prints_its_error_before_an_abort_that_never_returns(monkeypatch, capsys) -> None:
    """NCCL's abort can wait on a kernel that never ends (on 2 H100s: 300 s, then no return): the rank's own error
    is on stderr before the abort starts, and the rank leaves the abort behind after ABORT_WAIT_S."""
    import threading

    import torch.distributed.distributed_c10d as c10d

    import braid.runtime.distributed as bd

    never = threading.Event()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(c10d, "_abort_process_group", lambda *a: never.wait())
    monkeypatch.setattr(bd, "ABORT_WAIT_S", 0.2)
    t0 = time.monotonic()
    bd.Dist(3, 4, torch.device("cuda"), None, None, 1.0).close(MemoryError("CUDA out of memory.\nmore"))
    waited = time.monotonic() - t0
    never.set()
    err = capsys.readouterr().err.splitlines()
    assert err == ["rank 3: MemoryError: CUDA out of memory.; aborting its NCCL groups",
                   "rank 3: aborting its NCCL groups did not finish within 0.2 s; left behind"], err
    assert 0.2 <= waited < 5.0
