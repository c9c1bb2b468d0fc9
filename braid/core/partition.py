"""How a model's layers are spread over virtual stages (shared by cost model and executor).

Paper Sec. 5 (setup): LLM layers are split evenly, the last virtual stage two layers
lighter (its head over a 152K vocabulary is heavy); for an MLLM the ViT takes the first
virtual stage of device 0 and the language model is spread over the remaining ones.
A stage may also hold half a layer (:func:`stage_halves`): the cut between a layer's
attention and its MLP evens out a head whose work is a fraction of a layer's.
"""

from __future__ import annotations

from typing import Collection, Sequence

from braid.core.braiding import ChunkSpec
from braid.core.ir import Placement, rank_chunk_of


def split_layers(num_layers: int, num_stages: int, last_stage_lighter: float = 0,
                 first_stage_layers: int | None = None) -> tuple[float, ...]:
    """Layers per virtual stage, as even as possible.

    ``last_stage_lighter``: the last stage gets this many layers fewer than an even share
    (the rest spread over the other stages). A half (``0.5``, ``2.5``) moves the attention
    half of the last stage's first layer to the stage before it (:func:`stage_halves`): the
    split of the whole number, then that half cut. ``first_stage_layers``: pin the first
    stage (e.g. 0 when the first stage holds a ViT, not LM layers). Raises ``ValueError``
    when the layers cannot cover the stages.
    """
    whole = int(last_stage_lighter)
    if last_stage_lighter != whole:
        if last_stage_lighter * 2 != int(last_stage_lighter * 2) or last_stage_lighter < 0:
            raise ValueError(f"last_stage_lighter must be a whole or half number of layers >= 0, got {last_stage_lighter}")
        counts = list(split_layers(num_layers, num_stages, whole, first_stage_layers))
        first = int(first_stage_layers is not None)
        if len(counts) - first < 2:
            raise ValueError(f"a half-layer cut needs two stages with decoder layers, got {len(counts) - first}")
        counts[-1] -= 0.5
        counts[-2] += 0.5
        return tuple(counts)
    if num_stages < 1:
        raise ValueError(f"need at least one stage, got {num_stages}")
    rest_stages = num_stages
    counts: list[int] = []
    remaining = num_layers
    if first_stage_layers is not None:
        if first_stage_layers < 0 or first_stage_layers > num_layers:
            raise ValueError(f"first_stage_layers={first_stage_layers} outside 0..{num_layers}")
        counts.append(first_stage_layers)
        remaining -= first_stage_layers
        rest_stages -= 1
    if rest_stages == 0:
        if remaining:
            raise ValueError(f"{remaining} layers left over with no stage to hold them")
        return tuple(counts)
    if last_stage_lighter < 0:
        raise ValueError(f"last_stage_lighter must be >= 0, got {last_stage_lighter}")
    # Even share s over all stages, the last one holding s - lighter (s rounded up, so the
    # lightened stage is not lighter than asked), the rest spread with extras first.
    last = -(-(remaining + last_stage_lighter) // rest_stages) - last_stage_lighter if last_stage_lighter else None
    if last is None:
        base, extra = divmod(remaining, rest_stages)
        shares = [base + (1 if i < extra else 0) for i in range(rest_stages)]
    elif rest_stages == 1:
        shares = [remaining]
    else:
        base, extra = divmod(remaining - last, rest_stages - 1)
        shares = [base + (1 if i < extra else 0) for i in range(rest_stages - 1)] + [last]
    if min(shares) < 1 and not (rest_stages == 1 and shares[0] >= 0):
        raise ValueError(
            f"cannot split {num_layers} layers over {num_stages} stages"
            + (f" with the last stage {last_stage_lighter} lighter" if last_stage_lighter else "")
            + ": every stage needs at least one layer; use fewer stages or more layers"
        )
    return tuple(counts + shares)


def stage_halves(layers_per_stage: Sequence[float]) -> tuple[int, ...]:
    """Each stage's size in half layers; raises ``ValueError`` unless every entry is a whole
    or half number of layers (>= 0) and the stages add up to whole layers.

    A half (``1.5``, ``0.5``) cuts a layer between its attention and its MLP
    (:class:`braid.core.braiding.ChunkSpec`'s ``half_in``/``half_out``): the stage before runs
    the attention half, the stage after the MLP half.
    """
    out = []
    for n in layers_per_stage:
        h = n * 2
        if isinstance(n, bool) or h != int(h) or n < 0:
            raise ValueError(f"layers per stage must be whole or half layers (>= 0), got {list(layers_per_stage)}")
        out.append(int(h))
    if sum(out) % 2:
        raise ValueError(f"the stages add up to {sum(out) / 2} layers; a model has whole layers: {list(layers_per_stage)}")
    return tuple(out)


def chunk_specs(layers_per_stage: Sequence[float], p: int, placement: Placement,
                moe_layers: Collection[int] = (), vision: bool = False) -> dict[tuple[int, int], ChunkSpec]:
    """``(rank, chunk) -> ChunkSpec`` for a placement; stage 0 has the embedding, the last the head.

    Entries may be half layers (:func:`stage_halves`). ``moe_layers``: the global indices of the
    model's mixture-of-experts layers (:attr:`ChunkSpec.moe`). ``vision``: stage 0 is a
    vision-language model's tower (its entry counts ViT blocks) and ends with the ``merge`` unit.
    """
    halves = stage_halves(layers_per_stage)
    n = len(halves)
    out = {}
    start = 0
    for stage, size in enumerate(halves):
        end = start + size
        if size:
            first, last = -(-start // 2), end // 2  # whole layers [first, last)
            offset = start // 2  # global index of the chunk's first (half) layer: chunk-local layer 0
            moe = frozenset(i - offset for i in moe_layers if offset <= i < -(-end // 2))
            spec = ChunkSpec(last - first, embed=stage == 0, head=stage == n - 1, merge=vision and stage == 0,
                             half_in=start % 2 == 1, half_out=end % 2 == 1, moe=moe)
        else:
            spec = ChunkSpec(0, embed=stage == 0, head=stage == n - 1)
        out[rank_chunk_of(placement, p, stage)] = spec
        start = end
    return out


def layer_offset(layers_per_stage: Sequence[float], stage: int) -> int:
    """Global index of the first layer (or half layer) of ``stage``."""
    return sum(stage_halves(layers_per_stage)[:stage]) // 2


def whole_layers(layers_per_stage: Sequence[float]) -> bool:
    """Whether no stage cuts a layer in half."""
    return all(h % 2 == 0 for h in stage_halves(layers_per_stage))
