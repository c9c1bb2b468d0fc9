"""``braid.profile``: config validation, and a real 2-rank CPU profile read back as a cost model."""

from __future__ import annotations

import pytest

from braid.core.braiding import OpKind, Unit, unit_tasks
from braid.cost.costs import Layout, costs_from_dict
from braid.models.qwen2 import Qwen2Config
from braid.core.partition import chunk_specs
from braid.profile import main
from braid.measure.config import PRESETS
from braid.measure.config import ProfileConfig
from braid.measure.units import profile

TINY = PRESETS["tiny"]


def test_bad_configs_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="pp\\*v = 4 stages"):
        ProfileConfig(TINY, (1, 1, 1), pp=2)
    with pytest.raises(ValueError, match="tp=3 must divide"):
        ProfileConfig(TINY, (1, 1), tp=3, pp=1)
    with pytest.raises(ValueError, match="dtype"):
        ProfileConfig(TINY, (1, 1), pp=1, dtype="fp8")
    with pytest.raises(ValueError, match="needs CUDA"):
        ProfileConfig(TINY, (1, 1), pp=1, tp=2, tp_backend="symm-mem")
    with pytest.raises(SystemExit) as ex:
        main(["--preset", "huge"])
    assert ex.value.code == 2


def _forward_live_bytes(cfg: ProfileConfig, stage: int) -> int:
    """Saved bytes after one forward of ``stage``'s chunk, measured here in one process."""
    import torch

    from braid.core.ir import Plan, ScheduleConfig, rank_chunk_of
    from braid.models.qwen2 import Qwen2Model
    from braid.models.build import build_rank_chunks

    plan = Plan("t", ScheduleConfig(cfg.pp, 1, cfg.v), cfg.placement, tuple(() for _ in range(cfg.pp)))
    rank, c = rank_chunk_of(cfg.placement, cfg.pp, stage)
    torch.manual_seed(0)
    ch = build_rank_chunks(Qwen2Model(cfg.full_model()), plan, rank, cfg.layers_per_stage)[c]
    tok = torch.randint(0, cfg.model.vocab_size, (cfg.micro_batch_size, cfg.seq))
    ch.set_batch([tok], [tok])
    if not ch.spec.embed:
        ch.set_input(0, torch.randn(cfg.act_shape()))
    for t in unit_tasks(OpKind.F, ch.spec):
        ch.run(0, t)
    return ch.live_bytes()


def test_cpu_profile_is_a_cost_file_for_any_placement() -> None:
    cfg = ProfileConfig(Qwen2Config(vocab_size=64, hidden=32, layers=1, heads=4, kv_heads=2, ffn=64), (1, 2, 1, 1),
                        seq=8, pp=2, iters=2)
    doc = profile(cfg)
    assert doc["format"] == "braid-costs/1" and sorted(doc["chunks"]) == ["0", "1", "2", "3"]
    assert doc["meta"]["comm"]["p2p_s"] > 0 and doc["pcie_bytes_per_s"] > 0
    assert doc["copy_duplex_slowdown"] == 1.0  # CPU copies are synchronous: they never overlap
    assert doc["ar_stretch"] == 1.0  # measured on GPU only
    assert doc["meta"]["tp_backend"] == "gloo" and doc["host_task_s"] == 0.0  # host lane: GPU only
    for placement in ("v", "loop"):
        specs = chunk_specs(cfg.layers_per_stage, 2, placement)
        costs = costs_from_dict(doc, Layout(1, 2, 2, placement), specs)
        for cc in costs.chunks.values():
            assert cc.total("f") > 0 and cc.total("b") > 0 and cc.total("w") > 0
            assert cc.total("ar_f") == 0  # tp = 1
    for stage in range(4):
        entry = doc["chunks"][str(stage)]
        assert entry["activation_bytes"] == pytest.approx(_forward_live_bytes(cfg, stage), rel=1e-9)
        # what B leaves for W: a subset of the forward's bytes, plus the SwiGLU product B remade for the
        # down-projection's weight gradient (braid.tp.swiglu_down; fp32, one per layer)
        product = cfg.seq * cfg.micro_batch_size * cfg.model.ffn * 4 * cfg.layers_per_stage[stage]
        assert 0 < entry["w_residual_bytes"] <= entry["activation_bytes"] + product
    # stage 1 has two layers: its forward keeps more than stage 2's one layer
    assert doc["chunks"]["1"]["activation_bytes"] > doc["chunks"]["2"]["activation_bytes"]


def test_the_device_hold_before_a_phase_stays_bounded_when_the_phase_waits_on_the_device() -> None:
    """A phase that reads the device on the host (routing counts) waits through the hold before it: its
    issue time is taken without that wait, so the hold settles at twice the phase's own time instead of
    doubling every iteration; a phase the host issues ahead of the device keeps its measured time."""
    from braid.measure.units import hold_for, issue_time

    work, issue = 0.05, None  # the device's time up to the phase's host read
    holds = []
    for _ in range(8):
        held = hold_for(issue)
        holds.append(held)
        issue = issue_time(held + work, held, cuda=True)  # the host waited for the hold and the work
    assert holds[-1] == pytest.approx(hold_for(work), rel=1e-12) == holds[-2]  # a few float sums' rounding
    assert max(holds) < 3 * work
    assert issue_time(0.004, hold_for(0.003), cuda=True) == 0.004  # issued ahead of the device: as measured
    assert issue_time(0.2, 0.1, cuda=False) == 0.2  # CPU: no hold


def test_a_units_negative_forward_figure_keeps_the_chunks_total() -> None:
    # Under sequence sharding a unit's forward frees the gathered input its predecessor's follow made (counted
    # there): its allocator delta is negative. The chunk's activation total is the sum of the deltas, spread over
    # the units whose figures are not negative; read as 0, the freed buffer would be counted twice.
    from braid.core.braiding import ChunkSpec
    from braid.measure.units import _unit_costs

    mib = 2**20
    fwd = {"embed": 84 * mib, "pre_attn": -20 * mib, "attn": 100 * mib, "pre_mlp": 90 * mib, "mlp": 70 * mib}
    bwd = {"embed": -84 * mib, "pre_attn": -10 * mib, "attn": -60 * mib, "pre_mlp": -70 * mib, "mlp": -70 * mib}
    spec = ChunkSpec(layers=2, embed=True)
    mem = [[ph, u, layer, b] for layer in (0, 1) for ph, d in (("F", fwd), ("B", bwd)) for u, b in d.items()
           if u != "embed" or layer == 0]
    times = [[ph, u, layer, 1e-3] for ph, u, layer, _ in mem]
    got = _unit_costs([{"times": times, "mem": mem, "work": []}], spec, ar_s=0.0)
    count = {"embed": 1, "pre_attn": 2, "attn": 2, "pre_mlp": 2, "mlp": 2}
    total = sum(got[Unit(u)].act * n for u, n in count.items())
    assert total == pytest.approx(84 * mib + 2 * (-20 + 100 + 90 + 70) * mib)
    assert got[Unit.PRE_ATTN].act == 0.0 and all(c.act >= 0 for c in got.values())
    kept = sum(got[Unit(u)].w_res * n for u, n in count.items())  # what the backward leaves for W: the same rule
    assert kept == pytest.approx(2 * (-30 + 40 + 20 + 0) * mib)
