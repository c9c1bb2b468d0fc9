"""TP communication backends (braid.tp.comm): choice, errors, and the sums they compute.

CPU (CI): backend resolution and its errors, the gloo path through ProcessGroups and the
executor; nccl-ce's algorithm (:mod:`braid.tp.ce_reduce`: all-to-all, sum, in-place
all-gather) on gloo with plain buffers at 2, 3 and 4 ranks, against a float64 sum, and
braided_v through it, with and without sequence sharding. GPU (marked, 2 devices): every CUDA
backend's all-reduce equals the reference sum bitwise at TP=2 (one rounding of a + b in every
backend), and braided_v with each backend matches the single-device reference; nccl-ce's
all-reduce agrees with NCCL's, replays in a CUDA graph, and runs no NCCL kernel (its
all-to-all and all-gather took NCCL's copy-engine path).
"""

from __future__ import annotations

import time

import pytest
import torch

from braid.core.ctas import default_max_ctas, max_ctas_for
from braid.tp.comm import CUDA_BACKENDS, TPBackendError, TPComm, resolve_tp_backend
from conftest import GPU_RUN_S, GPU_TEST_S


@pytest.mark.parametrize("name,device,want", [("auto", "cpu", "gloo"), ("auto", "cuda", "nccl-capped"), ("gloo", "cpu", "gloo"),
                                              ("symm-mem", "cuda", "symm-mem"), ("nccl", "cuda", "nccl"),
                                              ("nccl-ce", "cuda", "nccl-ce")])
def test_resolve(name, device, want):
    assert resolve_tp_backend(name, device) == want


@pytest.mark.parametrize("name,device,words", [("nccl", "cpu", "needs CUDA"), ("symm-mem", "cpu", "needs CUDA"),
                                               ("nccl-ce", "cpu", "needs CUDA"),
                                               ("gloo", "cuda", "CPU backend"), ("mpi", "cpu", "unknown TP backend")])
def test_resolve_refuses_with_one_clear_line(name, device, words):
    with pytest.raises(TPBackendError, match=words) as err:
        resolve_tp_backend(name, device)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("setting, tp, want", [(None, 2, default_max_ctas(2)), (None, 8, default_max_ctas(8)),
                                               (0, 4, None), (8, 2, 8), (8, 4, 8)])
def test_max_ctas_setting(setting, tp, want):
    """None takes the measured default of the TP size, 0 leaves NCCL's choice, a number is kept."""
    assert max_ctas_for(setting, tp) == want


def test_wider_tp_groups_get_more_thread_blocks_by_default():
    assert default_max_ctas(2) < default_max_ctas(4) == default_max_ctas(8)


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


def test_gloo_backend_sums_over_the_tp_group(pools):
    out = pools(2).run(_gloo_case)
    want = torch.arange(10, dtype=torch.float32) * 3
    for x, refused in out:
        assert torch.equal(x, want)
        assert refused is not None and "needs CUDA" in refused


# -- nccl-ce's algorithm on CPU ---------------------------------------------------------
def _sum_bound(parts: torch.Tensor, dtype: torch.dtype, acc: torch.dtype) -> torch.Tensor:
    """How far a sum of ``parts`` (w, ...; float64, the dtype's values) may lie from the exact sum when
    the terms are added in ``acc`` and the result rounded to ``dtype``: w - 1 additions, each rounding
    a partial sum no larger than sum |x| by at most eps(acc) / 2 (doubled here for the higher-order
    terms), then one rounding to ``dtype`` of at most eps(dtype) / 2 of the result."""
    added = (parts.shape[0] - 1) * torch.finfo(acc).eps * parts.abs().sum(0)
    return torch.finfo(dtype).eps / 2 * (parts.sum(0).abs() + added) + added


