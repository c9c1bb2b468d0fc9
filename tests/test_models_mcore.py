"""braid's schedules drive a megatron-core GPT model (:mod:`braid.models.mcore`), exactly.

In 2 gloo ranks: braided_v (and 1f1b_i) on :class:`~braid.models.mcore.McoreGPT` chunks --
megatron-core's TransformerLayer weights behind braid's units -- give the single-process
megatron-core model's losses, every gradient and the parameters after two AdamW steps
(at tp=1 x pp=2 and tp=2 x pp=1); the trained chunks' state loads back into a megatron-core
``GPTModel`` (names, fused layouts) whose logits equal the single-process trained model's,
and its ``sharded_state_dict`` covers every tensor. Skipped without megatron-core.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install -e '.[megatron]')")

import model_cases as cases  # noqa: E402


def test_adapter_is_a_stage_model_with_megatron_names(pools) -> None:
    assert pools(2).run(_case_structure) == [True, True]


def _case_structure(ctx) -> bool:
    from braid.models.mcore import McoreConfig, McoreGPT, McoreUnitLayer
    from braid.models.registry import family_of
    from braid.models.seam import StageModel, UnitLayer

    model = McoreGPT(McoreConfig(**cases.CFG_KW, layers=2)).init_weights(3)
    assert isinstance(model, StageModel) and family_of(model).name == "mcore_gpt"
    assert model.layers[0] is model.gpt.decoder.layers[0]
    assert {n for n, _ in model.named_parameters()} == {
        "embed_tokens.weight", "norm.weight", "lm_head.weight",
        *(f"layers.{i}.{n}" for i in range(2) for n in (
            "input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
            "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"))}
    shard = model.shard_layer(model.layers[1], 1, 2)
    assert isinstance(shard, McoreUnitLayer) and isinstance(shard, UnitLayer)
    qkv = model.layers[1].self_attention.linear_qkv.weight
    assert torch.equal(shard.self_attention.linear_qkv.weight, qkv[qkv.shape[0] // 2:])  # the second KV group
    fc1 = model.layers[1].mlp.linear_fc1.weight
    assert torch.equal(shard.mlp.linear_fc1.up.weight, fc1[96:])  # ffn 64: up rows 64.., TP rank 1's half
    return True


@pytest.mark.parametrize("pp,tp,runs", [(2, 1, [("braided_v", 4), ("1f1b_i", 4)]), (1, 2, [("braided_v", 2)])])
def test_braid_schedules_on_megatron_model_match_single_process(pools, pp, tp, runs) -> None:
    got = pools(2).run(cases.family_equivalence, "mcore_gpt", False, pp, tp, runs, timeout_s=300)
    assert all(r == [f"{n} m={m}" for n, m in runs] for r in got)


def test_checkpoint_loads_back_into_megatron_core(pools) -> None:
    assert pools(2).run(_case_checkpoint, timeout_s=300) == [True, True]


def _case_checkpoint(ctx) -> bool:
    import torch.distributed as dist

    from braid.baselines import megatron_gpt as bm
    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.models.build import build_rank_chunks, chunk_state
    from braid.models.mcore import McoreConfig, McoreGPT, gpt_state
    from braid.runtime.distributed import reduce_gradients
    from braid.runtime.executor import Executor
    from braid.core.topology import Topology
    from executor_cases import EPS, LR, MBS, SEQ, Reference, _data
    from reference_error import assert_matches_reference

    groups = ctx.process_groups(Topology(2, pp=2, tp=1))
    cfg = McoreConfig(**cases.CFG_KW, layers=4)
    model = McoreGPT(cfg).init_weights(9)
    plan = schedules.build("braided_v", 2, 4)
    data = [tuple(list(x) for x in _data(cfg, 4, seed=s)) for s in range(2)]
    ref = Reference.run(model, data)  # float32 and float64 (see model_cases.FLOAT32_FAMILIES)
    chunks = build_rank_chunks(model, plan, groups.coords.pp, (1, 1, 1, 1))
    params = [p for ch in chunks.values() for p in ch.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, eps=EPS)
    ex = Executor.from_groups(plan, compile_plan(plan)[groups.coords.pp], chunks, groups, ctx.dist.abort,
                              act_shape=(MBS, SEQ, cfg.hidden))
    for toks, labs in data:
        opt.zero_grad(set_to_none=True)
        ex.run(toks, labs)
        reduce_gradients(params, groups, ctx.dist.abort)
        opt.step()
    mine = {k: v for ch in chunks.values() for k, v in chunk_state(ch).items()}
    parts: list = [None] * 2
    dist.all_gather_object(parts, mine)
    state = gpt_state({k: v for p in parts for k, v in p.items()})
    gpt = bm.gpt_model(cfg, bm.transformer_config(cfg), seq_len=SEQ)
    gpt.load_state_dict(state, strict=True)
    toks = data[0][0][0]
    with torch.no_grad():
        got = gpt(toks, torch.arange(SEQ).expand(toks.shape), None).float()
        # The reference's own float32 error after the same two AdamW steps bounds the drift.
        assert_matches_reference(got, ref.trained.logits(toks), ref.trained64.logits(toks), what="logits after two AdamW steps")
    sharded = gpt.sharded_state_dict()
    assert {k for k in gpt.state_dict() if not k.endswith("_extra_state")} <= set(sharded)
    return True


@pytest.mark.slow
def test_braided_v_on_megatron_model_tp2_pp2(pools) -> None:
    runs = [("braided_v", 4)]
    assert pools(4).run(cases.family_equivalence, "mcore_gpt", False, 2, 2, runs, timeout_s=300) == [["braided_v m=4"]] * 4
