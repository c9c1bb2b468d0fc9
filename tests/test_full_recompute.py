"""Full recomputation under TP and braiding (:mod:`braid.models.full_recompute`).

* tp=2 x pp=2 on 4 gloo processes, braided_v and 1f1b_i: loss, every gradient and the
  parameters after two AdamW steps equal the single-process reference (the executor's
  equivalence case), and every rank's measured peak is below the same run's without
  recomputation; loss and gradients are bitwise those of the run without recomputation;
* the cost transform (:func:`braid.cost.costs.full_recompute`): backward time up by the layer's
  forward and its forward all-reduce, saved bytes down to the layer input; the simulator's
  peak drops by what the transform removes.
"""

from __future__ import annotations

import pytest

import executor_cases as cases
import recompute_cases

COMBOS = [("braided_v", 8), ("1f1b_i", 8)]


@pytest.mark.slow
def test_full_recomputation_at_tp2_pp2_matches_the_reference_and_lowers_the_peak(pools) -> None:
    pool = pools(4)
    full = pool.run(cases.equivalence, 2, 2, COMBOS, None, None, "full", timeout_s=600)
    none = pool.run(cases.equivalence, 2, 2, COMBOS, None, None, "none", timeout_s=600)
    for rank, (f, n) in enumerate(zip(full, none)):
        assert [(a, b) for a, b, _ in f] == COMBOS, f"rank {rank} ran {f}"
        for (name, _, cf), (_, _, cn) in zip(f, n):
            assert cf["braided"] == cn["braided"] and cf["AR"] == cn["AR"] and (name != "braided_v" or cf["braided"] > 0)
            assert cf["peak_bytes"] < cn["peak_bytes"], f"rank {rank} {name}: {cf['peak_bytes']} !< {cn['peak_bytes']}"


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["braided_v", "1f1b_i"])
def test_full_recomputation_at_tp2_pp2_is_bitwise_the_run_without(pools, schedule: str) -> None:
    """The re-run applies the same operators to the same inputs (the Attn sum over TP ranks included):
    every gradient and the loss equal those without recomputation in every bit."""
    bad = pools(4).run(recompute_cases.full_equals_none_bitwise, 2, 2, schedule, 8, timeout_s=300)
    assert bad == [[]] * 4, bad


def test_cost_transform_matches_what_the_runtime_keeps() -> None:
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
    full = analytic_costs(model, hw, layout, activations="runtime", recompute="full")
    a, b = base.chunks[(0, 1)].units, full.chunks[(0, 1)].units
    layer_f = sum(a[u].f for u in (Unit.PRE_ATTN, Unit.ATTN, Unit.PRE_MLP, Unit.MLP))
    assert b[Unit.MLP].b == pytest.approx(a[Unit.MLP].b + layer_f + a[Unit.ATTN].ar_f)  # the re-run and its all-reduce
    for u in (Unit.PRE_ATTN, Unit.ATTN, Unit.PRE_MLP):
        assert b[u].b == a[u].b and b[u].f == a[u].f
    tokens_h = model.seq * model.micro_batch_size * model.hidden * model.dtype_bytes
    assert b[Unit.PRE_ATTN].act == tokens_h and b[Unit.ATTN].act == b[Unit.PRE_MLP].act == b[Unit.MLP].act == 0
    rerun = sum(a[u].act for u in (Unit.PRE_ATTN, Unit.ATTN, Unit.PRE_MLP, Unit.MLP)) - tokens_h
    assert b[Unit.MLP].tmp == rerun  # the re-run's activations, live while the MLP's backward runs
    progs = compile_plan(plan)
    r0, r1 = simulate(progs, base, name="none").report, simulate(progs, full, name="full").report
    assert r1.step_time_s > r0.step_time_s
    for rep0, rep1 in zip(r0.ranks, r1.ranks):
        assert rep1.peak_activation_bytes < rep0.peak_activation_bytes


def test_the_runtime_keeps_what_the_cost_model_says() -> None:
    """A layer's forward under full recomputation keeps the bytes ``analytic_costs(..., activations="runtime",
    recompute="full")`` charges its units (fp32 on CPU)."""
    import torch

    from braid.core.braiding import ChunkSpec, Phase, Unit, UnitTask
    from braid.cost.costs import Layout, analytic_costs
    from braid.cost.hardware import get_hardware
    from braid.models.build import build_chunk
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.cost.catalog import ModelConfig

    b, s, h = 2, 16, 32
    cfg = Qwen2Config(vocab_size=64, hidden=h, layers=1, heads=4, kv_heads=2, ffn=64)
    ch = build_chunk(Qwen2Model(cfg), ChunkSpec(1, head=True), 0, num_microbatches=1)
    ch.set_recompute("full")
    ch.set_batch([torch.randint(0, 64, (b, s))], [torch.randint(0, 64, (b, s))])
    ch.set_input(0, torch.randn(b, s, h))
    for unit in (Unit.PRE_ATTN, Unit.ATTN, Unit.PRE_MLP, Unit.MLP):
        ch.run(0, UnitTask(Phase.F, unit, 0))
    model = ModelConfig("t", layers=2, hidden=h, heads=4, kv_heads=2, ffn=64, vocab=64, seq=s, micro_batch_size=b,
                        dtype_bytes=4)
    units = analytic_costs(model, get_hardware("h200"), Layout(1, 2, 1, "loop"), activations="runtime",
                           recompute="full").chunks[(0, 0)].units
    assert ch.live_bytes() == sum(units[u].act for u in (Unit.PRE_ATTN, Unit.ATTN, Unit.PRE_MLP, Unit.MLP))


@pytest.mark.slow
def test_the_example_trains_with_full_recomputation_like_the_unsplit_model() -> None:
    """The planner's ``--recompute full`` flag through the example scripts (tp=2 x pp=2, gloo): the LLM, and the
    VLM whose LM chunks rotate by M-RoPE positions (its vision chunk keeps its activations)."""
    from test_examples import COMMON, LLM, VLM, _ok, _torchrun

    for script in (LLM, VLM):
        proc = _torchrun(4, script, *COMMON, "--tp", "2", "--pp", "2", "--steps", "2", "--recompute", "full", "--reference",
                         "--schedule", "braided_v", "1f1b_i", timeout=600, forked=True)
        _ok(proc)
        assert "norm diff" in proc.stdout and "braided_v" in proc.stdout and "1f1b_i" in proc.stdout