def _ce_sums_case(ctx):
    """nccl-ce's TPComm over a gloo TP group: its staging sets are plain tensors and the steps of
    braid.tp.ce_reduce run synchronously, the same code the CUDA path runs on its side stream."""
    from braid.core.topology import Topology
    from braid.tp.comm import TPComm
    from braid.tp.seq_shard import gathered_view, scatter_request

    w, r = ctx.world_size, ctx.rank
    groups = ctx.process_groups(Topology(w, pp=1, tp=w))
    comm = TPComm("nccl-ce", groups.tp)
    half = (torch.bfloat16, torch.float16)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        acc = torch.float32 if dtype in half else dtype
        for k, shape in enumerate(((1,), (3, 7, 5), (2, 37))):  # numels 1, 105, 74: not multiples of 2, 4 (105) or 3 (74)
            xs = [torch.randn(shape, generator=torch.Generator().manual_seed(100 * k + j)).to(dtype) for j in range(w)]
            parts = torch.stack([x.double() for x in xs])
            for _ in range(2):  # the second call reuses the first one's staging set
                y = xs[r].clone()
                comm.all_reduce(y).wait()
                err = (y.double() - parts.sum(0)).abs()
                assert (err <= _sum_bound(parts, dtype, acc)).all(), f"rank {r} {dtype} {shape}: off by {err.max()}"
        # float32 accumulation, one rounding: 1 + (w-1) * 2^-8 in bfloat16 (summed in bfloat16 one term at a
        # time every 2^-8 would round away, as half an ulp of 1 tied to even)
        y = torch.full((5,), 1.0 if r == 0 else 2.0 ** -8, dtype=dtype)
        comm.all_reduce(y).wait()
        assert torch.equal(y, torch.full((5,), 1 + (w - 1) * 2.0 ** -8, dtype=torch.float64).to(dtype)), f"rank {r} {dtype}: {y}"
        # the reduce-scatter of sequence sharding: (b, s, h) partial sums -> this rank's s/w tokens of the sum
        fulls = [torch.randn((2, 2 * w, 3), generator=torch.Generator().manual_seed(7 + j)).to(dtype) for j in range(w)]
        req = scatter_request(fulls[r].clone(), w)
        comm.reduce(req).wait()
        parts = torch.stack([f.double() for f in fulls])[:, :, 2 * r:2 * r + 2]
        err = (req.out.double() - parts.sum(0)).abs()
        assert (err <= _sum_bound(parts, dtype, acc)).all(), f"rank {r} {dtype} reduce-scatter: off by {err.max()}"
        # the all-gather of sequence sharding: every rank's (b, s/w, h) tokens, in rank order, exactly
        buf, work = comm.gather_start(fulls[r][:, :2])
        work.wait()
        assert torch.equal(gathered_view(buf), torch.cat([f[:, :2] for f in fulls], 1)), f"rank {r} {dtype} all-gather"
    return sorted((n, str(d)) for n, d in comm._ce.sets)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_nccl_ce_algorithm_sums_on_gloo(pools, world):
    """The all-reduce (padded numels included) and the reduce-scatter of nccl-ce's algorithm equal the
    float64 sum within the rounding of a float32 (bfloat16: float32 accumulation, rounded once)
    or float64 sum; every rank made the same staging sets (the same sizes in the same order)."""
    sets = pools(world).run(_ce_sums_case, timeout_s=60)
    assert all(s == sets[0] for s in sets)
    assert (world * 2 * 2 * 3, "torch.float32") in sets[0]  # the reduce-scatter's (staged whole, not padded)


def test_nccl_ce_braided_v_matches_reference_on_gloo(pools):
    """braided_v through nccl-ce's TPComm (over a gloo TP group: the algorithm without registration)
    equals the single-process reference, with the all-reduces and with sequence sharding's
    reduce-scatters and all-gathers (both through its staging)."""
    import executor_cases as cases

    pool = pools(2)
    plain = pool.run(cases.equivalence, 1, 2, [("braided_v", 3)], False, "nccl-ce", timeout_s=120)
    shard = pool.run(cases.equivalence, 1, 2, [("braided_v", 3)], False, "nccl-ce", "none", None, True, timeout_s=120)
    assert plain[0][0][2]["AR"] > 0 and shard[0][0][2]["seq_shard"]


def test_nccl_ce_refuses_to_register_inside_a_capture():
    """A size first needed inside a CUDA graph capture is refused in one line that says what to do."""
    from braid.tp.ce_reduce import CEBufferError, capture_refusal

    capture_refusal(1024, torch.bfloat16, capturing=False)
    with pytest.raises(CEBufferError, match="capture is in progress; run the step eagerly first") as err:
        capture_refusal(1024, torch.bfloat16, capturing=True)
    assert "\n" not in str(err.value) and "1024 x bfloat16" in str(err.value)


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



