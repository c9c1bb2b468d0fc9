"""Cases run inside the gloo processes of ``test_fused.py`` (module-level so they pickle by name)."""

from __future__ import annotations

import torch

from executor_cases import CFG_KW, EPS, LR, MBS, SEQ, _data, run_dtype
from reference_error import adamw_amplify, adamw_cap, assert_matches_reference, loss_amplify

def _run(ctx, groups, plan, layers, cfg, fuse, data, dev, dtype):
    from braid.core.compiler import compile_plan
    from braid.models.qwen2 import Qwen2Model
    from braid.runtime.executor import Executor
    from braid.models.build import build_rank_chunks

    c = groups.coords
    torch.manual_seed(1234)
    chunks = build_rank_chunks(Qwen2Model(cfg).to(dev, dtype), plan, c.pp, layers, tp_rank=c.tp, tp_size=groups.topo.tp,
                               tp_group=groups.tp)
    for ch in chunks.values():
        ch.fuse = fuse
    params = [p for ch in chunks.values() for p in ch.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, eps=EPS)
    ex = Executor.from_groups(plan, compile_plan(plan)[c.pp], chunks, groups, ctx.dist.abort,
                              act_shape=(MBS, SEQ, cfg.hidden), device=dev, dtype=dtype)
    losses, grads = [], []
    for toks, labs in data:
        opt.zero_grad(set_to_none=True)
        res = ex.run(toks, labs)
        losses.append(res.loss)
        grads.append([p.grad.clone() for p in params])
        opt.step()
    return ex, losses, grads, [p.detach().clone() for p in params]


def fused_matches_cut(ctx, pp: int, tp: int, combos: list[tuple[str, int]]) -> list[tuple[str, int, bool, float]]:
    """Each (schedule, m): two AdamW steps with the executor's automatic choice and with the
    cuts forced (``fuse=False``): the same sums in another order, so losses, gradients of both
    steps and parameters after both agree within :func:`reference_error.bound` (float64 on CPU;
    the automatic run is compared with the cut one as with a reference).

    Returns (schedule, m, whether the automatic run was fused, largest gradient difference).
    """
    from braid import schedules
    from braid.models.qwen2 import Qwen2Config
    from braid.core.partition import split_layers
    from braid.core.topology import Topology

    groups = ctx.process_groups(Topology(ctx.world_size, pp=pp, tp=tp))
    dev = ctx.dist.device
    dtype = run_dtype(dev)
    out = []
    for name, m in combos:
        plan = schedules.build(name, pp, m)
        stages = plan.num_stages
        layers = split_layers(2 * stages - 1, stages) if stages > 1 else (2,)
        cfg = Qwen2Config(layers=sum(layers), **CFG_KW)
        data = [_data(cfg, m, seed=s) for s in range(2)]
        auto_ex, auto_losses, auto_grads, auto_params = _run(ctx, groups, plan, layers, cfg, None, data, dev, dtype)
        cut_ex, cut_losses, cut_grads, cut_params = _run(ctx, groups, plan, layers, cfg, False, data, dev, dtype)
        where = f"{name} pp={pp} tp={tp} m={m} rank={ctx.rank}"
        assert not any(cut_ex.fused.values()), f"{where}: fuse=False ran fused"
        fused = set(auto_ex.fused.values())
        assert len(fused) == 1, f"{where}: chunks of one executor in different modes {auto_ex.fused}"
        g_max = max(float(g.abs().max()) for g in cut_grads[0])
        p_max = max(float(p.abs().max()) for p in cut_params)
        # Step 1 starts from parameters that AdamW moved apart by rounding: its drift is amplified.
        drift = adamw_amplify(g_max, lr=LR, eps=EPS, steps=1)
        for step in (0, 1):
            if auto_losses[step] is not None:
                assert_matches_reference(torch.tensor(auto_losses[step], dtype=dtype), torch.tensor(cut_losses[step], dtype=dtype),
                                         what=f"{where} step {step} loss",
                                         amplify=loss_amplify(cut_grads[0], lr=LR, eps=EPS, steps=step))
            for k, (a, b) in enumerate(zip(auto_grads[step], cut_grads[step])):
                assert_matches_reference(a, b, what=f"{where} step {step} grad {k}", scale=g_max, amplify=drift * step)
        worst = max(float((a - b).abs().max()) for a, b in zip(auto_grads[0], cut_grads[0]))
        for k, (a, b) in enumerate(zip(auto_params, cut_params)):
            assert_matches_reference(a, b, what=f"{where} param {k}", scale=p_max,
                                     amplify=adamw_amplify(g_max, lr=LR, eps=EPS, steps=2), cap=adamw_cap(lr=LR, steps=2))
        out.append((name, m, fused.pop(), worst))
    return out


def modes_chosen(ctx, tp: int) -> dict[str, object]:
    """Which mode the executor picks at pp=2 with ``tp``: plain braided_v, braided_v_offload;
    and whether ``fuse=True`` where the cuts are needed is refused with one line."""
    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.core.partition import split_layers
    from braid.runtime.executor import Executor
    from braid.models.build import build_rank_chunks
    from braid.core.topology import Topology

    groups = ctx.process_groups(Topology(ctx.world_size, pp=2, tp=tp))
    c = groups.coords
    layers = split_layers(7, 4)
    cfg = Qwen2Config(layers=sum(layers), **CFG_KW)
    got: dict[str, object] = {}
    for name, opts in (("braided_v", {}), ("braided_v_offload", {"offload_alpha": 0.5, "offload_alpha_warmup": 0.5})):
        plan = schedules.build(name, 2, 5, **opts)
        program = compile_plan(plan)[c.pp]
        chunks = build_rank_chunks(Qwen2Model(cfg), plan, c.pp, layers, tp_rank=c.tp, tp_size=tp, tp_group=groups.tp)
        ex = Executor.from_groups(plan, program, chunks, groups, ctx.dist.abort, act_shape=(MBS, SEQ, cfg.hidden))
        got[name] = sorted(set(ex.fused.values()))
        for ch in chunks.values():
            ch.fuse = True
        try:
            Executor.from_groups(plan, program, chunks, groups, ctx.dist.abort, act_shape=(MBS, SEQ, cfg.hidden))
            got[name + " fuse=True"] = "accepted"
        except ValueError as err:
            got[name + " fuse=True"] = str(err)
    return got
