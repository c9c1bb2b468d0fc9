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
