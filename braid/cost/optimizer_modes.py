"""Optimizer modes: what each keeps per parameter and what its step moves. Torch-free.

One table for the example scripts (``--optimizer``), the planner (``braid.plan
--optimizer``), the simulator (``braid.simulate --optimizer``) and the memory estimates
of a run; ``docs/training.md`` prints the same table (a test reads it back).

* ``zero1`` (default): fp32 master weights and fp32 AdamW moments sharded over the
  data-parallel (x context-parallel) ranks, fp32 gradient accumulation; the step
  reduce-scatters the fp32 gradients, updates its shard and all-gathers the weights in the
  model's dtype (Megatron's distributed optimizer). At one data-parallel rank it is
  ``master``.
* ``master``: fp32 masters and moments on every replica; the fp32 gradients are
  all-reduced.
* ``plain``: :class:`torch.optim.AdamW` on the model's own weights, moments and gradients
  in the model's dtype (bf16 on GPU: small updates are lost to rounding); gradients
  all-reduced in that dtype. What the ``torch_*`` baselines run.

``d``: bytes of the model's dtype (2 for bf16); ``n``: ranks the state is sharded over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OptimizerMode = Literal["zero1", "master", "plain"]
OPTIMIZERS: tuple[OptimizerMode, ...] = ("zero1", "master", "plain")
DEFAULT_OPTIMIZER: OptimizerMode = "zero1"
FP32 = 4


@dataclass(frozen=True, slots=True)
class ModeBytes:
    """Bytes per parameter of one mode, for a model dtype of ``d`` bytes and ``n`` sharding ranks.

    ``state``: weights + gradient buffer + optimizer state held on a rank; ``reduce``: bytes
    of gradient each rank sends into the data-parallel reduction (``reduce_scatter`` says
    which collective: reduce-scatter, else all-reduce); ``gather``: weight bytes all-gathered
    after the step; ``step``: HBM bytes the update reads and writes per parameter it owns.
    """

    weights: float
    grads: float
    masters: float
    moments: float
    reduce: float
    reduce_scatter: bool
    gather: float
    step: float

    @property
    def state(self) -> float:
        return self.weights + self.grads + self.masters + self.moments


def mode_bytes(mode: str, d: int, n: int = 1) -> ModeBytes:
    """Per-parameter bytes of ``mode`` (see the module doc); ``ValueError`` for an unknown mode."""
    if mode == "plain":  # weights, gradients, exp_avg, exp_avg_sq: all in the model dtype
        return ModeBytes(d, d, 0.0, 2 * d, reduce=d, reduce_scatter=False, gather=0.0, step=7 * d)
    if mode in ("master", "zero1"):
        ways = n if mode == "zero1" else 1
        # the step reads master, gradient, two moments and writes master, two moments (fp32), then the weight (d)
        return ModeBytes(d, FP32, FP32 / ways, 2 * FP32 / ways, reduce=FP32, reduce_scatter=mode == "zero1" and n > 1,
                         gather=d if mode == "zero1" and n > 1 else 0.0, step=(7 * FP32 + d) / ways)
    raise ValueError(f"unknown optimizer mode {mode!r}; valid: {', '.join(OPTIMIZERS)}")


def state_bytes_per_param(mode: str, d: int, n: int = 1) -> float:
    """Weights, gradients and optimizer state per parameter on one rank (``d``: model dtype bytes)."""
    return mode_bytes(mode, d, n).state


def describe(mode: str) -> str:
    """One line per mode for ``--help``."""
    return {"zero1": "fp32 masters and moments sharded over data-parallel ranks (default; = master at dp=1)",
            "master": "fp32 masters and moments on every data-parallel replica",
            "plain": "AdamW on the model's weights, moments in the model's dtype (bf16 on GPU)"}[mode]
