"""Selective Checkpoint++: recompute a checkpointed layer but not its attention.

LoongTrain Sec. 4.4 (LightSeq makes the same point): with full activation checkpointing a
layer's forward runs twice, and for long sequences the second attention forward -- with its
ring communication -- is the expensive part. Keeping only the attention output and its LSE
(O(S) per head, like any activation) lets the recomputation return them directly; the
attention backward then runs as usual from the recomputed Q/K/V and the stored out/LSE.

The checkpointing itself is torch's (``torch.utils.checkpoint``, non-reentrant). A layer
function receives an :class:`AttentionCache` as its first argument and passes it to
:func:`braid.attention.attention2d.attention_2d` (or ``ring_attention``) as ``cache=``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

OutLse = tuple[torch.Tensor, torch.Tensor]


class AttentionCache:
    """(out, lse) of every attention call of one checkpointed region, in call order.

    The first run of the region records; every later run (the recomputation) replays the
    records in the same order instead of computing.
    """

    def __init__(self) -> None:
        self._records: list[OutLse] = []
        self._runs = 0
        self._cursor = 0

    @property
    def replaying(self) -> bool:
        return self._runs > 1

    def begin_run(self) -> None:
        """Mark the start of one run of the region (the forward, then each recomputation)."""
        self._runs += 1
        self._cursor = 0

    def fetch(self, compute: Callable[[], OutLse]) -> OutLse:
        """The stored (out, lse) when replaying, else ``compute()`` (and store it)."""
        if not self.replaying:
            out, lse = compute()
            self._records.append((out.detach(), lse.detach()))
            return out, lse
        if self._cursor >= len(self._records):
            raise ValueError(f"recomputation made more attention calls ({self._cursor + 1}) than the forward "
                             f"({len(self._records)}); the checkpointed function must be deterministic in its calls")
        out, lse = self._records[self._cursor]
        self._cursor += 1
        return out.detach(), lse.detach()  # fresh tensor objects: autograd attaches a new grad_fn to them


def checkpoint_with_attention_cache(fn: Callable[..., Any], *args: Any, **checkpoint_kwargs: Any) -> Any:
    """Run ``fn(cache, *args)`` under activation checkpointing, keeping attention's out/LSE.

    Equivalent to ``torch.utils.checkpoint.checkpoint(fn, ...)`` in values and gradients;
    the recomputation skips every attention forward made with ``cache=cache``.
    """
    cache = AttentionCache()

    def run(*a: Any) -> Any:
        cache.begin_run()
        return fn(cache, *a)

    checkpoint_kwargs.setdefault("use_reentrant", False)
    if checkpoint_kwargs["use_reentrant"]:
        raise ValueError("Selective Checkpoint++ needs use_reentrant=False (the reentrant variant drops kwargs "
                         "and re-runs outside autograd's saved-tensor hooks)")
    return checkpoint(run, *args, **checkpoint_kwargs)
