"""Deterministic initialisation by parameter name, so a rank can build only its chunks.

Each parameter is drawn from a generator seeded with ``(seed, global name)`` alone, so it
gets the same values whether the whole single-device model is initialised at once or a
rank materialises one layer of a meta-device model (:mod:`braid.models.build`). Values
are drawn on the parameter's device: a CPU and a CUDA run of the same seed differ, a
single-device reference and a pipelined run on the same kind of device do not.

Rule (the one :meth:`braid.models.qwen2.Qwen2Model.reset_parameters` uses, without its
shared random stream): norm weights ``1 + 0.1 * N(0, 1)`` (so their gradients matter),
everything else ``N(0, std)``.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn


def param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from the model seed and a parameter's global name."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def is_norm_weight(name: str) -> bool:
    """Whether ``name`` is the weight of a normalisation layer (its module's name contains ``norm``, or is
    ``ln_*`` as the vision merger's ``ln_q``)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and ("norm" in parts[-2] or parts[-2].startswith("ln_"))


@torch.no_grad()
def init_tensor(t: torch.Tensor, seed: int, name: str, std: float) -> None:
    """Fill ``t`` (in place) with the values parameter ``name`` gets under ``seed``."""
    g = torch.Generator(device=t.device).manual_seed(param_seed(seed, name))
    if is_norm_weight(name):
        t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32))
    else:
        t.copy_(torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32).mul_(std))  # in place: no second buffer


def init_by_name(module: nn.Module, seed: int, std: float = 0.2, prefix: str = "") -> None:
    """Initialise every parameter of ``module`` by its name (``prefix`` + local name: the global name).

    Tied parameters are registered once, under their first name, so a tied LM head gets
    the embedding's values.
    """
    for name, p in module.named_parameters():
        init_tensor(p, seed, prefix + name, std)
