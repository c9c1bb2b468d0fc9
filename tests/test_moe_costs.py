"""The MoE cost model: routed-expert FLOPs, expert parallelism's all-to-alls, expert parameters per rank.

What :mod:`braid.cost.moe_costs` and :mod:`braid.cost.cluster` charge an MoE layer, checked against
its formulas, against a dense model's costs (which ``ep``/``moe_imbalance`` must leave alone),
against what a CPU chunk of the runtime's Qwen3-MoE layer saves, and through ``braid.simulate``.
"""

from __future__ import annotations

import json

import pytest

from braid.core.braiding import Unit
from braid.cost.catalog import MODELS
from braid.cost.cluster import (Cluster, Parallel, chunk_param_parts, dp_costs, job_costs, moe_layout, reduce_time,
                                static_bytes)
from braid.cost.costs import Layout, analytic_costs, costs_to_dict, model_forward_flops
from braid.cost.hardware import get_hardware, ring_s
from braid.cost.moe_costs import MoeLayout, a2a_per_rank

HW = get_hardware("h200")
MOE = MODELS["qwen3-moe-30b-a3b"]
DENSE = MODELS["qwen2-12b"]


def _mlp_units(model=MOE, t=1, par: Parallel | None = None, gpus_per_node=8, **kw):
    par = par or Parallel(t, 1, 1)
    costs = analytic_costs(model, HW, Layout(t, 1, 1), moe=moe_layout(Cluster(HW, gpus_per_node), par), **kw)
    return costs.chunks[(0, 0)].units


def _layer_a2a(units) -> tuple[float, float]:
    """All-to-all seconds of one MoE layer's forward and backward (its units' ends)."""
    return tuple(sum(getattr(units[u], attr) for u in (Unit.PRE_MLP, Unit.EXPERTS, Unit.MLP)) for attr in ("a2a_f", "a2a_b"))


def test_a_dense_model_is_priced_as_before_whatever_moe_says() -> None:
    """ep 1 and any MoeLayout leave a dense model's units, job costs and data-parallel tail as they were."""
    lay = Layout(2, 4, 2, "v")
    plain = costs_to_dict(analytic_costs(DENSE, HW, lay))
    assert costs_to_dict(analytic_costs(DENSE, HW, lay, moe=MoeLayout(imbalance=1.7, a2a_bytes_per_s=1e9))) == plain
    mlp = analytic_costs(DENSE, HW, lay).chunks[(0, 0)].units[Unit.MLP]
    tok, t = DENSE.tokens, 2
    assert mlp.f == 2 * tok * DENSE.ffn * DENSE.hidden / t / HW.matmul_flops and mlp.a2a_f == mlp.a2a_b == 0.0
    cl, costs = Cluster(HW, 8), analytic_costs(DENSE, HW, lay)
    a, b = dp_costs(DENSE, costs, cl, Parallel(2, 4, 8)), dp_costs(DENSE, costs, cl, Parallel(2, 4, 8, ep=1))
    assert (a.reduce_s, a.step_s, a.gather_s, a.static_bytes, a.step_bytes) == (b.reduce_s, b.step_s, b.gather_s,
                                                                               b.static_bytes, b.step_bytes)
    assert costs_to_dict(job_costs(DENSE, cl, Parallel(2, 4, 1), lay)) == costs_to_dict(job_costs(DENSE, cl, Parallel(2, 4, 1, ep=1), lay))


@pytest.mark.parametrize("t", [1, 2, 4])
def test_the_mlp_side_follows_top_k_routed_rows_and_the_router(t: int) -> None:
    """Experts: 6 * T * k / t * h * moe_ffn FLOPs in F, B and W (gate, up, down); Pre-MLP: the router, whole on
    every TP rank (2 * T * h * E, not divided by t); MLP (the combine): none, the dense layer's all-reduce."""
    u = _mlp_units(t=t)
    tok, h, f, k, e = MOE.tokens, MOE.hidden, MOE.moe_ffn, MOE.experts_per_token, MOE.experts
    experts = 6 * tok * k / t * h * f
    for attr in ("f", "b", "w"):
        assert getattr(u[Unit.EXPERTS], attr) * HW.matmul_flops == pytest.approx(experts, rel=1e-12)
        assert getattr(u[Unit.PRE_MLP], attr) * HW.matmul_flops == pytest.approx(2 * tok * h * e, rel=1e-12)
        assert getattr(u[Unit.MLP], attr) == 0.0
    assert u[Unit.MLP].ar_f == u[Unit.ATTN].ar_f and u[Unit.EXPERTS].ar_f == u[Unit.EXPERTS].ar_b == 0.0
    more = _mlp_units(MOE.with_(experts=256), t=t)  # more experts, same top-k: the same expert FLOPs
    assert more[Unit.EXPERTS].f == u[Unit.EXPERTS].f and more[Unit.PRE_MLP].f == 2 * u[Unit.PRE_MLP].f
    wider = _mlp_units(MOE.with_(experts_per_token=2 * k), t=t)
    assert wider[Unit.EXPERTS].f == pytest.approx(2 * u[Unit.EXPERTS].f, rel=1e-12)


