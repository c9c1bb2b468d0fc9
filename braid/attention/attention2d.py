"""2D-Attention: head-parallel (Ulysses) x context-parallel (double ring), exact fwd and bwd.

LoongTrain Sec. 3 and 4. The sequence-parallel (SP) group of ``d_sp = d_hp * d_cp`` ranks
holds Q/K/V sharded along the sequence. A SeqAlltoAll over the HP group turns the shards
into head groups over the CP-local sequence; (double-)ring attention runs over the CP group;
a second SeqAlltoAll returns the output to sequence shards. The backward mirrors it.

Token placement: the full sequence is cut into ``2*d_cp`` chunks; CP rank ``c`` owns chunks
``c`` and ``2*d_cp-1-c`` (zigzag, so causal work is balanced) and the HP ranks of its HP
group split those ``S/d_cp`` tokens into ``d_hp`` contiguous pieces. So the rank at grid
position (hp, cp) holds piece ``cp*d_hp + hp`` of the zigzag-reordered sequence;
:func:`zigzag_shard`, :func:`zigzag_unshard` and :func:`zigzag_positions` do that math.

Rank placement (Sec. 4.2): ``head_first`` puts the HP ranks of one HP group next to each
other (inside a node), ``context_first`` the CP ranks. The inner rings of the double ring
are ``w`` consecutive CP ranks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch
import torch.distributed as dist

from braid.attention.kernels import BlockKernel, get_kernel
from braid.attention.ring import ForwardCache, RingSpec, ring_attention
from braid.attention.ulysses import HeadToSeq, SeqToHead

logger = logging.getLogger(__name__)

Placement = Literal["head_first", "context_first"]
PLACEMENTS: tuple[str, ...] = ("head_first", "context_first")


@dataclass(frozen=True, slots=True)
class Layout2D:
    """Pure rank-grid math of one SP group: who is at (hp, cp), and which ranks form each ring."""

    sp_ranks: tuple[int, ...]
    d_hp: int
    d_cp: int
    w: int
    placement: Placement = "head_first"

    def __post_init__(self) -> None:
        problems = []
        if self.d_hp < 1 or self.d_cp < 1:
            problems.append(f"d_hp={self.d_hp} and d_cp={self.d_cp} must be >= 1")
        elif self.d_hp * self.d_cp != len(self.sp_ranks):
            problems.append(f"d_hp*d_cp = {self.d_hp}*{self.d_cp} = {self.d_hp * self.d_cp} must equal the "
                            f"SP group size {len(self.sp_ranks)}")
        if self.w < 1 or self.d_cp % max(self.w, 1):
            problems.append(f"inner ring size w={self.w} must divide d_cp={self.d_cp}")
        if self.placement not in PLACEMENTS:
            problems.append(f"placement {self.placement!r} must be one of {', '.join(PLACEMENTS)}")
        if len(set(self.sp_ranks)) != len(self.sp_ranks):
            problems.append(f"SP ranks {list(self.sp_ranks)} contain duplicates")
        if problems:
            raise ValueError("invalid 2D-Attention layout: " + "; ".join(problems))

    @property
    def d_sp(self) -> int:
        return self.d_hp * self.d_cp

    def rank_at(self, hp: int, cp: int) -> int:
        """Global rank at grid position (hp, cp)."""
        idx = cp * self.d_hp + hp if self.placement == "head_first" else hp * self.d_cp + cp
        return self.sp_ranks[idx]

    def coords(self, rank: int) -> tuple[int, int]:
        """(hp, cp) of a global rank of this SP group."""
        if rank not in self.sp_ranks:
            raise ValueError(f"rank {rank} is not in the SP group {list(self.sp_ranks)}")
        idx = self.sp_ranks.index(rank)
        if self.placement == "head_first":
            cp, hp = divmod(idx, self.d_hp)
        else:
            hp, cp = divmod(idx, self.d_cp)
        return hp, cp

    def seq_index(self, rank: int) -> int:
        """Which of the ``d_sp`` zigzag pieces ``rank`` holds."""
        hp, cp = self.coords(rank)
        return cp * self.d_hp + hp

    def hp_group(self, cp: int) -> tuple[int, ...]:
        return tuple(self.rank_at(h, cp) for h in range(self.d_hp))

    def cp_group(self, hp: int) -> tuple[int, ...]:
        return tuple(self.rank_at(hp, c) for c in range(self.d_cp))

    def inner_ring(self, hp: int, outer: int) -> tuple[int, ...]:
        return tuple(self.rank_at(hp, outer * self.w + i) for i in range(self.w))

    def outer_ring(self, hp: int, inner: int) -> tuple[int, ...]:
        return tuple(self.rank_at(hp, o * self.w + inner) for o in range(self.d_cp // self.w))


class GroupPool:
    """Creates process groups among their members only, once per rank set.

    ``dist.new_group(..., use_local_synchronization=True)`` names a group after its ranks,
    so a second group over the same ranks in one process would clash; share one pool
    between all :class:`Attention2DGroups` built in a process to reuse them.
    """

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def get(self, ranks: Sequence[int]) -> dist.ProcessGroup:
        key = tuple(sorted(ranks))
        if key not in self._groups:
            self._groups[key] = dist.new_group(list(key), use_local_synchronization=True)
        return self._groups[key]


@dataclass(frozen=True, slots=True, eq=False)
class Attention2DGroups:
    """This rank's process groups for 2D-Attention: the HP group and the (double) ring."""

    layout: Layout2D
    rank: int
    hp_group: dist.ProcessGroup | None
    ring: RingSpec = field(repr=False)

    @classmethod
    def build(cls, sp_ranks: Sequence[int], d_hp: int, d_cp: int, w: int | None = None,
              placement: Placement = "head_first", pool: GroupPool | None = None) -> "Attention2DGroups":
        """Build the groups of the calling rank from its SP group's global ranks.

        Only the ranks of ``sp_ranks`` call it (each with the same arguments); ``w=None``
        means a single ring (``w = d_cp``). Groups are created in a fixed order (HP, CP
        inner ring, outer ring), each among its members only.
        """
        layout = Layout2D(tuple(sp_ranks), d_hp, d_cp, d_cp if w is None else w, placement)
        rank = dist.get_rank()
        hp, cp = layout.coords(rank)
        pool = pool if pool is not None else GroupPool()
        hp_group = pool.get(layout.hp_group(cp)) if d_hp > 1 else None
        o, i = divmod(cp, layout.w)
        inner = layout.inner_ring(hp, o)
        outer = layout.outer_ring(hp, i)
        inner_group = pool.get(inner) if len(inner) > 1 else None
        outer_group = pool.get(outer) if len(outer) > 1 else None
        spec = RingSpec(d_cp=d_cp, w=layout.w, cp_rank=cp, inner_group=inner_group, outer_group=outer_group,
                        inner_next=inner[(i + 1) % len(inner)], inner_prev=inner[(i - 1) % len(inner)],
                        outer_next=outer[(o + 1) % len(outer)], outer_prev=outer[(o - 1) % len(outer)])
        logger.debug("rank %d: hp=%d cp=%d inner=%s outer=%s", rank, hp, cp, inner, outer)
        return cls(layout=layout, rank=rank, hp_group=hp_group, ring=spec)


