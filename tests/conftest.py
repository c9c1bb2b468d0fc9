import os
import sys

# Let test modules import shared helpers from each other (e.g. the hand-written plans).
sys.path.insert(0, os.path.dirname(__file__))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def _session_pools():
    """The gloo pools behind ``pools``, by world size: started once per session (a rank's start-up -- torch,
    braid and, for some modules, megatron-core imported again -- cost each module seconds per rank on a
    2-core CI machine)."""
    made: dict = {}
    yield made
    for p in made.values():  # every pool's ranks end at once, then each is waited for
        p.stop()
    for p in made.values():
        p.close()


@pytest.fixture(scope="module")
def pools(_session_pools):
    """``pools(n)``: a gloo process pool of ``n`` ranks, reused by every case of the module (and, started
    once per session, by the modules after it). When the module ends, its ranks drop Dynamo's compiled code
    (:func:`distributed_utils.reset_rank`); the cached process groups stay, as between a module's cases. Ranks
    that no longer hold the same number of process groups are closed, and the next module starts fresh ones."""
    from distributed_utils import DistPool, reset_rank

    made, used = _session_pools, set()

    def get(n: int):
        if n not in made or made[n].closed:  # a pool that timed out was closed: start a fresh one
            made[n] = DistPool(n, timeout_s=60)
        used.add(n)
        return made[n]

    yield get
    for n in sorted(used):
        pool = made.get(n)
        if pool is not None and not pool.closed:
            try:
                held = pool.run(reset_rank, timeout_s=60)
            except AssertionError:  # a rank that cannot reset: the next module gets fresh ranks
                held = None
            if held is None or len(set(held)) > 1:  # ranks that disagree on their groups: fresh ranks next
                pool.kill()  # (a clean close would wait on groups only some of them hold)


# Per-test limit of the GPU tests that run in ``gpu_pools`` (seconds, the pool's own answer
# timeout is GPU_RUN_S so that it fires first and prints every stuck rank's stacks).
GPU_TEST_S, GPU_RUN_S = 60, 45


@pytest.fixture(scope="session")
def gpu_pools():
    """``gpu_pools(n)``: ``n`` ranks on cuda:0..n-1 (NCCL), started once per session and shared by
    every GPU test: a CUDA context and NCCL communicators cost seconds per process on a fresh
    machine, which per-test pools paid again and again. A pool closed by a timeout is replaced.
    ``gpu_pools(n, fresh=True)`` closes every pool first and starts new ranks: for a case that needs
    most of a device, since a session's ranks keep memory outside the caching allocator (NCCL
    communicators, loaded kernels) that ``empty_cache`` cannot give back."""
    from distributed_utils import DistPool

    made: dict = {}

    def get(n: int, fresh: bool = False):
        if fresh:
            for p in made.values():
                p.close()
            made.clear()
        if n not in made or made[n].closed:
            made[n] = DistPool(n, timeout_s=GPU_RUN_S - 5, device="cuda")
        return made[n]

    yield get
    for p in made.values():
        p.close()


@pytest.fixture
def qwen2_main(monkeypatch):
    """``examples/qwen2.py``'s main in this process, as one process (no RANK/WORLD_SIZE)."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "examples"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    import qwen2
    import train_loop

    return lambda argv: train_loop.main(qwen2.TASK, argv)
