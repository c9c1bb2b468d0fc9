"""Cost model sanity: FLOPs and times of known layers, presets, cost-file round trip and errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

from braid.core.braiding import ChunkSpec, Unit
from braid.cost.costs import (CostFileError, Layout, analytic_costs, costs_from_dict, read_costs, uniform_costs,
                         write_costs)
from braid.cost.hardware import get_hardware
from braid.cost.catalog import get_model


def test_mlp_and_allreduce_of_a_qwen2_7b_layer_match_the_h200_measurements():
    c = analytic_costs(get_model("qwen2-7b"), get_hardware("h200"), Layout(2, 4, 2, "v"))
    u = c.chunks[(1, 0)].units
    # DESIGN.md: TP=2 MLP forward at 4096 tokens 1.34 ms; AR of 4096x3584 bf16 0.12 ms.
    assert u[Unit.PRE_MLP].f + u[Unit.MLP].f == pytest.approx(1.34e-3, rel=0.02)
    assert u[Unit.MLP].ar_f == pytest.approx(0.12e-3, rel=0.02)
    # The MLP's matmul FLOPs: 3 matmuls of 2 * tokens * hidden * ffn, split over t=2.
    flops = 3 * 2 * 4096 * 3584 * 18944 / 2
    assert (u[Unit.PRE_MLP].f + u[Unit.MLP].f) * get_hardware("h200").matmul_flops == pytest.approx(flops)


def test_tp1_has_no_allreduce_and_activation_follows_korthikanti():
    m = get_model("qwen2-7b")
    c = analytic_costs(m, get_hardware("h100"), Layout(1, 2, 1))
    units = c.chunks[(1, 0)].units
    assert all(units[u].ar_f == units[u].ar_b == 0.0 for u in units)
    per_layer = sum(units[u].act for u in (Unit.PRE_ATTN, Unit.ATTN, Unit.PRE_MLP, Unit.MLP))
    assert per_layer == pytest.approx(m.seq * m.hidden * (10 + 24 / 1))  # bf16, s*b*h*(10 + 24/t)


def test_presets_have_the_papers_sizes():
    assert get_model("qwen2-12b").params() == pytest.approx(12.1e9, rel=0.01)
    assert get_model("qwen2-vl-15b").params() == pytest.approx(14.9e9, rel=0.015)
    assert get_model("qwen2-7b").params() == pytest.approx(7.6e9, rel=0.01)


def test_mllm_puts_the_vit_alone_on_the_first_stage_and_lightens_the_last():
    c = analytic_costs(get_model("qwen2-vl-7b"), get_hardware("h200"), Layout(2, 4, 2, "v"))
    first, last = c.chunks[(0, 0)], c.chunks[(0, 1)]
    assert first.spec == ChunkSpec(32, embed=True, merge=True) and last.spec.head  # as the runtime's vision chunk
    assert Unit.MERGE in first.instances() and first.units[Unit.MERGE].f > 0
    mid = c.chunks[(1, 0)].spec.layers
    assert last.spec.layers <= mid - 1
    assert first.units[Unit.MLP].f < c.chunks[(1, 0)].units[Unit.MLP].f  # ViT layers are narrower


def test_unknown_presets_list_the_valid_names():
    with pytest.raises(ValueError, match="qwen2-12b"):
        get_model("llama")
    with pytest.raises(ValueError, match="h200"):
        get_hardware("tpu")


def test_cost_file_round_trip(tmp_path):
    lay = Layout(2, 2, 2, "v")
    c = dataclasses.replace(analytic_costs(get_model("qwen2-1.5b"), get_hardware("a800"), lay), copy_duplex_slowdown=1.25,
                            ar_stretch=1.6)
    path = tmp_path / "costs.json"
    write_costs(c, path)
    back = read_costs(path, lay, {k: v.spec for k, v in c.chunks.items()})
    for key, cc in c.chunks.items():
        for u in cc.instances():
            a, b = cc.units[u], back.chunks[key].units[u]
            for f in ("f", "b", "w", "ar_f", "ar_b", "act", "w_res"):
                assert getattr(b, f) == pytest.approx(getattr(a, f), rel=1e-9, abs=1e-15), (key, u, f)
        assert back.chunks[key].p2p == pytest.approx(cc.p2p)
    assert back.ma_bytes == pytest.approx(c.ma_bytes) and back.peak_flops == c.peak_flops
    assert back.copy_duplex_slowdown == 1.25 and back.pcie_bytes_per_s == c.pcie_bytes_per_s
    assert back.ar_stretch == 1.6


def test_uniform_form_spreads_evenly_and_stage_keys_override():
    lay = Layout(2, 2, 1)
    specs = {(0, 0): ChunkSpec(2, embed=True), (1, 0): ChunkSpec(2, head=True)}
    d = {"T_F": 1.0, "T_B": 2.0, "T_W": 1.0, "T_AR": 0.25, "T_P2P": 0.0, "chunks": {"1": {"T_F": 3.0}}}
    c = costs_from_dict(d, lay, specs)
    first = c.chunks[(0, 0)]
    assert first.total("f") == pytest.approx(1.0) and first.total("ar_f") == pytest.approx(0.25)
    assert first.units[Unit.ATTN].f == pytest.approx(1.0 / 9)  # embed + 8 layer units
    assert first.units[Unit.ATTN].ar_f == pytest.approx(0.25 / 5)  # embed, 2x attn, 2x mlp
    assert c.chunks[(1, 0)].total("f") == pytest.approx(3.0) and c.chunks[(1, 0)].total("b") == pytest.approx(2.0)
    assert first.total("act") == pytest.approx(c.ma_bytes)


@pytest.mark.parametrize("bad,match", [
    ({"T_B": 1, "T_W": 1, "T_AR": 0}, "missing 'T_F'"),
    ({"T_F": -1, "T_B": 1, "T_W": 1, "T_AR": 0}, "'T_F' must be a finite number"),
    ({"T_F": 1, "T_B": 1, "T_W": 1, "T_AR": 0, "T_X": 3}, "unknown keys"),
    ({"T_F": 1, "T_B": 1, "T_W": 1, "T_AR": 0, "chunks": {"9,9": {}}}, "not in the layout"),
    ({"T_F": 1, "T_B": 1, "T_W": 1, "T_AR": 0, "chunks": {"a": {}}}, "'rank,chunk' or a stage"),
    ({"T_F": 1, "T_B": 1, "T_W": 1, "T_AR": 0, "unit_split": {"F": {"attn": 1}}}, "lacks unit 'pre_attn'"),
    ({"format": "other", "T_F": 1}, "format"),
    ({"T_F": 1, "T_B": 1, "T_W": 1, "T_AR": 0, "copy_duplex_slowdown": 3}, r"'copy_duplex_slowdown' must be a finite number in \[1, 2\]"),
    ({"T_F": 1, "T_B": 1, "T_W": 1, "T_AR": 0, "ar_stretch": 0.5}, r"'ar_stretch' must be a finite number in \[1, 4\]"),
])
def test_bad_cost_files_get_one_clear_error(bad, match):
    with pytest.raises(CostFileError, match=match):
        costs_from_dict(bad, Layout(1, 1, 1), {(0, 0): ChunkSpec(1)})


def test_unreadable_cost_files(tmp_path):
    lay, specs = Layout(1, 1, 1), {(0, 0): ChunkSpec(1)}
    with pytest.raises(CostFileError, match="no such cost file"):
        read_costs(tmp_path / "missing.json", lay, specs)
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(CostFileError, match="not valid JSON"):
        read_costs(p, lay, specs)
    p.write_text(json.dumps({"T_F": 1, "T_B": 1, "T_W": 1, "T_AR": 0}))
    assert read_costs(p, lay, specs).chunks[(0, 0)].total("w") == pytest.approx(1.0)


def test_uniform_costs_helper_and_layout_errors():
    c = uniform_costs(Layout(1, 1, 1), {(0, 0): ChunkSpec(1)}, T_F=2.0, T_B=2.0, T_W=1.0, T_AR=0.0)
    assert c.chunks[(0, 0)].total("b") == pytest.approx(2.0)
    with pytest.raises(ValueError, match="V placement"):
        Layout(1, 2, 1, "v")
    with pytest.raises(ValueError, match="tp=3"):
        analytic_costs(get_model("qwen2-7b"), get_hardware("h200"), Layout(3, 2, 1))
