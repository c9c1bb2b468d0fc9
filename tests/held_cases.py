"""Cases run inside the gloo processes of ``test_held_bytes.py`` (module-level so they pickle by name)."""

from __future__ import annotations

import torch


def _keep_attn_output_twice(ch) -> None:
    """A fault to be caught: every forward of the attention unit keeps a copy of the unit's output
    (the residual stream after it) until its micro-batch's backward ends."""
    run, end_backward = ch.run, ch.end_backward
    kept: dict[int, list[torch.Tensor]] = {}

    def leaky_run(mb, task):
        out = run(mb, task)
        if task.phase.value == "F" and task.unit.value == "attn":
            kept.setdefault(mb, []).append((out if out is not None else ch._fwd[mb][0]).detach().clone())
        return out

    def leaky_end_backward(mb):
        end_backward(mb)
        kept.pop(mb, None)

    ch.run, ch.end_backward = leaky_run, leaky_end_backward


def held_bytes(ctx, pp: int, tp: int, m: int, names: list[str], leaky: tuple[str, ...] = ()) -> dict[str, dict]:
    """Each schedule of ``names`` on the tiny preset (one layer per virtual stage, fp32), one step measured
    by :func:`braid.measure.held_bytes.held_per_microbatch` after one warm-up step: ``name -> {(chunk, mb,
    point): bytes}`` of this rank. Schedules in ``leaky`` run with :func:`_keep_attn_output_twice`."""
    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.core.topology import Topology
    from braid.measure.config import PRESETS, ProfileConfig, build_chunks
    from braid.measure.held_bytes import held_per_microbatch
    from braid.runtime.executor import Executor

    groups = ctx.process_groups(Topology(ctx.world_size, pp=pp, tp=tp))
    dev = torch.device("cpu")
    out = {}
    for name in names:
        plan = schedules.build(name, pp, m)
        pc = ProfileConfig(PRESETS["tiny"], (1,) * (pp * plan.v), tp=tp, pp=pp, v=plan.v, placement=plan.placement)
        chunks = build_chunks(pc, groups, dev, m=m, plan=plan)
        if name in leaky:
            for ch in chunks.values():
                _keep_attn_output_twice(ch)
        program = compile_plan(plan)[groups.coords.pp]
        ex = Executor.from_groups(plan, program, chunks, groups, ctx.dist.abort, act_shape=pc.act_shape(), device=dev)
        toks, labs = pc.micro_batches(m, dev)
        out[name] = held_per_microbatch(ex, toks, labs).held
    return out