def test_model_flops_count_the_active_experts() -> None:
    half = MOE.with_(experts_per_token=MOE.experts_per_token // 2)
    diff = model_forward_flops(MOE) - model_forward_flops(half)
    assert diff == pytest.approx(MOE.layers * 6 * MOE.tokens * half.experts_per_token * MOE.hidden * MOE.moe_ffn, rel=1e-9)


def test_all_to_all_is_priced_on_the_expert_group_link() -> None:
    """ep=8 of a node of 8 stays on NVLink, ep=16 crosses nodes (NIC); the bytes: T * k / t * h * dtype. The
    dispatch ends Pre-MLP's forward, the combine Experts'; backward, the combine's ends MLP's, the dispatch's Experts'."""
    units = _mlp_units(par=Parallel(1, 1, 16, ep=8))
    inside, across = _layer_a2a(units), _layer_a2a(_mlp_units(par=Parallel(1, 1, 16, ep=16)))
    assert 0 < inside[1] < across[1] and inside[0] < across[0]
    nbytes = MOE.tokens * MOE.experts_per_token * MOE.hidden * MOE.dtype_bytes
    rows = ring_s(nbytes, 8, HW.ar_bus_bytes_per_s, HW.ar_latency_s)
    assert inside[1] == 2 * rows and across[1] == 2 * ring_s(nbytes, 16, HW.inter_node_bytes_per_s, HW.inter_node_latency_s)
    counts = ring_s(8 * MOE.experts, 8, HW.ar_bus_bytes_per_s, HW.ar_latency_s)  # the int64 row counts, forward only
    assert (units[Unit.PRE_MLP].a2a_f, units[Unit.EXPERTS].a2a_f) == (counts + rows, rows)
    assert (units[Unit.MLP].a2a_b, units[Unit.EXPERTS].a2a_b, units[Unit.PRE_MLP].a2a_b) == (rows, rows, 0.0)
    local = _mlp_units()  # the all-to-alls are not part of the units' compute
    assert all(getattr(units[u], a) == getattr(local[u], a) for u in (Unit.PRE_MLP, Unit.EXPERTS, Unit.MLP) for a in "fbw")
    # the EP group is ep consecutive DP ranks, tp * cp * pp apart: at pp=2, ep=8 spans two nodes
    strided = _layer_a2a(_mlp_units(par=Parallel(1, 2, 16, ep=8)))
    assert Parallel(1, 2, 16, ep=8).ep_link() == (8, 2) and strided[1] > inside[1]


def test_imbalance_scales_the_busiest_ranks_experts_and_bytes() -> None:
    even = _mlp_units(par=Parallel(1, 1, 8, ep=8))[Unit.EXPERTS]
    skew = _mlp_units(par=Parallel(1, 1, 8, ep=8, moe_imbalance=1.5))[Unit.EXPERTS]
    lat = HW.ar_latency_s
    assert skew.w == pytest.approx(1.5 * even.w, rel=1e-12)  # expert compute
    assert skew.a2a_b - lat == pytest.approx(1.5 * (even.a2a_b - lat), rel=1e-12)  # all-to-all bytes (one row exchange)
    # on one rank every token's k rows run there whatever the routing: nothing to skew
    assert _mlp_units(par=Parallel(1, 1, 8, moe_imbalance=1.5)) == _mlp_units(par=Parallel(1, 1, 8))


def test_padded_exchanges_price_ep_blocks_of_the_most_one_peer_can_get() -> None:
    """--moe-dispatch padded: each row all-to-all moves ep blocks of T * min(k, E/ep) rows whatever the imbalance;
    the experts' FLOPs stay the routed rows', their buffers (saved inputs, W stash) the padded rows'."""
    for ep in (2, 8, 32):  # E/ep = 64, 16, 4 against k = 8: the block is T*k until a peer holds fewer than k experts
        splits = _mlp_units(par=Parallel(1, 1, 32, ep=ep))
        for imbalance in (1.0, 1.5):
            padded = _mlp_units(par=Parallel(1, 1, 32, ep=ep, moe_imbalance=imbalance, moe_dispatch="padded"))
            link = moe_layout(Cluster(HW, 8), Parallel(1, 1, 32, ep=ep))
            block = MOE.tokens * min(MOE.experts_per_token, MOE.experts // ep)
            rows = ring_s(ep * block * MOE.hidden * MOE.dtype_bytes, ep, link.a2a_bytes_per_s, link.a2a_latency_s)
            assert padded[Unit.EXPERTS].a2a_f == padded[Unit.MLP].a2a_b == rows
            held = ep * block / (MOE.tokens * MOE.experts_per_token)  # padded rows over the balanced routed ones
            assert padded[Unit.EXPERTS].w_res == pytest.approx(held * splits[Unit.EXPERTS].w_res, rel=1e-12)
            assert padded[Unit.EXPERTS].w == pytest.approx(imbalance * splits[Unit.EXPERTS].w, rel=1e-12)
    with pytest.raises(ValueError, match="runs at tp=1 only"):
        from braid.io.cli import check_moe_dispatch

        check_moe_dispatch("padded", ep=2, tp=2)


def test_expert_parameters_per_rank_fall_as_one_over_ep() -> None:
    costs = analytic_costs(MOE, HW, Layout(2, 4, 1))
    total = sum(chunk_param_parts(MOE, costs, 0, 0, 1))
    dense, experts = chunk_param_parts(MOE, costs, 0, 0, 8)
    layers = costs.chunks[(0, 0)].spec.layers
    assert experts == layers * MOE.expert_params() / (2 * 8)  # E/(t*ep) whole experts per rank
    assert dense + 8 * experts == pytest.approx(total, rel=1e-12)
    states = [static_bytes(MOE, costs, Parallel(2, 4, 16, ep=ep), 0) for ep in (1, 2, 4, 8, 16)]
    assert states == sorted(states, reverse=True) and states[-1] < states[0] / 3


def test_expert_gradients_reduce_over_the_expert_data_parallel_group() -> None:
    """At ep = dp every rank holds experts of its own: only the other parameters are reduced over dp."""
    costs = analytic_costs(MOE, HW, Layout(1, 4, 1))
    cl = Cluster(HW, 8)
    assert Parallel(1, 4, 16, ep=4).edp_link() == (4, 16)
    one, full = Parallel(1, 4, 16, optimizer="master"), Parallel(1, 4, 16, ep=16, optimizer="master")
    dense, _ = chunk_param_parts(MOE, costs, 0, 0, 16)
    assert reduce_time(MOE, costs, cl, full, 0, 0) == cl.all_reduce(4 * dense, 16, 4)  # fp32 gradients, dense only
    assert reduce_time(MOE, costs, cl, full, 0, 0) < reduce_time(MOE, costs, cl, one, 0, 0)
    dc = dp_costs(MOE, costs, cl, Parallel(1, 4, 16, ep=4))
    assert all(s > 0 for s in dc.step_bytes) and len(dc.static_bytes) == 4


def test_full_recomputation_runs_the_all_to_alls_again() -> None:
    par = Parallel(1, 1, 8, ep=8)
    base, full = _mlp_units(par=par), _mlp_units(par=par, recompute="full")
    rerun = sum(base[u].f + base[u].a2a_f for u in (Unit.PRE_ATTN, Unit.ATTN, Unit.PRE_MLP, Unit.EXPERTS, Unit.MLP))
    assert full[Unit.MLP].b == pytest.approx(base[Unit.MLP].b + rerun + base[Unit.ATTN].ar_f, rel=1e-12)
    assert _layer_a2a(full) == _layer_a2a(base)  # the re-run's all-to-alls block inside MLP's backward
    costs = analytic_costs(MOE, HW, Layout(1, 2, 1), moe=moe_layout(Cluster(HW, 8), par))
    layers = [costs.chunks[(r, 0)].spec.layers for r in range(2)]
    assert a2a_per_rank(costs, 3) == [pytest.approx(3 * n * sum(_layer_a2a(base))) for n in layers]


def test_refusals() -> None:
    with pytest.raises(ValueError, match="must divide the data-parallel ranks"):
        Parallel(1, 1, 4, ep=3)
    with pytest.raises(ValueError, match="cp=1 only"):
        Parallel(1, 1, 4, cp=2, ep=2)
    with pytest.raises(ValueError, match="--moe-imbalance must be a number >= 1"):
        Parallel(1, 1, 4, moe_imbalance=0.9)
    with pytest.raises(ValueError, match="is dense"):
        analytic_costs(DENSE, HW, Layout(1, 1, 1), moe=MoeLayout(ep=2))
    with pytest.raises(ValueError, match=r"--ep 3 x --tp 2 \(6\) must divide the 128 experts"):
        analytic_costs(MOE, HW, Layout(2, 1, 1), moe=MoeLayout(ep=3))


def test_the_runtime_keeps_what_the_moe_cost_model_says() -> None:
    """Pre-MLP, Experts and MLP of a Qwen3-MoE layer's forward on CPU (fp32, tp=1) keep the bytes
    ``analytic_costs(..., activations="runtime")`` charges them."""
    import torch

    from braid.core.braiding import ChunkSpec, Phase, UnitTask
    from braid.models.build import build_chunk
    from braid.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeModel

    for b, s, h, e, k, f in ((2, 16, 32, 4, 2, 16), (1, 32, 64, 8, 3, 48)):
        cfg = Qwen3MoeConfig(vocab_size=64, hidden=h, layers=1, heads=4, kv_heads=2, ffn=64, experts=e,
                             experts_per_token=k, moe_ffn=f)
        torch.manual_seed(0)
        ch = build_chunk(Qwen3MoeModel(cfg), ChunkSpec(1, head=True), 0, num_microbatches=1)
        ch.set_batch([torch.randint(0, 64, (b, s))], [torch.randint(0, 64, (b, s))])
        ch.set_input(0, torch.randn(b, s, h))
        kept = {}
        for unit in (Unit.PRE_ATTN, Unit.ATTN, Unit.PRE_MLP, Unit.EXPERTS, Unit.MLP):
            before = ch.live_bytes()
            ch.run(0, UnitTask(Phase.F, unit, 0))
            kept[unit] = ch.live_bytes() - before
        model = MOE.with_(layers=2, hidden=h, heads=4, kv_heads=2, ffn=64, vocab=64, seq=s, micro_batch_size=b, dtype_bytes=4,
                          head_size=0, experts=e, experts_per_token=k, moe_ffn=f)
        units = analytic_costs(model, HW, Layout(1, 2, 1), activations="runtime").chunks[(0, 0)].units
        side = (Unit.PRE_MLP, Unit.EXPERTS, Unit.MLP)
        assert [kept[u] for u in side] == [units[u].act for u in side]


def test_simulate_runs_an_expert_parallel_moe_end_to_end(tmp_path, capsys) -> None:
    from braid.simulate import main

    out = tmp_path / "r.json"
    assert main(["--model", "qwen3-moe-30b-a3b", "--tp", "1", "--pp", "4", "--mbs", "8", "--dp", "16", "--ep", "8",
                 "--schedule", "1f1b", "--schedule", "zb_v", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ep=8" in text.splitlines()[0] and "note: expert-parallel all-to-alls (ep=8" in text
    doc = json.loads(out.read_text())
    assert doc["config"]["ep"] == 8
    for rep in doc["schedules"].values():  # plain schedules: every all-to-all is waited for
        assert 0 < rep["a2a_share"] < 1 and rep["a2a_s"] > 0 and 0 < rep["a2a_exposed_s"] <= rep["a2a_s"]
    assert main(["--model", "qwen3-moe-30b-a3b", "--tp", "1", "--pp", "4", "--mbs", "8", "--schedule", "1f1b"]) == 0
    assert "all-to-all" not in capsys.readouterr().out  # ep 1: the experts are local


def test_the_planner_keeps_a_given_ep_where_it_divides_dp() -> None:
    from braid.planner.search import Problem, layouts, search

    prob = Problem(MOE, 32, Cluster(HW, 8), 64, HW.memory_bytes, ep=8)
    lays = list(layouts(prob))
    assert lays and all(p.ep == 8 and p.dp % 8 == 0 and p.cp == 1 and MOE.experts % (8 * p.tp) == 0 for p in lays)
    dense_dps = {p.dp for p in layouts(Problem(MOE, 32, Cluster(HW, 8), 64, HW.memory_bytes))}
    assert {p.dp for p in lays} == {d for d in dense_dps if d % 8 == 0}
    res = search(prob, top=1, max_simulations=20)
    assert res.best and res.best[0].cand.par.ep == 8
