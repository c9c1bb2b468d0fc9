"""The torch baseline in torchtitan's TP mode computes what one process computes.

``titan`` (sequence-parallel TP as torchtitan's ``apply_tp``) and ``titan+compile`` (every
decoder layer under ``torch.compile(fullgraph=True)``; the ``aot_eager`` backend here, so
the test traces the same graphs without building C++ kernels) on gloo at tp=2 x pp=1 and
tp=2 x pp=2: the step's loss, every gradient and every parameter after one AdamW step match
the single-process model. The reference runs in fp64 (the truth) and in fp32 (the run's
dtype); a figure passes when its error against fp64 is within a small multiple of the fp32
reference's own error, since a TP run differs from it only by summation order.
"""

from __future__ import annotations

import pytest
import torch

from braid.baselines.modes import TorchMode
from tests.conftest import GPU_RUN_S, GPU_TEST_S
from tests.test_baselines import _data, _model, _ref_name

M, B = 4, 1
LR = 1e-2
ADAM_EPS = 1e-8  # torch.optim.AdamW's default, as the pipeline's optimizer and the reference use


def _run(ctx, name: str, mode: TorchMode, world: int, tp: int, pp: int, device: str = "cpu"):
    from braid.baselines.torch_pp import TorchPipeline
    from braid.core.partition import layer_offset
    from braid.core.topology import Topology

    groups = ctx.process_groups(Topology(world, pp=pp, tp=tp))
    model = _model(False)
    layers = (model.cfg.layers // (2 * pp),) * (2 * pp)
    dev = torch.device(f"cuda:{ctx.rank}" if device == "cuda" else "cpu")
    pipe = TorchPipeline(name, model, layers, M, groups=groups, device=dev, dtype=torch.float32, mode=mode)
    opt = pipe.optimizer(lr=LR)
    (inputs, labels, _), = _data(model, False, 1)
    inputs = tuple(x[: M * B].to(dev) for x in inputs)
    opt.zero_grad(set_to_none=True)
    loss = pipe.step(inputs, labels[: M * B].to(dev))
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
    grads, params = {}, {}
    for mod, st in zip(pipe.modules, pipe.stages):
        first = layer_offset(layers, st.stage_index)
        for n, p in mod.named_parameters():
            grads[_ref_name(n.replace("._orig_mod", ""), first, False)] = full(p.grad).detach().to("cpu", copy=True)
    opt.step()
    for mod, st in zip(pipe.modules, pipe.stages):
        first = layer_offset(layers, st.stage_index)
        for n, p in mod.named_parameters():
            params[_ref_name(n.replace("._orig_mod", ""), first, False)] = full(p).detach().to("cpu", copy=True)
    keep = groups.coords.tp == 0
    return loss, grads if keep else {}, params if keep else {}


def _reference(dtype: torch.dtype):
    model = _model(False).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    (inputs, _, labs), = _data(model, False, 1)
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for k in range(M):
        sl = slice(k * B, (k + 1) * B)
        loss = model(*(x[sl] for x in inputs), labs[sl]) / M
        loss.backward()
        total += loss.item()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    return total, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def refs():
    return _reference(torch.float64), _reference(torch.float32)


def _compare(got, refs) -> None:
    """Loss, every gradient and every parameter after one AdamW step against the single-process
    run, within :func:`tests.reference_error.bound`: the float32 reference's own error against the
    float64 one, and for the parameters AdamW's amplification of a gradient's rounding (capped by
    the largest difference one AdamW step can make)."""
    from tests.reference_error import adamw_amplify, adamw_cap, assert_matches_reference

    (loss64, grads64, params64), (loss32, grads32, params32) = refs
    losses = [loss for loss, _, _ in got if loss is not None]
    assert losses, "no rank reported the loss"
    for loss in losses:
        assert_matches_reference(loss, loss32, loss64, what="loss")
    grads = {n: g for _, gs, _ in got for n, g in gs.items()}
    params = {n: p for _, _, ps in got for n, p in ps.items()}
    assert sorted(grads) == sorted(grads64) and sorted(params) == sorted(params64)
    g_scale = max(float(g.abs().max()) for g in grads64.values())
    p_scale = max(float(p.abs().max()) for p in params64.values())
    amplify = adamw_amplify(g_scale, lr=LR, eps=ADAM_EPS, steps=1)
    for n in grads64:
        assert_matches_reference(grads[n], grads32[n], grads64[n], what=f"grad {n}", scale=g_scale)
        assert_matches_reference(params[n], params32[n], params64[n], what=f"param {n} after AdamW", scale=p_scale,
                                 amplify=amplify, cap=adamw_cap(lr=LR, steps=1))


MODES = [TorchMode("titan"), TorchMode("titan", compile=True, backend="aot_eager")]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.label)
def test_titan_tp2_pp1_matches_single_process(pools, refs, mode: TorchMode) -> None:
    _compare(pools(2).run(_run, "torch_1f1b_i", mode, 2, 2, 1), refs)


@pytest.mark.parametrize("name", ["torch_1f1b_i", "torch_zb_v"])
def test_titan_tp2_pp2_matches_single_process(pools, refs, name: str) -> None:
    """Both of torch's schedules with titan's TP; the compiled mode (its own code path, the same for any
    schedule) once, with interleaved 1F1B: four ranks on a two-core CI machine compile slowly."""
    for mode in MODES if name == "torch_1f1b_i" else MODES[:1]:
        _compare(pools(4).run(_run, name, mode, 4, 2, 2), refs)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.timeout(GPU_TEST_S)
@pytest.mark.parametrize("text", ["titan+compile", "titan+compile+async_tp"])
def test_titan_compiled_on_cuda_matches_single_process(gpu_pools, refs, text: str) -> None:
    """torch's best mode on 2 GPUs over NCCL (Inductor's Triton kernels, with async TP its fused
    all-gather/matmul and matmul/reduce-scatter kernels), tp=2 x pp=1, against the CPU references.
    GPU kernels (SDPA, chunked async-TP matmuls) sum in other orders than the CPU reference; the
    rounding bound of :func:`tests.reference_error.bound` covers that.

    On the session's GPU ranks (a pool of its own cost ~14 s to start and close per mode): the
    baseline sets its compiler flags only around its steps (:func:`braid.baselines.titan.compile_settings`),
    as it must beside braid's own compiled units in ``braid.bench``, and :func:`_run_fresh` clears
    Dynamo's caches before and after, so each mode compiles its own graphs (the async-TP pass is a
    global Inductor flag, which no guard of the other mode's cached code would see) and nothing
    compiled here stays for the other tests; the second mode reuses the first one's warm Inductor workers."""
    got = gpu_pools(2).run(_run_fresh, "torch_1f1b_i", TorchMode.parse(text), 2, 2, 1, "cuda", timeout_s=GPU_RUN_S)
    _compare(got, refs)


def _run_fresh(ctx, *args):
    """:func:`_run` between two ``torch._dynamo.reset()``: compiled as in a process of its own."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        return _run(ctx, *args)
    finally:
        torch._dynamo.reset()


def test_titan_mode_refuses_what_it_cannot_shard() -> None:
    from braid.baselines.titan import check_sequence

    with pytest.raises(ValueError, match="seq 7 is not divisible"):
        check_sequence(7, 2)
    assert TorchMode("titan").unavailable("cpu", 1) == "titan TP needs tp > 1"
