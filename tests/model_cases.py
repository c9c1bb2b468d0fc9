"""Cases run inside the gloo processes of ``test_model_seam.py`` (module-level so they pickle by name)."""

from __future__ import annotations

import torch

from executor_cases import EPS, LR, MBS, SEQ, _data, _reference_of, run_dtype

CFG_KW = dict(vocab_size=64, hidden=32, heads=4, kv_heads=2, ffn=64)
FLOAT32_FAMILIES = {"mcore_gpt"}


def family_equivalence(ctx, family: str, tie: bool, pp: int, tp: int, schedules_ms: list[tuple[str, int]],
                       meta: bool = False) -> list[str]:
    """Two AdamW steps of each (schedule, m) against the single-process model of ``family``:
    losses, every gradient (the tied embedding's is the sum of its two uses) and the parameters,
    within :func:`reference_error.bound` (float64 on CPU).

    ``meta``: build the chunks from a meta-device model (by-name init), the reference from
    the same rule on one device.
    """
    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.models.build import build_rank_chunks, meta_model
    from braid.models.registry import get_family
    from braid.models.tied import tie_of
    from braid.core.partition import split_layers
    from braid.runtime.distributed import reduce_gradients
    from braid.runtime.executor import Executor
    from braid.core.topology import Topology

    fam = get_family(family)
    topo = Topology(ctx.world_size, pp=pp, tp=tp)
    groups = ctx.process_groups(topo)
    c = groups.coords
    # megatron-core's model rounds some of its internals to float32 even with float64 weights
    # (~1e-9 from float64 math): it runs in float32 against a float64 reference's error.
    dtype = torch.float32 if family in FLOAT32_FAMILIES else run_dtype(ctx.dist.device)
    ran = []
    for name, m in schedules_ms:
        plan = schedules.build(name, pp, m)
        stages = plan.num_stages
        layers = split_layers(2 * stages - 1, stages) if stages > 1 else (2,)
        cfg = fam.config_cls(layers=sum(layers), tie_embeddings=tie, **CFG_KW)
        model = fam.model_cls(cfg).init_weights(seed=7).to(dtype)
        steps_data = [tuple(list(x) for x in _data(cfg, m, seed=s)) for s in range(2)]
        ref = _reference_of(model, steps_data, (family, tie, cfg.layers, m, dtype))  # once per model, m and data
        src = meta_model(fam.model_cls, cfg, seed=7, dtype=dtype) if meta else model
        chunks = build_rank_chunks(src, plan, c.pp, layers, tp_rank=c.tp, tp_size=tp, tp_group=groups.tp)
        shard = lambda whole: build_rank_chunks(whole, plan, c.pp, layers, tp_rank=c.tp, tp_size=tp)  # noqa: E731
        params = [p for ch in chunks.values() for p in ch.parameters()]
        assert sum(tie_of(p) is not None for p in params) == (sum(ch.spec.embed + ch.spec.head for ch in chunks.values()) if tie else 0)
        opt = torch.optim.AdamW(params, lr=LR, eps=EPS)
        ex = Executor.from_groups(plan, compile_plan(plan)[c.pp], chunks, groups, ctx.dist.abort, act_shape=(MBS, SEQ, cfg.hidden),
                                  dtype=dtype)
        where = f"{family} tie={tie} {name} pp={pp} tp={tp} m={m} rank={ctx.rank}"
        for step, (toks, labs) in enumerate(steps_data):
            opt.zero_grad(set_to_none=True)
            res = ex.run(toks, labs)
            reduce_gradients(params, groups, ctx.dist.abort)
            if res.loss is not None:
                ref.check_loss(res.loss, step, where)
            if step == 0:
                ref.check_grads(chunks, shard, where)
            opt.step()
        ref.check_params(chunks, shard, where)
        ran.append(f"{name} m={m}")
    return ran


def save_distributed(ctx, family: str, tie: bool, pp: int, tp: int, schedule: str, path: str) -> bool:
    """Chunks of a pp x tp layout saved with braid.hf.save_chunks load back as the single-device model."""
    import braid.hf as bhf
    from braid import schedules
    from braid.models.build import build_rank_chunks
    from braid.models.registry import get_family
    from braid.core.partition import split_layers
    from braid.core.topology import Topology

    fam = get_family(family)
    groups = ctx.process_groups(Topology(ctx.world_size, pp=pp, tp=tp))
    c = groups.coords
    plan = schedules.build(schedule, pp, 2 * pp)
    layers = split_layers(2 * plan.num_stages - 1, plan.num_stages)
    cfg = fam.config_cls(layers=sum(layers), tie_embeddings=tie, **CFG_KW)
    model = fam.model_cls(cfg).init_weights(seed=5)
    chunks = build_rank_chunks(model, plan, c.pp, layers, tp_rank=c.tp, tp_size=tp, tp_group=groups.tp)
    bhf.save_chunks(chunks, cfg, fam, path, groups)
    back = bhf.load(path)
    assert type(back) is type(model) and back.cfg == cfg
    for (n, p), (_, q) in zip(model.named_parameters(), back.named_parameters()):
        assert torch.equal(p, q), n
    return True
