"""Sequence parallelism of the model: which tokens a rank holds and how its attention runs.

LoongTrain (Sec. 3-4) splits every sequence over a sequence-parallel (SP) group of
``d_sp = d_hp * d_cp`` ranks -- the ``cp`` degree of :class:`braid.core.topology.Topology`.
Everything but attention is per token (embedding, RMSNorm, linears, MLP, vocab-parallel
loss), so those modules simply run on the rank's local tokens; the Attn unit calls
:func:`braid.attention.attention_2d` (Ulysses all-to-all over ``d_hp`` ranks, double-ring
attention over ``d_cp`` ranks with inner rings of ``w``).

Token placement is LoongTrain's zigzag (causal load balance): the rank at grid position
(hp, cp) holds piece ``cp*d_hp + hp`` of the zigzag-reordered sequence. Tokens and labels
are sharded that way, and RoPE uses each local token's *original* position.

Loss and gradients. Each rank's loss is the sum of its tokens' cross-entropy divided by
the *global* number of target tokens of the micro-batch, so the SP ranks' losses add up to
the full-sequence mean. The gradient of a replicated weight on one rank is then that
rank's share of the true gradient (attention's backward carries the other ranks' shares
of the activations' gradients back through the all-to-all and the ring), so the shares
are *summed* over the SP group (and averaged over data-parallel replicas):
:func:`braid.runtime.distributed.reduce_gradients`.

TP x SP: tensor parallelism splits the heads first (``H/tp`` per TP rank), then the HP
group splits the local heads; the SP group of a rank is the ranks with the same
(dp, pp, tp) coordinates. Every head condition is checked on the local head counts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from braid.attention.attention2d import (
    PLACEMENTS,
    Attention2DGroups,
    GroupPool,
    Layout2D,
    Placement,
    _check_heads,
    attention_2d,
    zigzag_order,
    zigzag_positions,
)

if TYPE_CHECKING:
    from braid.runtime.distributed import ProcessGroups

log = logging.getLogger(__name__)

IGNORE_INDEX = -100  # label of tokens without a target (as ``F.cross_entropy``)


class SequenceParallelError(ValueError):
    """Sequence-parallel degrees that do not fit the model, the sequence or the topology."""


@dataclass(frozen=True, slots=True)
class SPConfig:
    """Sequence-parallel degrees: ``d_sp`` (the topology's ``cp``) = ``d_hp`` x ``d_cp``.

    ``w`` is the inner ring size of Double-Ring-Attention (LoongTrain Sec. 4.1; ``None``:
    one ring of ``d_cp``), ``placement`` puts the HP (``head_first``) or the CP
    (``context_first``) ranks next to each other (Sec. 4.2).
    """

    d_sp: int = 1
    d_hp: int = 1
    w: int | None = None
    placement: Placement = "head_first"

    def __post_init__(self) -> None:
        if not isinstance(self.d_sp, int) or not isinstance(self.d_hp, int) or self.d_sp < 1 or self.d_hp < 1:
            raise SequenceParallelError(f"sequence-parallel degrees must be positive integers, got d_sp={self.d_sp}, d_hp={self.d_hp}")
        if self.d_sp % self.d_hp:
            raise SequenceParallelError(
                f"head-parallel size d_hp={self.d_hp} must divide the sequence-parallel size d_sp={self.d_sp} (cp); "
                f"d_cp = d_sp / d_hp")
        try:
            Layout2D(tuple(range(self.d_sp)), self.d_hp, self.d_cp, self.ring, self.placement)
        except ValueError as err:
            raise SequenceParallelError(f"{self._name()}: {err}") from None

    @property
    def d_cp(self) -> int:
        return self.d_sp // self.d_hp

    @property
    def ring(self) -> int:
        """Inner ring size actually used (``w`` or ``d_cp``)."""
        return self.d_cp if self.w is None else self.w

    def _name(self) -> str:
        return f"sequence parallel d_sp={self.d_sp} (d_hp={self.d_hp} x d_cp={self.d_cp}, ring {self.ring}, {self.placement})"

    def check_model(self, *, heads: int, kv_heads: int, tp: int = 1, seq_len: int | None = None) -> None:
        """Raise :class:`SequenceParallelError` if the heads (after the TP split) or the sequence do not fit.

        The HP group splits the ``heads/tp`` local query heads and the local KV heads (or a
        replication of them, if ``d_hp`` exceeds them); zigzag needs ``seq_len`` divisible
        by ``2*d_cp`` and by ``d_sp``.
        """
        if self.d_sp == 1:
            return
        if heads % tp or kv_heads % tp:
            raise SequenceParallelError(f"heads ({heads}) and KV heads ({kv_heads}) must be divisible by tp={tp}")
        try:
            _check_heads(heads // tp, kv_heads // tp, self.d_hp)
            if seq_len is not None:
                zigzag_order(seq_len, self.d_hp, self.d_cp)
        except ValueError as err:
            where = f" with {heads // tp} query / {kv_heads // tp} KV heads per TP rank" if tp > 1 else ""
            raise SequenceParallelError(f"{self._name()}{where}: {err}") from None


@dataclass(frozen=True, slots=True, eq=False)
class SequenceParallel:
    """One rank's SP context: its 2D-Attention groups, the whole SP group, and its token positions."""

    config: SPConfig
    groups: Attention2DGroups
    group: dist.ProcessGroup  # the whole SP group (sums the loss for reporting)
    # (seq_len, device) -> this rank's positions there: made once, so that a step captured in a CUDA
    # graph finds them on the device (a host-to-device copy cannot be captured)
    _positions: dict = field(default_factory=dict, repr=False)

    @classmethod
    def create(cls, config: SPConfig, process_groups: "ProcessGroups", pool: GroupPool | None = None) -> "SequenceParallel | None":
        """Build this rank's SP context (collective over its SP group); ``None`` when ``d_sp == 1``.

        ``config.d_sp`` must equal the topology's ``cp``. Pass one :class:`GroupPool` per
        process if a process builds more than one context over the same ranks.
        """
        topo = process_groups.topo
        if config.d_sp != topo.cp:
            raise SequenceParallelError(f"d_sp={config.d_sp} but the topology has cp={topo.cp}; "
                                        "the topology's cp degree is the sequence-parallel size")
        if config.d_sp == 1:
            return None
        sp_ranks = topo.group_of("cp", process_groups.rank)
        groups = Attention2DGroups.build(sp_ranks, config.d_hp, config.d_cp, config.ring, config.placement, pool=pool)
        log.debug("rank %d: SP group %s, %s", process_groups.rank, sp_ranks, config)
        return cls(config, groups, process_groups.cp)

    @property
    def layout(self) -> Layout2D:
        return self.groups.layout

    @property
    def rank(self) -> int:
        return self.groups.rank

    def local_len(self, seq_len: int) -> int:
        """Tokens per rank of a ``seq_len`` sequence (checked for the zigzag layout)."""
        self.positions(seq_len)
        return seq_len // self.config.d_sp

    def positions(self, seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Original positions (0..seq_len-1) of this rank's tokens, in local order (RoPE, labels)."""
        key = (seq_len, str(torch.device(device)))
        got = self._positions.get(key)
        if got is None:
            try:
                got = self._positions[key] = zigzag_positions(seq_len, self.layout, self.rank).to(device)
            except ValueError as err:
                raise SequenceParallelError(f"{self.config._name()}: {err}") from None
        return got

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a full-sequence tensor (sequence along ``dim``; (b, s) tokens by default):
        :func:`braid.attention.attention2d.zigzag_shard` with the positions made once per length and device."""
        return x.index_select(dim, self.positions(x.shape[dim], x.device))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                  scale: float | None = None) -> torch.Tensor:
        """2D-Attention of local q (b, H, s/d_sp, d) against the SP group's sequence; same shape out."""
        return attention_2d(q, k, v, groups=self.groups, causal=causal, scale=scale)


def target_count(labels: torch.Tensor) -> torch.Tensor:
    """Number of target tokens (labels other than ``IGNORE_INDEX``) of a full micro-batch, at least 1."""
    return (labels != IGNORE_INDEX).sum().clamp(min=1)


__all__ = ["IGNORE_INDEX", "PLACEMENTS", "SPConfig", "SequenceParallel", "SequenceParallelError", "target_count"]
