"""Selective activation recomputation: the same loss and gradients (bitwise), fewer saved bytes,
offload still moves the (fewer) saved tensors; the cost model's transform says the same."""

from __future__ import annotations

import pytest
import torch

from braid.core.braiding import ChunkSpec
from braid.core.ir import OpKind
from braid.models.build import build_chunk
from braid.models.qwen2 import Qwen2Config, Qwen2Model
from chunk_driver import drive

PROGRAM = ["F0c0", "F1c0", "B0c0", "F2c0&B1c0", "W1c0", "W0c0", "BW2c0"]  # braided block and split W included


def _run(mode: str, offload_mb: int | None = None):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64)
    model = Qwen2Model(cfg)
    g = torch.Generator().manual_seed(1)
    toks = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(3)]
    labs = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(3)]
    spec = ChunkSpec(cfg.layers, embed=True, head=True)
    ch = build_chunk(model, spec, 0, num_microbatches=len(toks))
    ch.set_recompute(mode)
    ch.set_batch(toks, labs)
    moved = 0

    def offload_after(text: str, op) -> None:
        nonlocal moved
        if op.kind is OpKind.F and op.mb == offload_mb:
            moved = ch.offload(op.mb)
        if offload_mb is not None and text == "F1c0":
            assert ch.reload(offload_mb) == moved

    _, peak = drive(ch, spec, PROGRAM, after_op=offload_after)
    assert ch.pending_work() == [] and ch.live_bytes() == 0
    grads = {n: p.grad.clone() for n, p in ch.named_parameters()}
    return sum(float(x) for x in ch.losses.values()), grads, peak, moved


def test_selective_recomputation_keeps_loss_and_gradients_bitwise() -> None:
    loss0, g0, peak0, _ = _run("none")
    loss1, g1, peak1, _ = _run("selective")
    assert loss0 == loss1 and loss0 > 0
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n
    assert peak1 < peak0, (peak1, peak0)


def test_recomputation_saves_what_the_attention_core_kept_and_the_mlp_keeps_gate_and_up() -> None:
    """One forward of one layer: the saved bytes drop by the core's extra tensors; the MLP keeps gate and
    up under both modes, not silu(gate) nor the product (``braid.tp.swiglu_down``)."""
    from braid.core.braiding import Phase, Unit, UnitTask

    sizes = {}
    for mode in ("none", "selective"):
        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=64, hidden=32, layers=1, heads=4, kv_heads=2, ffn=64)
        ch = build_chunk(Qwen2Model(cfg), ChunkSpec(1, embed=True), 0, num_microbatches=1)
        ch.set_recompute(mode)
        ch.set_batch([torch.randint(0, 64, (2, 16))], [torch.randint(0, 64, (2, 16))])
        got = {}
        for unit in (Unit.EMBED, Unit.PRE_ATTN, Unit.ATTN, Unit.PRE_MLP, Unit.MLP):
            before = ch.live_bytes()
            ch.run(0, UnitTask(Phase.F, unit, -1 if unit is Unit.EMBED else 0))
            got[unit] = ch.live_bytes() - before
        sizes[mode] = got
    none, sel = sizes["none"], sizes["selective"]
    assert none[Unit.MLP] == sel[Unit.MLP] == 2 * (2 * 16 * 64 * 4)  # gate and up: (b, s, ffn) fp32 each
    assert sel[Unit.ATTN] < none[Unit.ATTN]
    assert none[Unit.PRE_ATTN] == sel[Unit.PRE_ATTN] and none[Unit.PRE_MLP] == sel[Unit.PRE_MLP]


def test_offload_moves_the_recomputed_units_inputs_and_gradients_stay_bitwise() -> None:
    _, g0, _, _ = _run("selective")
    _, g1, _, moved = _run("selective", offload_mb=0)
    assert moved > 0
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


def test_full_recomputation_keeps_loss_and_gradients_bitwise_and_saves_the_most() -> None:
    loss0, g0, peak0, _ = _run("none")
    loss_s, _, peak_s, _ = _run("selective")
    loss1, g1, peak1, _ = _run("full")
    assert loss0 == loss1 == loss_s and loss0 > 0
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n
    assert peak1 < peak_s < peak0, (peak1, peak_s, peak0)


