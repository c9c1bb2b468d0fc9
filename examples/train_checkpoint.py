"""Checkpoints of the example loop (``torch.distributed.checkpoint``): model shards, optimizer state, progress."""

from __future__ import annotations

from typing import Any

import torch


def checkpoint_state(chunks: dict, plan: Any, pp_rank: int, tp_rank: int, opt: torch.optim.Optimizer, progress: dict) -> dict:
    """Checkpoint contents: keys name (stage, tp rank, parameter), so shards never collide across ranks.

    ``opt``: a torch optimizer or a :class:`braid.training.step.Optimization`. A sharded one
    (fp32 masters) contributes its state dict by parameter name -- whole tensors gathered
    over the data-parallel ranks (a collective), loaded back with its ``load_state_dict``.
    """
    from braid.training.optimizer import ShardedAdamW

    opt = getattr(opt, "optimizer", opt)
    model, optim = {}, {}
    if isinstance(opt, ShardedAdamW):
        model = {f"stage{plan.stage_of(pp_rank, c)}.tp{tp_rank}.{n}": p for c, ch in chunks.items() for n, p in ch.named_parameters()}
        return {"model": model, "optim": opt.state_dict(), "progress": progress}
    for c, ch in chunks.items():
        for n, p in ch.named_parameters():
            key = f"stage{plan.stage_of(pp_rank, c)}.tp{tp_rank}.{n}"
            model[key] = p
            st = opt.state[p]
            if not st:  # before the first step: create AdamW's state so a load can fill it in place
                st.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            optim[key] = {k: st[k] for k in ("step", "exp_avg", "exp_avg_sq")}
    return {"model": model, "optim": optim, "progress": progress}
