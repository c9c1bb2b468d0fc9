"""Expert parallelism with the padded all-to-all (``--moe-dispatch padded``) against the single-process model (gloo).

:class:`braid.runtime.expert_parallel.PaddedAllToAllDispatch` sends every expert-parallel peer a
block of C rows (real rows first, zeros after) and reads nothing on the host. The same
equivalence as ``test_moe_pipeline.py``'s (``moe_cases.ep_equivalence``: the step's loss, every
gradient, the parameters after two AdamW steps, float64, within the reference's rounding bound)
at dp=2 x ep=2 (every schedule) and pp=2 x (dp=2, ep=2) (interleaved, braided, DualPipe-V), and with the
compiled unit functions); and one
MoE layer's forward and backward, fp32 through ``torch._grouped_mm``, with every host read of a
tensor made to raise.
"""

from __future__ import annotations

import pytest

import moe_cases as cases

PLAIN = [("1f1b", 3), ("1f1b_i", 4), ("zb_v", 4)]
BRAIDED = [("braided_v", 5), ("braided_v_lowmem", 5), ("braided_v_offload", 5), ("dualpipe_v", 5)]


@pytest.mark.slow
@pytest.mark.parametrize("pp,world", [(1, 2), (2, 4)])
def test_padded_all_to_all_matches_single_process(pools, pp: int, world: int) -> None:
    """Every schedule at dp=2 x ep=2; with pipelining (pp=2, four ranks on a two-core CI machine) the
    interleaved, braided and DualPipe-V ones, whose chunks cross ranks differently."""
    runs = PLAIN + BRAIDED if pp == 1 else [("1f1b_i", 4), ("braided_v", 5), ("dualpipe_v", 5)]
    got = pools(world).run(cases.ep_equivalence, pp, 2, runs, None, 0.2, 1, False, "padded", timeout_s=600)
    assert got == [[f"{n} m={m}" for n, m in runs]] * world


@pytest.mark.slow
def test_padded_all_to_all_with_compiled_units(pools) -> None:
    want = ["1f1b m=3", "braided_v m=5"]
    assert pools(2).run(cases.ep_equivalence, 1, 2, [("1f1b", 3), ("braided_v", 5)], None, 0.2, 1, True, "padded",
                        timeout_s=300) == [want] * 2


def test_padded_exchanges_on_the_copy_engine_staging_match_single_process(pools) -> None:
    """``--ep-backend nccl-ce``: every row exchange staged, all-to-all'd and copied out (gloo runs the
    algorithm; NCCL runs it on the copy engines), the same values as the single process."""
    want = ["1f1b_i m=4", "braided_v m=5"]
    assert pools(2).run(cases.ep_equivalence, 1, 2, [("1f1b_i", 4), ("braided_v", 5)], None, 0.2, 1, False, "padded",
                        "nccl-ce", timeout_s=300) == [want] * 2


@pytest.mark.slow
def test_padded_layer_reads_nothing_on_the_host(pools) -> None:
    padding = pools(2).run(cases.padded_moe_reads_no_host, timeout_s=120)
    assert all(n > 0 for n in padding), padding  # the blocks held padding, which the experts' rows left out


@pytest.mark.parametrize("flags,world,fragment", [
    (["--model", "qwen3-moe-tiny", "--ep", "2", "--moe-dispatch", "ragged"], 2,
     "--moe-dispatch ragged: unknown; valid: splits, padded"),
    (["--model", "qwen3-moe-tiny", "--moe-dispatch", "padded"], 1, "it needs --ep 2 or more (got --ep 1)"),
    (["--model", "qwen3-moe-tiny", "--ep", "2", "--dp", "2", "--tp", "2", "--moe-dispatch", "padded"], 4,
     "--moe-dispatch padded runs at tp=1 only"),
    (["--ep", "2", "--dp", "2", "--moe-dispatch", "padded"], 2, "this model has no experts"),
])
def test_the_examples_refuse_a_dispatcher_that_cannot_run(monkeypatch, capsys, qwen2_main, flags, world, fragment) -> None:
    """One line, exit 2, before any process group (the world size only as the launcher would set it)."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    code = qwen2_main(["--device", "cpu", "--steps", "1", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("qwen2.py: error: ") and fragment in err[0], (code, err)


def test_the_graph_refusal_is_lifted_where_every_dispatcher_is_host_free() -> None:
    """:func:`braid.runtime.graphs.not_capturable` asks each MoE layer's dispatcher (``host_free``): the splits
    dispatcher and the TP slice keep the refusal, which names the way out; the padded one (also behind the
    profiler's counting wrapper) is captured. ``config_reason`` says the same before any work."""
    import torch

    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.measure.experts import CountingDispatch
    from braid.models.build import build_rank_chunks
    from braid.models.moe_dispatch import ExpertSlice
    from braid.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeModel
    from braid.runtime import graphs
    from braid.runtime.executor import Executor
    from braid.runtime.expert_parallel import AllToAllDispatch, ExpertGroups, PaddedAllToAllDispatch, moe_layers

    plan = schedules.build("braided_v", 1, 3)
    cfg = Qwen3MoeConfig(layers=3, **cases.CFG_KW)
    chunks = build_rank_chunks(Qwen3MoeModel(cfg).init_weights(seed=7), plan, 0, (2, 1))
    ex = Executor(plan, compile_plan(plan)[0], chunks, pp_ranks=[0], act_shape=(2, 8, cfg.hidden), record="off")
    ex.device = torch.device("cuda", 0)  # past the device check: what the chunks say
    assert graphs.not_capturable(ex) is None  # ep=1 tp=1: nothing read on the host
    groups = ExpertGroups(2, 0, None, None, 1)  # plan() is never called here: no process group needed
    layers = moe_layers(chunks.values())
    splits = [AllToAllDispatch(groups, cfg.experts), ExpertSlice(0, 2)]
    for how in splits:
        layers[-1].dispatcher = how
        reason = graphs.not_capturable(ex)
        assert reason is not None and "reads its routing counts on the host" in reason and "\n" not in reason, reason
    layers[-1].dispatcher = splits[0]
    assert "--moe-dispatch padded makes the step capturable" in graphs.not_capturable(ex)
    for lay in layers:
        lay.dispatcher = PaddedAllToAllDispatch(groups, cfg.experts, cfg.experts_per_token)
    layers[0].dispatcher = CountingDispatch(layers[0].dispatcher, cfg.experts)
    assert graphs.not_capturable(ex) is None
    assert graphs.config_reason("cuda", ep=2, moe=True, moe_dispatch="padded") is None
    assert "--moe-dispatch padded makes the step capturable" in graphs.config_reason("cuda", ep=2, moe=True)
    assert "reads its routing counts" in graphs.config_reason("cuda", ep=2, tp=2, moe=True, moe_dispatch="padded")
    config = {"device": "cuda", "ep": 2, "moe_dispatch": "padded", "model": {"experts": 4}}
    doc = {"meta": {"config": config}, "host_task_s": 1e-4}
    assert graphs.graphed_costs(doc, None)["meta"]["cuda_graph"] == "step"
