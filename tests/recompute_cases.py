"""Cases run inside the gloo processes of ``test_full_recompute.py`` (module-level so they pickle by name)."""

from __future__ import annotations

import torch

from executor_cases import CFG_KW, MBS, SEQ, _data


def full_equals_none_bitwise(ctx, pp: int, tp: int, schedule: str, m: int) -> list[str]:
    """One step of ``schedule`` with and without full recomputation on the same weights and data:
    the names of the parameters whose gradients differ in any bit, and of the losses (empty: equal)."""
    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.core.partition import split_layers
    from braid.runtime.executor import Executor
    from braid.models.build import build_rank_chunks
    from braid.core.topology import Topology

    topo = Topology(ctx.world_size, pp=pp, tp=tp, dp=ctx.world_size // (pp * tp))
    groups = ctx.process_groups(topo)
    c = groups.coords
    plan = schedules.build(schedule, pp, m)
    layers = split_layers(2 * plan.num_stages, plan.num_stages)
    cfg = Qwen2Config(layers=sum(layers), **CFG_KW)
    torch.manual_seed(1234)
    model = Qwen2Model(cfg)
    toks, labs = _data(cfg, m, seed=3)
    got = {}
    for mode in ("none", "full"):
        chunks = build_rank_chunks(model, plan, c.pp, layers, tp_rank=c.tp, tp_size=tp, tp_group=groups.tp)
        for ch in chunks.values():
            ch.set_recompute(mode)
        ex = Executor.from_groups(plan, compile_plan(plan)[c.pp], chunks, groups, ctx.dist.abort,
                                  act_shape=(MBS, SEQ, cfg.hidden), device=ctx.dist.device)
        res = ex.run(toks, labs)
        got[mode] = (res.loss, {f"{ci}.{n}": p.grad.clone() for ci, ch in chunks.items() for n, p in ch.named_parameters()})
    (loss0, g0), (loss1, g1) = got["none"], got["full"]
    bad = [] if loss0 == loss1 else [f"loss {loss0} != {loss1}"]
    return bad + [n for n in g0 if not torch.equal(g0[n], g1[n])]
