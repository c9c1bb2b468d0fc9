"""``braid.bench`` / ``braid.profile`` on a mixture of experts at expert parallelism (``--ep``): gloo jobs of
real spawned processes (ep=2 at world 2, pp=2 x ep=2 at world 4), the cost file they write read by
``braid.simulate``, and the pieces those jobs are made of (routing counts, the imbalance rescale, the
CUDA-graph refusal, the layout's MoE chunk specs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from braid.bench import main as bench_main
from braid.cost.catalog import get_model
from braid.measure.config import ProfileConfig
from braid.measure.experts import CountingDispatch, routing_summary
from braid.models.shapes import decoder_config

MOE = decoder_config(get_model("qwen3-moe-tiny"), layers=1)  # 4 experts, top-2, hidden 32
FAST = ["--seq", "8", "--steps", "1", "--warmup", "1", "--iters", "1", "--no-external", "--schedule", "braided_v", "1f1b_i"]


def _bench(tmp_path: Path, name: str, *argv: str) -> dict:
    out = tmp_path / f"{name}.json"
    assert bench_main(["--model", "qwen3-moe-tiny", "--device", "cpu", *FAST, "--json", str(out), *argv]) == 0
    return json.loads(out.read_text())


def _check_moe_summary(doc: dict, pp: int, ep: int, m: int, seq: int = 8) -> None:
    runs = {r["schedule"]: r for r in doc["runs"]}
    assert set(runs) == {"braided_v", "1f1b_i"}
    for r in runs.values():
        assert r["step_s"] > 0 and r["predicted_step_s"] > 0 and len(r["peak_bytes"]) == pp
        assert r["a2a_predicted_s"] > 0 and r["a2a_measured_s"] > 0  # the a2a lane and the recorded exchanges
        assert 0 <= r["a2a_exposed_predicted_s"] <= r["a2a_predicted_s"]
        rt = r["routing"]  # every replica's tokens, each routed to k=2 experts, in each of the 2*pp MoE layers
        assert sum(rt["tokens_per_expert"]) == ep * m * seq * 2 * (2 * pp) == sum(rt["rows_per_ep_rank"])
        assert rt["ep_imbalance"] >= 1 and rt["expert_imbalance"] >= rt["ep_imbalance"] - 1e-9
    prof = doc["profile"]
    assert prof["meta"]["comm"]["a2a_s"] > 0 and prof["meta"]["comm"]["a2a_bytes"] == seq * 2 * 32 * 4  # T*k rows of hidden 32, fp32
    assert prof["meta"]["moe"]["ep"] == ep and prof["meta"]["moe"]["imbalance"] >= 1
    assert all(c["T_A2A"] > 0 and c["unit_split"]["F"]["experts"] > 0 for c in prof["chunks"].values())
    assert "a2a_scale" in prof["meta"]["calibration"]
    assert doc["config"]["ep"] == ep


def test_bench_at_ep2_runs_braid_schedules_and_its_profile_drives_the_simulator(tmp_path, capsys) -> None:
    from braid.simulate import main as simulate_main

    doc = _bench(tmp_path, "ep2", "--pp", "1", "--ep", "2", "--mbs", "4")
    out = capsys.readouterr().out
    assert "ep=2 (dp=2)" in out and "expert load (m=4" in out and "all-to-all per step" in out
    _check_moe_summary(doc, pp=1, ep=2, m=4)
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps(doc["profile"]))
    sim = ["--model", "qwen3-moe-tiny", "--layers", "2", "--seq", "8", "--tp", "1", "--pp", "1", "--dp", "2", "--ep", "2",
           "--mbs", "4", "--costs", str(costs), "--schedule", "1f1b_i", "--json"]
    steps = {}
    for f, extra in ((1.0, []), (3.0, ["--moe-imbalance", "3"])):
        assert simulate_main([*sim, str(tmp_path / f"sim{f}.json"), *extra]) == 0
        steps[f] = json.loads((tmp_path / f"sim{f}.json").read_text())["schedules"]["1f1b_i"]
    profiled = doc["profile"]["meta"]["moe"]["imbalance"]
    assert f"moe imbalance {profiled:.3f} as profiled" in capsys.readouterr().out
    # the busiest rank's rows at 3 x the mean: its all-to-alls 3 / profiled times as long, the step no shorter
    assert steps[3.0]["a2a_s"] == pytest.approx(steps[1.0]["a2a_s"] * 3 / profiled) and steps[1.0]["a2a_s"] > 0
    assert steps[3.0]["step_time_s"] >= steps[1.0]["step_time_s"]


def test_bench_at_pp2_x_ep2_runs_on_four_ranks(tmp_path) -> None:
    doc = _bench(tmp_path, "pp2ep2", "--pp", "2", "--ep", "2", "--mbs", "4", "--probe-mbs", "2")
    _check_moe_summary(doc, pp=2, ep=2, m=4)


def test_routing_summary_counts_tokens_per_expert_and_rows_per_device() -> None:
    # two replicas' counts of two layers, 4 experts over ep=2 devices (experts 0-1 on device 0)
    got = routing_summary([{0: [3, 1, 2, 2], 1: [4, 0, 0, 4]}, {0: [1, 1, 2, 2], 1: [0, 4, 4, 0]}, None], ep=2, tp=1)
    assert got["tokens_per_expert"] == [8, 6, 8, 8] and got["per_layer"]["0"] == [4, 2, 4, 4]
    assert got["rows_per_ep_rank"] == [14, 16]
    assert got["ep_imbalance"] == pytest.approx((8 / 7 + 1) / 2) and got["ep_imbalance_max"] == pytest.approx(8 / 7)
    assert got["expert_imbalance"] == pytest.approx((8 / 7 + 1) / 2)
    assert routing_summary([None, {}], ep=2, tp=1) is None
    counter = CountingDispatch(type("Local", (), {"moves": False, "plan": lambda self, c, rows=None: c})(), 4)
    for c in ([1, 0, 2, 1], [0, 3, 0, 1]):
        counter.plan(torch.tensor(c))
    assert counter.total.tolist() == [1, 3, 2, 2] and counter.moves is False


def test_profile_config_at_ep_runs_replicas_and_names_the_moe_layers() -> None:
    from braid.core.braiding import Unit

    pc = ProfileConfig(MOE, (1, 1, 1, 1), seq=8, pp=2, ep=2)
    assert (pc.dp, pc.world_size, pc.moe_layers) == (2, 4, (0, 1, 2, 3))
    assert all(Unit.EXPERTS in {u for u, _ in s.layer_units()} for s in pc.specs("v").values())
    a, _ = pc.micro_batches(1, torch.device("cpu"), dp_rank=0)
    b, _ = pc.micro_batches(1, torch.device("cpu"), dp_rank=1)
    assert not torch.equal(a[0], b[0])  # each replica reads its own micro-batches
    with pytest.raises(ValueError, match="--ep 3 must divide the model's 4 experts"):
        ProfileConfig(MOE, (1, 1), seq=8, pp=1, ep=3)


def test_moe_steps_at_ep_or_tp_above_1_are_refused_as_cuda_graphs_and_say_why() -> None:
    from braid.runtime.graphs import config_reason

    assert "reads its routing counts on the host" in config_reason("cuda", ep=2, moe=True)
    assert "reads its routing counts on the host" in config_reason("cuda", tp=2, moe=True)
    assert config_reason("cuda", ep=1, moe=True) is None and config_reason("cuda", ep=2) is None


def test_rescale_imbalance_scales_the_profiles_experts_and_all_to_alls() -> None:
    from braid.core.braiding import Unit
    from braid.cost.costs import Layout, costs_from_dict
    from braid.cost.moe_costs import rescale_imbalance

    pc = ProfileConfig(MOE, (1, 1), seq=8, pp=1)
    doc = {"format": "braid-costs/1", "meta": {"moe": {"imbalance": 1.5}},
           "chunks": {"0": {"T_F": 1.0, "T_B": 1.0, "T_W": 1.0, "T_AR": 0.0, "T_A2A": 0.3}, "1": {"T_F": 1.0, "T_B": 1.0, "T_W": 1.0, "T_AR": 0.0}}}
    costs = costs_from_dict(doc, Layout(1, 1, 2, "v"), pc.specs("v"))
    out, profiled = rescale_imbalance(costs, 3.0)
    assert profiled == 1.5
    before, after = costs.chunks[(0, 0)], out.chunks[(0, 0)]
    assert after.total("a2a_f") == pytest.approx(2 * before.total("a2a_f")) and before.total("a2a_f") == pytest.approx(0.3)
    assert after.units[Unit.EXPERTS].f == pytest.approx(2 * before.units[Unit.EXPERTS].f)
    assert after.units[Unit.ATTN] == before.units[Unit.ATTN]
    assert rescale_imbalance(costs, 1.5)[0] is costs