def _ce_gpu_case(ctx):
    """nccl-ce on the session's GPU ranks: its sum against NCCL's and the exact one, a profiled
    all-reduce (and, as the detector's control, an all-to-all on unregistered buffers, which NCCL
    must run with its kernels), a CUDA graph replayed on new data, and a size refused in a capture."""
    import torch.distributed as dist
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from executor_cases import _tp_comm
    from braid.core.topology import Topology
    from braid.tp.ce_reduce import CEBufferError

    groups = ctx.process_groups(Topology(ctx.world_size, pp=1, tp=ctx.world_size))
    try:
        comm = _tp_comm(ctx, groups, "nccl-ce")
    except TPBackendError as e:
        return ("unavailable", str(e))
    dev, w, bf16 = ctx.dist.device, ctx.world_size, torch.bfloat16
    shape = (3, 4099)  # an odd numel: padded

    def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs = [torch.randn(shape, generator=torch.Generator().manual_seed(seed + j)).to(bf16) for j in range(w)]
        return xs[ctx.rank].to(dev), torch.stack([x.double() for x in xs])

    mine, parts = inputs(11)
    ce, ref = mine.clone(), mine.clone()
    comm.all_reduce(ce).wait()
    dist.all_reduce(ref, group=groups.tp)  # NCCL's kernels, on the groups' own TP group
    torch.cuda.synchronize(dev)
    ce, ref = ce.cpu().double(), ref.cpu().double()
    ce_bound, ring_bound = _sum_bound(parts, bf16, torch.float32), _sum_bound(parts, bf16, bf16)
    sums = {"ce_vs_exact": bool(((ce - parts.sum(0)).abs() <= ce_bound).all()),
            "ce_vs_nccl": bool(((ce - ref).abs() <= ce_bound + ring_bound).all())}

    def device_names(fn) -> list[str]:
        torch.cuda.synchronize(dev)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(dev)
        return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]

    y = mine.clone()
    ce_ops = device_names(lambda: comm.all_reduce(y).wait())
    plain_in = torch.randn(w * 4096, device=dev).to(bf16)
    plain_out = torch.empty_like(plain_in)
    control = device_names(lambda: dist.all_to_all_single(plain_out, plain_in, group=comm.group))

    static = mine.clone()
    comm.all_reduce(static).wait()  # eager first: this size's staging set exists before the capture
    torch.cuda.synchronize(dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
        comm.all_reduce(static).wait()
    replays = []
    for seed in (21, 33):
        new, p = inputs(seed)
        static.copy_(new)
        graph.replay()
        torch.cuda.synchronize(dev)
        replays.append(bool(((static.cpu().double() - p.sum(0)).abs() <= _sum_bound(p, bf16, torch.float32)).all()))

    unseen = torch.ones(5, 3, dtype=bf16, device=dev)
    refused = None
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=side, capture_error_mode="thread_local"):
            comm.all_reduce(unseen)
    except CEBufferError as e:
        refused = str(e)
    torch.cuda.synchronize(dev)
    return ("ran", sums, ce_ops, control, replays, refused)


def _is_nccl_kernel(name: str) -> bool:
    """An NCCL device kernel (``ncclDevKernel_SendRecv(...)``, ``ncclKernel_...``, a symmetric kernel's
    ``ncclSym...``); not torch's ``nccl:all_to_all`` range, which the profiler puts on the GPU's timeline
    around copy-engine work too."""
    return name.startswith("nccl") and not name.startswith("nccl:")


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.timeout(GPU_TEST_S)
def test_nccl_ce_engages_copy_engines_and_replays_in_a_graph(gpu_pools):
    """nccl-ce at TP=2: its all-reduce equals the exact sum within float32 accumulation and one bfloat16
    rounding, and NCCL's within both bounds; under the profiler it runs no NCCL kernel, only copies
    and the local sum, while an all-to-all of unregistered buffers on the same group does run one
    (so the profiler sees NCCL's kernels there: their absence means copy engines, not a blind
    profiler); a captured graph of it replays correctly on new inputs; a size first seen inside a
    capture is refused."""
    res = gpu_pools(2).run(_ce_gpu_case, timeout_s=GPU_RUN_S)
    if res[0][0] == "unavailable":
        pytest.skip(res[0][1])
    for rank, (_, sums, ce_ops, control, replays, refused) in enumerate(res):
        assert sums == {"ce_vs_exact": True, "ce_vs_nccl": True}, f"rank {rank}: nccl-ce's sum: {sums}"
        assert any(_is_nccl_kernel(n) for n in control), (
            f"rank {rank}: the profiler saw no NCCL kernel in an all-to-all of unregistered buffers either, so it "
            f"cannot tell copy engines from kernels here: {control}")
        kernels = [n for n in ce_ops if _is_nccl_kernel(n)]
        assert not kernels, (f"rank {rank}: CE fell back: nccl-ce's all-to-all/all-gather ran NCCL kernels {kernels} "
                             f"instead of NCCL's copy-engine path (all device work: {ce_ops})")
        assert replays == [True, True], f"rank {rank}: graph replays of nccl-ce's all-reduce: {replays}"
        assert refused is not None and "capture" in refused, f"rank {rank}: a new size inside a capture: {refused}"
