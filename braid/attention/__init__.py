"""LoongTrain 2D-Attention: block kernels, Ulysses all-to-all, (double-)ring attention,
Selective Checkpoint++. Entry point for models: :func:`attention_2d`."""

from braid.attention.attention2d import (
    PLACEMENTS,
    Attention2DGroups,
    GroupPool,
    Layout2D,
    attention_2d,
    zigzag_order,
    zigzag_positions,
    zigzag_shard,
    zigzag_unshard,
)
from braid.attention.checkpoint import AttentionCache, checkpoint_with_attention_cache
from braid.attention.kernels import BlockKernel, get_kernel, reference_attention
from braid.attention.ring import RingSpec, ring_attention

__all__ = [
    "PLACEMENTS", "Attention2DGroups", "GroupPool", "Layout2D", "attention_2d", "zigzag_order",
    "zigzag_positions", "zigzag_shard", "zigzag_unshard", "AttentionCache", "checkpoint_with_attention_cache",
    "BlockKernel", "get_kernel", "reference_attention", "RingSpec", "ring_attention",
]