def test_full_recomputation_keeps_only_each_layers_input() -> None:
    """One forward of one layer: the layer's units save nothing but the input (b, s, h)."""
    from braid.core.braiding import Phase, Unit, UnitTask

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden=32, layers=1, heads=4, kv_heads=2, ffn=64)
    ch = build_chunk(Qwen2Model(cfg), ChunkSpec(1, embed=True), 0, num_microbatches=1)
    ch.set_recompute("full")
    assert ch.choose_fused() is False and "full recomputation" in ch.cut_reason()
    ch.set_batch([torch.randint(0, 64, (2, 16))], [torch.randint(0, 64, (2, 16))])
    ch.run(0, UnitTask(Phase.F, Unit.EMBED, -1))
    before = ch.live_bytes()
    for unit in (Unit.PRE_ATTN, Unit.ATTN, Unit.PRE_MLP, Unit.MLP):
        ch.run(0, UnitTask(Phase.F, unit, 0))
    assert ch.live_bytes() - before == 2 * 16 * 32 * 4  # the layer input (b, s, h) fp32, nothing else
    ch2 = build_chunk(Qwen2Model(cfg), ChunkSpec(1, head=True), 0, num_microbatches=1)
    ch2.set_recompute("full")
    ch2.set_batch([torch.randint(0, 64, (2, 16))], [torch.randint(0, 64, (2, 16))])
    ch2.set_input(0, torch.randn(2, 16, 32))
    for unit in (Unit.PRE_ATTN, Unit.ATTN, Unit.PRE_MLP, Unit.MLP):
        ch2.run(0, UnitTask(Phase.F, unit, 0))
    assert ch2.live_bytes() == 2 * 16 * 32 * 4  # the received input, fp32


def test_offload_moves_a_fully_recomputed_layers_input_and_gradients_stay_bitwise() -> None:
    _, g0, _, _ = _run("full")
    _, g1, _, moved = _run("full", offload_mb=0)
    assert moved > 0
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


def test_cost_model_transform_adds_backward_time_and_removes_saved_bytes() -> None:
    from braid import schedules
    from braid.core.braiding import Unit
    from braid.core.compiler import compile_plan
    from braid.cost.costs import Layout, analytic_costs
    from braid.cost.hardware import get_hardware
    from braid.cost.catalog import get_model
    from braid.simulator import simulate

    model, hw = get_model("qwen2-7b"), get_hardware("h200")
    plan = schedules.build("braided_v", 2, 8)
    layout = Layout(2, plan.p, plan.v, plan.placement)
    base = analytic_costs(model, hw, layout, activations="runtime")
    sel = analytic_costs(model, hw, layout, activations="runtime", recompute="selective")
    a, b = base.chunks[(0, 0)].units, sel.chunks[(0, 0)].units
    assert b[Unit.ATTN].b > a[Unit.ATTN].b and b[Unit.ATTN].act < a[Unit.ATTN].act
    assert b[Unit.MLP] == a[Unit.MLP]  # the runtime keeps gate and up either way
    assert b[Unit.ATTN].f == a[Unit.ATTN].f and b[Unit.PRE_ATTN] == a[Unit.PRE_ATTN]
    assert sel.ma_bytes == base.ma_bytes  # the yardstick does not move
    progs = compile_plan(plan)
    r0, r1 = simulate(progs, base, name="none").report, simulate(progs, sel, name="selective").report
    assert r1.step_time_s > r0.step_time_s
    assert r1.worst_peak.peak_activation_bytes < r0.worst_peak.peak_activation_bytes
    k0, k1 = (analytic_costs(model, hw, layout, recompute=r).chunks[(0, 0)].units for r in ("none", "selective"))
    assert k1[Unit.ATTN].act == k0[Unit.ATTN].act and k1[Unit.MLP].act < k0[Unit.MLP].act  # Korthikanti: no softmax term
    with pytest.raises(ValueError, match="recompute must be one of none, selective, full"):
        analytic_costs(model, hw, layout, recompute="partial")