def zigzag_order(seq_len: int, d_hp: int, d_cp: int) -> torch.Tensor:
    """Token permutation: ``full[..., order]`` is the concatenation of the pieces in seq-index order."""
    if seq_len % (2 * d_cp):
        raise ValueError(f"sequence length {seq_len} must be divisible by 2*d_cp = {2 * d_cp} (zigzag chunks)")
    if seq_len % (d_hp * d_cp):
        raise ValueError(f"sequence length {seq_len} must be divisible by d_sp = {d_hp * d_cp}")
    chunks = torch.arange(seq_len).view(2 * d_cp, seq_len // (2 * d_cp))
    return torch.cat([torch.cat([chunks[c], chunks[2 * d_cp - 1 - c]]) for c in range(d_cp)])


def zigzag_positions(seq_len: int, layout: Layout2D, rank: int) -> torch.Tensor:
    """Original token positions (for RoPE, labels) of ``rank``'s shard, shape (seq_len / d_sp,)."""
    n = seq_len // layout.d_sp
    idx = layout.seq_index(rank)
    return zigzag_order(seq_len, layout.d_hp, layout.d_cp)[idx * n:(idx + 1) * n]


def zigzag_shard(x: torch.Tensor, layout: Layout2D, rank: int, dim: int = 2) -> torch.Tensor:
    """``rank``'s piece of a full sequence ``x`` (sequence along ``dim``)."""
    pos = zigzag_positions(x.shape[dim], layout, rank).to(x.device)
    return x.index_select(dim, pos)


def zigzag_unshard(pieces: Sequence[torch.Tensor], layout: Layout2D, dim: int = 2) -> torch.Tensor:
    """Inverse of :func:`zigzag_shard`: ``pieces[j]`` is the shard of ``layout.sp_ranks[j]``."""
    if len(pieces) != layout.d_sp:
        raise ValueError(f"need {layout.d_sp} pieces (one per SP rank), got {len(pieces)}")
    ordered = [None] * layout.d_sp
    for r, p in zip(layout.sp_ranks, pieces):
        ordered[layout.seq_index(r)] = p
    cat = torch.cat(ordered, dim=dim)
    inv = torch.argsort(zigzag_order(cat.shape[dim], layout.d_hp, layout.d_cp)).to(cat.device)
    return cat.index_select(dim, inv)


def _check_heads(h: int, h_kv: int, d_hp: int) -> int:
    """Replication factor of the K/V heads so that the HP group can split them."""
    if h % h_kv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({h_kv})")
    if h % d_hp:
        raise ValueError(f"d_hp={d_hp} must divide the {h} query heads; pick a d_hp that divides it")
    if h_kv >= d_hp:
        if h_kv % d_hp:
            raise ValueError(f"d_hp={d_hp} must divide the {h_kv} key/value heads (or be a multiple of them)")
        return 1
    if d_hp % h_kv:
        raise ValueError(f"d_hp={d_hp} exceeds the {h_kv} key/value heads and is not a multiple of them; "
                         "KV heads cannot be replicated evenly")
    return d_hp // h_kv


def attention_2d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, groups: Attention2DGroups, causal: bool,
                 scale: float | None = None, kernel: BlockKernel | None = None,
                 cache: ForwardCache | None = None) -> torch.Tensor:
    """Exact attention of this rank's sequence shard against the SP group's full sequence.

    q (B, H, S/d_sp, D), k/v (B, H_kv, S/d_sp, D), each rank's tokens as laid out by
    :func:`zigzag_shard`; returns (B, H, S/d_sp, D). Autograd-aware. If ``d_hp > H_kv`` the
    K/V heads are replicated before the all-to-all; autograd sums the replicas' gradients.
    ``cache`` (from :mod:`braid.attention.checkpoint`) lets a recomputation reuse the
    stored ring output and LSE.
    """
    lay = groups.layout
    if q.dim() != 4:
        raise ValueError(f"q must be (batch, heads, seq, head_dim), got shape {tuple(q.shape)}")
    rep = _check_heads(q.shape[1], k.shape[1], lay.d_hp)
    if causal and (q.shape[2] * lay.d_hp) % 2:
        raise ValueError(f"local sequence {q.shape[2]} x d_hp={lay.d_hp} must be even for the zigzag layout")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    g, n = groups.hp_group, lay.d_hp
    qh, kh, vh = SeqToHead.apply(q, g, n), SeqToHead.apply(k, g, n), SeqToHead.apply(v, g, n)
    out, _lse = ring_attention(qh, kh, vh, groups.ring, causal=causal, scale=scale,
                               kernel=kernel if kernel is not None else get_kernel(q.device), cache=cache)
    return HeadToSeq.apply(out, g, n)
