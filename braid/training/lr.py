"""Learning-rate schedules: linear warm-up, then cosine or linear decay to a floor.

``lr(step) = lr_max * factor(step)`` for the 0-based index of the step about to run:

* warm-up, ``step < warmup``: ``(step + 1) / warmup`` -- the first step already moves;
* decay over the remaining ``total - warmup`` steps from 1 to ``min_lr / lr_max``:
  cosine (``min + (1 - min) * (1 + cos(pi * t)) / 2``), linear, or constant (no decay);
* after ``total`` steps: the floor.

:func:`build_scheduler` wraps it in :class:`torch.optim.lr_scheduler.LambdaLR`, whose
``state_dict`` (the step count) goes into a checkpoint so a resumed run continues the
schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DECAYS = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class LRSchedule:
    """Warm-up + decay as a multiplier of the peak learning rate (a picklable ``lr_lambda``; no slots:
    ``LambdaLR.state_dict`` saves its ``__dict__``)."""

    total: int
    warmup: int = 0
    decay: str = "cosine"
    min_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.decay not in DECAYS:
            raise ValueError(f"learning-rate decay must be one of {', '.join(DECAYS)}, got {self.decay!r}")
        if self.total < 1 or not 0 <= self.warmup <= self.total:
            raise ValueError(f"need 0 <= warmup ({self.warmup}) <= total steps ({self.total}) and total >= 1")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"min_lr must be between 0 and the peak learning rate (ratio {self.min_ratio})")

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.decay == "constant":
            return 1.0
        t = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        shape = 0.5 * (1.0 + math.cos(math.pi * t)) if self.decay == "cosine" else 1.0 - t
        return self.min_ratio + (1.0 - self.min_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, *, total: int, warmup: int = 0, decay: str = "cosine",
                    lr: float, min_lr: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over ``optimizer`` (its groups' ``lr`` is the peak ``lr``); call ``.step()`` after each optimizer step."""
    if lr <= 0:
        raise ValueError(f"learning rate must be > 0, got {lr}")
    sched = LRSchedule(total, warmup, decay, min_lr / lr)
    for g in optimizer.param_groups:
        g["lr"] = lr
        g.pop("initial_lr", None)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, sched)


# Peak learning rates by model size from GPT-3's training recipes (Brown et al. 2020, Table 2.1:
# parameters -> AdamW peak lr); published 7B-70B recipes (Llama 2: 3e-4 at 7B, 1.5e-4 at 70B) sit
# within 2.5x of it. Below the smallest entry the examples' tiny presets keep TINY_LR.
RECIPE_LR = ((125e6, 6.0e-4), (350e6, 3.0e-4), (760e6, 2.5e-4), (1.3e9, 2.0e-4), (2.7e9, 1.6e-4),
             (6.7e9, 1.2e-4), (13e9, 1.0e-4), (175e9, 0.6e-4))
TINY_LR = 1e-3
# Linear warm-up steps from RECIPE_LR's first size on: a fixed count (not a share of --steps, so that a resumed
# run given more steps keeps its schedule); long runs follow the recipes' ~2000 with --warmup.
RECIPE_WARMUP = 10


def recipe_lr(num_params: float) -> float:
    """The peak learning rate for a model of ``num_params`` parameters: :data:`RECIPE_LR` interpolated in
    log-log, its last value beyond it, :data:`TINY_LR` below its first entry."""
    if num_params < RECIPE_LR[0][0]:
        return TINY_LR
    for (n0, lr0), (n1, lr1) in zip(RECIPE_LR, RECIPE_LR[1:]):
        if num_params <= n1:
            t = math.log(num_params / n0) / math.log(n1 / n0)
            return float(math.exp(math.log(lr0) + t * math.log(lr1 / lr0)))
    return RECIPE_LR[-1][1]


def recipe_warmup(num_params: float) -> int:
    """Linear warm-up steps: :data:`RECIPE_WARMUP` from :data:`RECIPE_LR`'s first size on, none below (the tiny presets)."""
    return 0 if num_params < RECIPE_LR[0][0] else RECIPE_WARMUP
