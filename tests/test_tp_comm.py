"""TP communication backends (braid.tp.comm): choice, errors, and the sums they compute.

CPU (CI): backend resolution and its errors, the gloo path through ProcessGroups and the
executor. GPU (marked, 2 devices): every CUDA backend's all-reduce equals the reference sum
bitwise at TP=2 (one rounding of a + b in every backend), and braided_v with each backend
matches the single-device reference.
"""

from __future__ import annotations

import time

import pytest
import torch

from braid.tp.comm import CUDA_BACKENDS, TPBackendError, TPComm, resolve_tp_backend
from conftest import GPU_RUN_S, GPU_TEST_S
from distributed_utils import DistPool


@pytest.mark.parametrize("name,device,want", [("auto", "cpu", "gloo"), ("auto", "cuda", "nccl-capped"), ("gloo", "cpu", "gloo"),
                                              ("symm-mem", "cuda", "symm-mem"), ("nccl", "cuda", "nccl")])
def test_resolve(name, device, want):
    assert resolve_tp_backend(name, device) == want


@pytest.mark.parametrize("name,device,words", [("nccl", "cpu", "needs CUDA"), ("symm-mem", "cpu", "needs CUDA"),
                                               ("gloo", "cuda", "CPU backend"), ("mpi", "cpu", "unknown TP backend")])
def test_resolve_refuses_with_one_clear_line(name, device, words):
    with pytest.raises(TPBackendError, match=words) as err:
        resolve_tp_backend(name, device)
    assert "\n" not in str(err.value)


def test_unknown_backend_object_is_refused():
    with pytest.raises(TPBackendError, match="unknown TP backend"):
        TPComm("ring", None)


def _gloo_case(ctx):
    import torch.distributed as dist

    from braid.tp.comm import TPBackendError as Err
    from braid.core.topology import Topology

    groups = ctx.process_groups(Topology(ctx.world_size, pp=1, tp=ctx.world_size))
    assert groups.tp_backend == "gloo"
    x = torch.arange(10, dtype=torch.float32) * (ctx.rank + 1)
    work = groups.tp_comm.all_reduce(x)
    work.wait()
    try:
        from braid.runtime.distributed import ProcessGroups

        ProcessGroups.create(Topology(ctx.world_size, pp=1, tp=ctx.world_size), tp_backend="symm-mem")
        refused = None
    except Err as e:
        refused = str(e)
    dist.barrier()
    return x, refused


def test_gloo_backend_sums_over_the_tp_group():
    pool = DistPool(2, timeout_s=60)
    try:
        out = pool.run(_gloo_case)
    finally:
        pool.close()
    want = torch.arange(10, dtype=torch.float32) * 3
    for x, refused in out:
        assert torch.equal(x, want)
        assert refused is not None and "needs CUDA" in refused


# -- GPU ----------------------------------------------------------------------------------
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def _sum_case(ctx, backend: str):
    import torch.distributed as dist

    from executor_cases import _tp_comm
    from braid.core.topology import Topology

    groups = ctx.process_groups(Topology(ctx.world_size, pp=1, tp=ctx.world_size))
    try:
        comm = _tp_comm(ctx, groups, backend)
    except TPBackendError as e:
        return ("unavailable", str(e))
    dev = ctx.dist.device
    out = []
    for shape in ((4096, 3584), (3, 7, 5)):  # a boundary activation; an odd size (padded)
        g = torch.Generator(device="cpu").manual_seed(11 + ctx.rank)
        x = torch.randn(shape, generator=g).to(device=dev, dtype=torch.bfloat16)
        parts = [torch.empty_like(x) for _ in range(ctx.world_size)]
        dist.all_gather(parts, x)
        want = parts[0]
        for p in parts[1:]:
            want = want + p
        y = x.clone()
        comm.all_reduce(y).wait()
        torch.cuda.synchronize(dev)
        out.append(bool(torch.equal(y, want)))
    return ("ran", out)


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.timeout(GPU_TEST_S)
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_cuda_backend_sums_exactly_and_braided_v_matches_reference(gpu_pools, backend):
    """Each backend's all-reduce equals a + b bitwise (a boundary activation, an odd padded size),
    then braided_v and 1f1b_i with it match the reference (braided units keep two all-reduces in
    flight beside the other micro-batch's compute: buffers on the side stream must stay alive).

    On the session's GPU ranks, as ``braid.bench`` runs its chosen backend beside everything else:
    a backend other than the groups' own gets TP groups of its own, with its options (symm-mem
    registers that group for symmetric memory; :func:`braid.tp.comm.make_tp_comm`, cached per
    backend by ``executor_cases._tp_comm``), so the other tests' groups are left as they were.
    A pool per backend cost ~12 s of its ~13 s to start and close."""
    import executor_cases as cases

    pool = gpu_pools(2)
    end = time.monotonic() + GPU_RUN_S  # both runs within the pool's answer time, inside the test's limit
    res = pool.run(_sum_case, backend, timeout_s=GPU_RUN_S)
    if res[0][0] == "unavailable":
        pytest.skip(res[0][1])
    for _, ok in res:
        assert ok == [True, True], f"{backend}: all-reduce differs from a + b"
    ran = pool.run(cases.equivalence, 1, 2, [("braided_v", 5), ("1f1b_i", 5)], False, backend,
                   timeout_s=max(5.0, end - time.monotonic()))
    assert {(n, m) for n, m, _ in ran[0]} == {("braided_v", 5), ("1f1b_i", 5)}

