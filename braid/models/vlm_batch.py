"""What a vision-language micro-batch's chunks read on the host, computed once per batch shape.

The vision chunk needs each micro-batch's image grids (the tower's rotary angles, attention
segment lengths, Qwen2.5-VL's window order) and where the image-pad tokens sit in
``input_ids`` (the visual tokens are written there); an M-RoPE chunk needs the M-RoPE
positions, which follow from the same two facts. None of them depends on the pixel values
or on the text tokens' values: a micro-batch's *shape* -- its ``input_ids`` shape, its image
grids and the runs of image-pad tokens in each sample -- determines them all.

So each chunk reads ``input_ids`` on the host once per step (one device-to-host copy of all its
micro-batches), derives each micro-batch's :class:`BatchShape`, and builds the device tensors
it uses once per shape (:class:`ShapeCache`). The step itself then runs on the device alone: no host
read inside the forward or backward (masked scatters, ``nonzero``, ``.tolist()`` of grids),
which is what a whole-step CUDA graph needs (:mod:`braid.runtime.graphs`): the graph captured
for one tuple of shapes replays for every batch of the same shapes, and a new shape is a
new capture (one graph is kept at a time). Production VLM trainers pad or bucket image sizes for
the same reason: micro-batches padded to one visual-token budget (:mod:`braid.models.vlm_pack`,
the examples' ``--image-sizes``) carry these facts as tensors and share one key, so one graph
serves a run of mixed resolutions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Hashable, Sequence, TypeVar

import torch

MAX_SHAPES = 64  # distinct batch shapes whose device tensors a chunk keeps (oldest dropped first)


@dataclass(frozen=True, slots=True)
class BatchShape:
    """The host-side facts of one micro-batch: ``input_ids`` shape, image grids ``(t, h, w)`` in order, and
    each image's pad-token run ``(sample, start, length)`` in order."""

    ids_shape: tuple[int, int]
    grids: tuple[tuple[int, int, int], ...]
    runs: tuple[tuple[int, int, int], ...]


def image_runs(is_image: torch.Tensor) -> tuple[tuple[int, int, int], ...]:
    """``(sample, start, length)`` of every maximal run of True in ``is_image`` (b, s), row by row (a CPU tensor)."""
    b, s = is_image.shape
    pad = torch.zeros(b, 1, dtype=torch.int8)
    edges = torch.diff(torch.cat([pad, is_image.to(torch.int8), pad], dim=1), dim=1)  # +1 at a start, -1 past an end
    out = []
    for i in range(b):
        starts = (edges[i] == 1).nonzero().flatten().tolist()
        ends = (edges[i] == -1).nonzero().flatten().tolist()
        out.extend((i, a, e - a) for a, e in zip(starts, ends))
    return tuple(out)


def host_ids(items: Sequence[tuple]) -> list[torch.Tensor]:
    """The ``input_ids`` (position 1 of every item) of all micro-batches on the host, read in one copy."""
    ids = [it[1] for it in items]
    if not ids:
        return []
    if all(t.device.type == "cpu" for t in ids):
        return list(ids)
    flat = torch.cat([t.reshape(-1) for t in ids]).cpu()  # one device-to-host copy for the whole step
    out, k = [], 0
    for t in ids:
        out.append(flat[k : k + t.numel()].view(t.shape))
        k += t.numel()
    return out


def item_grids(item: tuple, patch: int) -> tuple[tuple[int, int, int], ...]:
    """The image grids of one micro-batch item, from its images' shape (``(images, ids)``) or its grid tensor."""
    if len(item) == 3:
        return tuple(tuple(int(v) for v in row) for row in item[2].cpu().tolist())
    images = item[0]
    if images.dim() != 4:
        raise ValueError(f"(images, input_ids) items need images (b, c, H, W), got shape {tuple(images.shape)}")
    b, _, hgt, wid = images.shape
    return ((1, hgt // patch, wid // patch),) * b


def batch_shapes(items: Sequence[tuple], patch: int, merge: int, image_token_id: int) -> tuple[BatchShape, ...]:
    """Every micro-batch's :class:`BatchShape`, checked: one pad-token run per image, as long as its merged grid.

    ValueError (one line) for a micro-batch whose ids and images disagree."""
    shapes = []
    for k, (item, ids) in enumerate(zip(items, host_ids(items))):
        if ids.dim() != 2:
            raise ValueError(f"micro-batch {k}: input_ids must be (batch, seq), got shape {tuple(ids.shape)}")
        grids = item_grids(item, patch)
        runs = image_runs(ids == image_token_id)
        if len(runs) != len(grids):
            raise ValueError(f"micro-batch {k}: input_ids hold {len(runs)} runs of image tokens for {len(grids)} images")
        for (t, h, w), (i, start, n) in zip(grids, runs):
            if h % merge or w % merge or t * (h // merge) * (w // merge) != n:
                raise ValueError(f"micro-batch {k}, sample {i}: an image of grid {(t, h, w)} needs "
                                 f"{t * (h // merge) * (w // merge)} image tokens, input_ids has {n} at {start}")
        shapes.append(BatchShape((int(ids.shape[0]), int(ids.shape[1])), grids, runs))
    return tuple(shapes)


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (never on a machine without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def flat_positions(shape: BatchShape) -> torch.Tensor:
    """Row-major positions in the flattened ``(b*s)`` sequence of the image-pad tokens, in order (a CPU long tensor):
    where :func:`scatter_rows` writes the visual tokens (what ``masked_scatter`` over the pad mask does)."""
    s = shape.ids_shape[1]
    parts = [torch.arange(i * s + start, i * s + start + n) for i, start, n in shape.runs]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def scatter_rows(x: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x`` (b, s, h) with rows ``positions`` of its flattened ``(b*s, h)`` view replaced by ``rows`` (n, h), in order.

    The same values as ``x.masked_scatter(pad_mask, rows)``; its backward is two index ops instead
    of ``masked_select`` (whose ``nonzero`` reads the device from the host)."""
    b, s, h = x.shape
    return x.reshape(b * s, h).index_copy(0, positions, rows.to(x.dtype)).view(b, s, h)


T = TypeVar("T")


class ShapeCache(Generic[T]):
    """Device tensors built once per :class:`BatchShape` (``build(shape)``), at most :data:`MAX_SHAPES` kept."""

    def __init__(self, build: Callable[[BatchShape], T]) -> None:
        self.build = build
        self._made: dict[Hashable, T] = {}

    def __call__(self, shape: BatchShape) -> T:
        got = self._made.get(shape)
        if got is None:
            if len(self._made) >= MAX_SHAPES:
                self._made.pop(next(iter(self._made)))
            got = self._made[shape] = self.build(shape)
        return got

    def __len__(self) -> int:
        return len(self._made)

