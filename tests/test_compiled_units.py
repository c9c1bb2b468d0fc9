"""Compiled units (``torch.compile`` of the units' element-wise functions), on CPU.

Inductor's C++ backend compiles for CPU, so the contract is checked here on a tiny model
(compiling costs seconds per shape; the rest of the suite stays eager):

* each compiled function gives the eager values and gradients (to rounding);
* the executor with compiled units equals the single-device reference (loss, every
  gradient) for a braided schedule and a zero-bubble one (B/W split: W units ran), and the
  eager executor to rounding;
* what a compiled function saves for its backward goes through the chunk's saved-tensor
  boxes: offloading every micro-batch after its forward and reloading it before its
  backward gives bitwise the gradients of the run without offload, and a backward whose
  activations are still on the host is refused.

The same checks run on one GPU (Triton kernels) with
``PYTHONPATH=. python -m pytest tests/test_compiled_units.py -k cuda``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from braid import schedules
from braid.core.braiding import ChunkSpec, Unit
from braid.core.compiler import compile_plan
from braid.core.ir import OpKind
from braid.models.chunk_parts import ChunkStateError
from braid.models.build import build_chunk
from braid.models.qwen2 import EAGER, Qwen2Config, Qwen2Model, rope_tables
from braid.runtime import compiled
from braid.runtime.executor import Executor
from braid.models.build import build_rank_chunks
from chunk_driver import drive

pytestmark = pytest.mark.skipif(not compiled.available("cpu"), reason="torch.compile on CPU needs a C++ compiler")

CFG = Qwen2Config(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64)
MBS, SEQ = 2, 8
TOL = dict(rtol=1e-4, atol=1e-5)


def _data(m: int, seed: int = 1, device: str = "cpu") -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    toks = [torch.randint(0, CFG.vocab_size, (MBS, SEQ), generator=g).to(device) for _ in range(m)]
    labs = [torch.randint(0, CFG.vocab_size, (MBS, SEQ), generator=g).to(device) for _ in range(m)]
    return toks, labs


def _model(device: str = "cpu", dtype: torch.dtype = torch.float32) -> Qwen2Model:
    torch.manual_seed(0)
    return Qwen2Model(CFG).to(device, dtype)


def test_each_compiled_function_gives_the_eager_values_and_gradients() -> None:
    fast = compiled.compiled_fns()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(MBS, SEQ, CFG.hidden, generator=g)
    w = torch.randn(CFG.hidden, generator=g)
    q = torch.randn(MBS, 4, SEQ, 8, generator=g)
    k = torch.randn(MBS, 2, SEQ, 8, generator=g)
    gate, up = torch.randn(MBS, SEQ, 64, generator=g), torch.randn(MBS, SEQ, 64, generator=g)
    pos = torch.arange(SEQ).flip(0)
    tables = rope_tables(1e6, SEQ, 8, torch.device("cpu"), torch.float32)
    qkv = torch.randn(MBS, SEQ, (4 + 2 * 2) * 8, generator=g)
    cases = {
        "rms_norm": ((x, w), (1e-6,)),
        "rope_qk": ((q, k), tables),
        "rope_qk at positions": ((q, k), rope_tables(1e6, SEQ, 8, torch.device("cpu"), torch.float32, pos)),
        "split_rope_qkv": ((qkv,), (4, 2, 8, *tables)),
        "swiglu": ((gate, up), ()),
        "swiglu_joined": ((torch.cat([gate, up], -1),), ()),
        "add_residual": ((gate, up), (2,)),
    }
    for name, (tensors, rest) in cases.items():
        fn = name.split()[0]
        outs = {}
        for which, fns in (("eager", EAGER), ("compiled", fast)):
            leaves = [t.clone().requires_grad_() for t in tensors]
            out = getattr(fns, fn)(*leaves, *rest)
            out = out if isinstance(out, tuple) else (out,)
            grads = torch.autograd.grad(out, leaves, [torch.ones_like(o) for o in out])
            outs[which] = (out, grads)
        for a, b in zip(*(outs[w][0] + outs[w][1] for w in ("eager", "compiled"))):
            torch.testing.assert_close(b, a, **TOL, msg=lambda s: f"{name}: {s}")
    # The head's loss at tp=1: per-token values where labels count (ignored ones are masked by the head).
    logits = torch.randn(MBS, SEQ, CFG.vocab_size, generator=g)
    labels = torch.randint(0, CFG.vocab_size, (MBS, SEQ), generator=g)
    labels[0, :3] = -100
    keep = (labels != -100).float()
    got = {}
    for which, fns in (("eager", EAGER), ("compiled", fast)):
        leaf = logits.clone().requires_grad_()
        ce = fns.cross_entropy(leaf, labels, 0, None)
        got[which] = (ce * keep, torch.autograd.grad((ce * keep).sum(), leaf)[0])
    for a, b in zip(got["eager"], got["compiled"]):
        torch.testing.assert_close(b, a, **TOL)
    # The vocab-parallel loss's pieces (tp > 1; here one shard [8, V) without its group: labels below it are
    # another shard's): the compiled kernels against the eager ones, values and the logits' gradient.
    shard = logits[..., 8:]
    got = {}
    for which, fns in (("eager", EAGER), ("compiled", fast)):
        leaf = shard.clone().requires_grad_()
        ce = fns.cross_entropy(leaf, labels.clamp(min=0), 8, None)
        got[which] = (ce, torch.autograd.grad(ce.sum(), leaf)[0])
    for a, b in zip(got["eager"], got["compiled"]):
        torch.testing.assert_close(b, a, **TOL)


def test_the_compiled_logits_gradient_writes_only_its_result() -> None:
    """The vocab-parallel loss's backward, compiled, allocates one buffer: the logits' gradient in their dtype
    (``braid.cost.runtime_act.loss_workspace``'s compiled figure at tp > 1), no fp32 softmax of the shard."""
    from torch._inductor.utils import run_and_get_code

    from braid.tp.embedding import ce_row_max

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(16, 48, generator=g).to(torch.bfloat16)
    local, mask = torch.randint(0, 48, (16,), generator=g), torch.rand(16, generator=g) < 0.3
    lmax = ce_row_max(logits)
    args = (logits, lmax, torch.rand(16, generator=g) + 1, local, mask, torch.rand(16, generator=g))
    torch._dynamo.reset()
    out, codes = run_and_get_code(compiled.compiled_ce_kernels().logits_grad, *args)
    allocs = [line.split("=")[1].strip() for code in codes for line in code.splitlines() if "= empty_strided_cpu(" in line]
    assert allocs == ["empty_strided_cpu((16, 48), (48, 1), torch.bfloat16)"], allocs
    assert out.dtype == torch.bfloat16 and out.shape == logits.shape


def _executor_run(schedule: str, m: int, compile: bool, data, device: str = "cpu",
                  dtype: torch.dtype = torch.float32) -> tuple[float, dict[str, torch.Tensor], dict]:
    plan = schedules.build(schedule, 1, m)
    chunks = build_rank_chunks(_model(device, dtype), plan, 0, (1, 1))
    ex = Executor(plan, compile_plan(plan)[0], chunks, pp_ranks=[0], act_shape=(MBS, SEQ, CFG.hidden), compile=compile, dtype=dtype,
                  device=device)
    assert ex.compiled is compile and all(compiled.is_compiled(ch) is compile for ch in chunks.values())
    res = ex.run(*data)
    grads = {f"{c}.{n}": p.grad for c, ch in chunks.items() for n, p in ch.named_parameters()}
    return res.loss, grads, res.counts


def _reference_grads(device: str, dtype: torch.dtype, data, m: int) -> tuple[float, dict[str, torch.Tensor]]:
    """The single-device loss and gradients, by chunk parameter name (tp=1: the chunks copy them)."""
    ref = _model(device, dtype)
    total = 0.0
    for t, lab in zip(*data):
        loss = ref(t, lab) / m
        loss.backward()
        total += loss.item()
    grad_model = copy.deepcopy(ref)
    with torch.no_grad():
        for p, r in zip(grad_model.parameters(), ref.parameters()):
            p.copy_(r.grad)
    plan = schedules.build("braided_v", 1, m)
    chunks = build_rank_chunks(grad_model, plan, 0, (1, 1))
    return total, {f"{c}.{n}": p.detach() for c, ch in chunks.items() for n, p in ch.named_parameters()}


def _check_executor(device: str) -> None:
    """Compiled and eager executor against the reference within ``reference_error.bound``: float32
    against a float64 reference's error (``executor_cases.run_dtype`` of compiled units)."""
    from executor_cases import run_dtype
    from reference_error import assert_matches_reference

    m = 3
    dtype = run_dtype(device, compile=True)
    data = _data(m, device=device)
    total, want = _reference_grads(device, dtype, data, m)
    total64, want64 = (None, {}) if dtype == torch.float64 else _reference_grads(device, torch.float64, data, m)
    scale = max(float(g.abs().max()) for g in want.values())
    from braid.tp import layers as tp_layers

    default_work = tp_layers.JOINT_NATIVE_WORK
    # braided_v's BW ops run joint: plain linears, and (limit 0) every linear adding its
    # weight gradient into .grad during the backward call; zb_v splits B and W.
    for schedule, work in (("braided_v", default_work), ("braided_v", 0), ("zb_v", default_work)):
        tp_layers.JOINT_NATIVE_WORK = work
        try:
            loss, grads, counts = _executor_run(schedule, m, True, data, device, dtype)
            eager_loss, eager_grads, _ = _executor_run(schedule, m, False, data, device, dtype)
        finally:
            tp_layers.JOINT_NATIVE_WORK = default_work
        as_run = lambda x: torch.tensor(x, dtype=dtype)  # noqa: E731 - a loss computed in the run's dtype
        assert_matches_reference(as_run(loss), as_run(total), total64, what=f"{schedule} loss")
        assert_matches_reference(as_run(loss), as_run(eager_loss), total64, what=f"{schedule} loss vs eager")
        assert grads.keys() == want.keys()
        for n, g in grads.items():
            assert_matches_reference(g, want[n], want64.get(n), what=f"{schedule} {n}", scale=scale)
            assert_matches_reference(g, eager_grads[n], want64.get(n), what=f"{schedule} {n} vs eager", scale=scale)
        assert counts["W"] > 0 and (schedule != "braided_v" or counts["braided"] > 0), counts


def test_executor_with_compiled_units_equals_the_reference() -> None:
    _check_executor("cpu")


def _chunk_program(program: list[str], offload: bool, device: str = "cpu") -> tuple[list[torch.Tensor], int]:
    m = 3
    spec = ChunkSpec(CFG.layers, embed=True, head=True)
    ch = build_chunk(_model(device), spec, 0, num_microbatches=m)
    compiled.set_compiled([ch], True)
    ch.set_batch(*_data(m, device=device))
    moved = []

    def reload(op) -> None:
        if offload and op.kind in (OpKind.B, OpKind.BW):
            ch.reload(op.mb)

    def offload_after(text: str, op) -> None:
        if offload and op.kind is OpKind.F:
            moved.append(ch.offload(op.mb))

    drive(ch, spec, program, before_op=reload, after_op=offload_after)
    assert ch.pending_work() == [] and ch.live_bytes() == 0
    return [p.grad for p in ch.parameters()], sum(moved)


@pytest.mark.slow
def test_compiled_units_under_tp_and_pp_equal_the_reference(pools) -> None:
    """Two gloo ranks: TP=2 (all-reduces in place on compiled unit outputs, the vocab-parallel loss
    stays eager) and PP=2 (compiled outputs sent to the next stage); two AdamW steps each."""
    import executor_cases as cases

    for pp, tp in ((1, 2), (2, 1)):
        combos = [("braided_v", 2 * pp + 1), ("zb_h1", 2 * pp + 1)]
        ran = pools(2).run(cases.equivalence, pp, tp, combos, True, timeout_s=600)
        assert {(n, m) for n, m, _ in ran[0]} == set(combos), ran


PROGRAM = ["F0c0", "F1c0", "BW0c0", "F2c0", "B1c0", "W1c0", "BW2c0"]  # one B/W split


def test_compiled_saved_activations_live_in_the_boxes_and_offload_bitwise() -> None:
    plain, _ = _chunk_program(PROGRAM, offload=False)
    moved_grads, moved = _chunk_program(PROGRAM, offload=True)
    assert moved > 0
    for a, b in zip(plain, moved_grads):
        assert torch.equal(a, b)
    # What the compiled norm alone saves goes into the unit's box: parked, its backward is refused.
    ch = build_chunk(_model(), ChunkSpec(1), 0, num_microbatches=1)
    compiled.set_compiled([ch], True)
    x = torch.randn(MBS, SEQ, CFG.hidden, requires_grad=True)
    with ch._saving(0, Unit.PRE_ATTN, 0):
        y = ch.layers[0].norm1(x)
    assert ch._boxes[(0, Unit.PRE_ATTN, 0)].tensors, "the compiled norm saved nothing through the hooks"
    assert ch.offload(0) > 0
    with pytest.raises(ChunkStateError, match="on the host"):
        torch.autograd.grad(y, x, torch.ones_like(y))
    ch.reload(0)
    torch.testing.assert_close(torch.autograd.grad(y, x, torch.ones_like(y))[0],
                               torch.autograd.grad(EAGER.rms_norm(x, ch.layers[0].input_layernorm.weight, CFG.rms_eps), x,
                                                   torch.ones_like(y))[0], **TOL)


def test_compile_switch() -> None:
    assert compiled.resolve(None, "cpu") is False
    assert compiled.resolve(False, "cpu") is False and compiled.resolve(True, "cpu") is True
    with pytest.raises(ValueError, match="--no-compile"):
        compiled.resolve(True, "meta")
    model = _model()
    assert compiled.set_compiled([model], True) == 2 * CFG.layers + CFG.layers + 1  # layers, their 2 norms, the final norm
    assert compiled.is_compiled(model)
    compiled.set_compiled([model], False)
    assert not compiled.is_compiled(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not compiled.available("cuda"), reason="needs CUDA and Triton")
@pytest.mark.timeout(180)  # a cold inductor cache (first compile on the machine) included
def test_compiled_units_on_cuda() -> None:
    """On one GPU (fp32; Triton kernels): the executor equals the reference and the eager executor, and
    offloading compiled activations to pinned host memory (asynchronous copies) changes no gradient."""
    _check_executor("cuda")
    plain, _ = _chunk_program(PROGRAM, offload=False, device="cuda")
    moved_grads, moved = _chunk_program(PROGRAM, offload=True, device="cuda")
    assert moved > 0
    for a, b in zip(plain, moved_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # same kernels on the same values
