"""Rank layout of a training job: data x pipeline x context x tensor parallel degrees.

A :class:`Topology` is a frozen, validated value; the rank grid is
``numpy.arange(world).reshape(dp, pp, cp, tp)`` (tensor parallel fastest, so the TP group of a
rank is a block of neighbouring ranks -- one node's NVLink island on real clusters). The
process groups live in a separate object, :class:`braid.runtime.distributed.ProcessGroups`,
created from a topology; nothing here touches ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class TopologyError(ValueError):
    """A layout that does not fit the world size or the model."""


@dataclass(frozen=True, slots=True)
class RankCoords:
    """Coordinates of one rank in the (dp, pp, cp, tp) grid."""

    dp: int
    pp: int
    cp: int
    tp: int


@dataclass(frozen=True, slots=True)
class Topology:
    """Parallel degrees of a job; ``world_size`` must equal ``dp * pp * cp * tp``."""

    world_size: int
    pp: int
    dp: int = 1
    tp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        degrees = {"world_size": self.world_size, "pp": self.pp, "dp": self.dp, "tp": self.tp, "cp": self.cp}
        bad = [f"{k}={v}" for k, v in degrees.items() if not isinstance(v, int) or v < 1]
        if bad:
            raise TopologyError(f"parallel degrees must be positive integers, got {', '.join(bad)}")
        product = self.dp * self.pp * self.cp * self.tp
        if product != self.world_size:
            raise TopologyError(
                f"world size {self.world_size} != dp*pp*cp*tp = {self.dp}*{self.pp}*{self.cp}*{self.tp} = {product}; "
                "change the degrees or the number of processes"
            )

    # -- rank-grid math ---------------------------------------------------------------
    def grid(self) -> np.ndarray:
        """Global ranks laid out as a (dp, pp, cp, tp) array."""
        return np.arange(self.world_size).reshape(self.dp, self.pp, self.cp, self.tp)

    def coords(self, rank: int) -> RankCoords:
        """Where ``rank`` sits in the grid."""
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} outside 0..{self.world_size - 1}")
        rest, tp = divmod(rank, self.tp)
        rest, cp = divmod(rest, self.cp)
        dp, pp = divmod(rest, self.pp)
        return RankCoords(dp=dp, pp=pp, cp=cp, tp=tp)

    def rank_of(self, c: RankCoords) -> int:
        return int(self.grid()[c.dp, c.pp, c.cp, c.tp])

    def groups(self, dim: str) -> list[list[int]]:
        """All groups along one grid dimension (``"pp"``, ``"tp"``, ``"dp"``, ``"cp"`` or ``"dp_cp"``).

        Every rank must create every group in the same order, so this lists them all.
        """
        g = self.grid()
        axes = {"dp": 0, "pp": 1, "cp": 2, "tp": 3}
        if dim == "dp_cp":
            # Gradient reduction spans data and context parallel ranks of one (pp, tp) slot.
            t = g.transpose(1, 3, 0, 2).reshape(self.pp * self.tp, self.dp * self.cp)
            return [row.tolist() for row in t]
        if dim not in axes:
            raise TopologyError(f"unknown group dimension {dim!r}; valid: dp, pp, cp, tp, dp_cp")
        ax = axes[dim]
        order = [a for a in range(4) if a != ax] + [ax]
        t = g.transpose(*order).reshape(-1, g.shape[ax])
        return [row.tolist() for row in t]

    def group_of(self, dim: str, rank: int) -> list[int]:
        """The ranks of ``rank``'s group along ``dim``."""
        for ranks in self.groups(dim):
            if rank in ranks:
                return ranks
        raise TopologyError(f"rank {rank} outside 0..{self.world_size - 1}")

    # -- model fit ---------------------------------------------------------------------
    def check_model(self, *, num_heads: int, num_kv_heads: int, vocab_size: int, num_layers: int, num_stages: int) -> None:
        """Raise :class:`TopologyError` if the model cannot be split over this layout.

        Heads and KV heads are split over TP ranks (Megatron-style attention sharding),
        the vocabulary over TP ranks (vocab-parallel embedding and loss), and every one of
        the ``num_stages`` virtual stages needs at least one layer.
        """
        if num_heads % self.tp:
            raise TopologyError(f"attention heads ({num_heads}) not divisible by tp={self.tp}; pick tp dividing {num_heads}")
        if num_kv_heads % self.tp:
            raise TopologyError(f"KV heads ({num_kv_heads}) not divisible by tp={self.tp}; pick tp dividing {num_kv_heads}")
        if vocab_size % self.tp:
            raise TopologyError(f"vocab size ({vocab_size}) not divisible by tp={self.tp}; pad the vocabulary to a multiple of tp")
        if num_stages < self.pp:
            raise TopologyError(f"{num_stages} virtual stages for pp={self.pp}: need at least one stage per pipeline rank")
        if num_layers < num_stages:
            raise TopologyError(
                f"{num_layers} layers cannot fill {num_stages} virtual stages (pp={self.pp}); "
                "use more layers, fewer pipeline ranks or fewer chunks per rank"
            )
