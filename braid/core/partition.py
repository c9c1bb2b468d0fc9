"""How a model's layers are spread over virtual stages (shared by cost model and executor).

Paper Sec. 5 (setup): LLM layers are split evenly, the last virtual stage two layers
lighter (its head over a 152K vocabulary is heavy); for an MLLM the ViT takes the first
virtual stage of device 0 and the language model is spread over the remaining ones.
"""

from __future__ import annotations

from braid.core.braiding import ChunkSpec
from braid.core.ir import Placement, rank_chunk_of


def split_layers(num_layers: int, num_stages: int, last_stage_lighter: int = 0, first_stage_layers: int | None = None) -> tuple[int, ...]:
    """Layers per virtual stage, as even as possible.

    ``last_stage_lighter``: the last stage gets this many layers fewer than an even share
    (the rest spread over the other stages). ``first_stage_layers``: pin the first stage
    (e.g. 0 when the first stage holds a ViT, not LM layers). Raises ``ValueError`` when
    the layers cannot cover the stages.
    """
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


def chunk_specs(layers_per_stage: tuple[int, ...], p: int, placement: Placement) -> dict[tuple[int, int], ChunkSpec]:
    """``(rank, chunk) -> ChunkSpec`` for a placement; stage 0 has the embedding, the last the head."""
    n = len(layers_per_stage)
    out = {}
    for stage, layers in enumerate(layers_per_stage):
        out[rank_chunk_of(placement, p, stage)] = ChunkSpec(layers, embed=stage == 0, head=stage == n - 1)
    return out


def layer_offset(layers_per_stage: tuple[int, ...], stage: int) -> int:
    """Global index of the first layer of ``stage``."""
    return sum(layers_per_stage[:stage])
