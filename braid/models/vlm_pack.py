"""Images of different sizes in one static shape: a micro-batch padded to a fixed visual-token budget.

Real VLM data has images of many resolutions, so each micro-batch needs another number of
patches, attention segments, M-RoPE positions and visual-token positions -- another
:class:`~braid.models.vlm_batch.BatchShape`, and under a whole-step CUDA graph
(:mod:`braid.runtime.graphs`) another capture. Production trainers either bucket the
resolutions (one graph per bucket) or pad every micro-batch to one visual-token budget; this
module is the second way, which keeps one graph for the whole run:

* the patches of all images of a micro-batch, then zero rows up to ``budget * merge**2``
  patches (``pixel_values`` (P, patch_dim): a fixed shape);
* each patch's attention segment is *data*: an id per patch (its image; Qwen2.5-VL also its
  window) in the tower's order, the padding an id of its own, so one attention call under
  the block-diagonal mask ``id_i == id_j`` (:meth:`braid.models.vit.VisionLayout.attend`)
  keeps padding and real patches apart in both directions;
* the LM's input is a gather from ``[text embeddings; visual tokens]`` by one index per LM
  position (``token_src``): an image-pad position takes its visual token, every other
  position its own text embedding, and padded visual tokens are taken by no position. The
  LM's sequence keeps its length (samples are right-padded, their padding out of the loss)
  and real tokens see exactly what the unpadded model computes: every op is per row except
  attention, which the masks confine;
* M-RoPE positions ``(3, b, s)`` and the patches' (row, column) are data too.

:func:`pack_images` does the host work once per micro-batch (in the data loader, beside the
step); the chunks (:mod:`braid.models.vision_chunk`) turn a :class:`PackedImages` into their
device tensors with device work alone, and its :func:`packed_key` -- the budget and the
``input_ids`` shape -- is the same for every micro-batch of the run: the graph captured once
replays for all of them, the new values copied into its static buffers.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from braid.models.qwen2_vl import Qwen2VLConfig, rope_index
from braid.models.vit import ViTConfig, VisionLayout, _reorder, _rotary, patch_positions, patch_rows, window_index


class PackedImages(NamedTuple):
    """One micro-batch (one image per sample, any sizes) padded to a fixed visual-token budget.

    Positions 0 and 1 are ``pixel_values`` and ``input_ids`` like the other VLM items
    (:func:`braid.models.qwen2_vl.split_item`); the rest is what the chunks would otherwise
    derive on the host from the image grids.
    """

    pixel_values: torch.Tensor  # (P, patch_dim): every image's patches (merge-block-major), then zero rows
    input_ids: torch.Tensor  # (b, s): each sample right-padded to s
    patch_rc: torch.Tensor  # (P, 2) long: row and column of each patch (padding 0), patch order
    segment_ids: torch.Tensor  # (2, P) long: full-attention segment (the image) and window of each patch, tower order
    order: torch.Tensor  # (P / merge**2,) long: merge units in tower order (Qwen2.5-VL windows; else identity)
    token_src: torch.Tensor  # (b * s,) long: row of [text (b*s); visual tokens (P / merge**2)] each LM position takes
    mrope: torch.Tensor  # (3, b, s) long: M-RoPE positions


def image_tokens_of(vit: ViTConfig, height: int, width: int | None = None) -> int:
    """Visual tokens the merger hands the LM for one ``height x width`` image."""
    width = height if width is None else width
    return (height // vit.patch) * (width // vit.patch) // (vit.merge * vit.merge)


def check_image_sizes(vit: ViTConfig, sizes: Sequence[int]) -> None:
    """``sizes`` (square image sides) the tower takes: a non-empty list of positive multiples of
    ``patch * merge``; ``ValueError`` (one line) naming the first bad one and the nearest good one."""
    step = vit.patch * vit.merge
    if not sizes:
        raise ValueError("--image-sizes is empty; give one or more image sides, e.g. --image-sizes "
                         f"{step * 2},{step * 3},{step * 4}")
    for s in sizes:
        if s < 1 or s % step:
            raise ValueError(f"--image-sizes {s}: every image side must be a positive multiple of patch*merge = "
                             f"{vit.patch}*{vit.merge} = {step}; use e.g. {max(step, round(s / step) * step)}")


def pack_images(cfg: Qwen2VLConfig, images: Sequence[torch.Tensor], input_ids: torch.Tensor, budget: int) -> PackedImages:
    """The :class:`PackedImages` of a micro-batch: ``images`` one ``(c, H, W)`` per sample, ``input_ids`` (b, s)
    with each image's ``<vision_start> <image_pad> x n <vision_end>`` run, ``budget`` visual tokens.

    ``ValueError`` (one line) when the images need more than ``budget`` visual tokens or the ids
    do not hold one image-pad token per visual token. Host work (CPU tensors in, CPU tensors out).
    """
    vit, u = cfg.vit, cfg.vit.merge ** 2
    b, s = input_ids.shape
    if len(images) != b:
        raise ValueError(f"{len(images)} images for {b} samples: one image per sample")
    grid = torch.tensor([[1, img.shape[-2] // vit.patch, img.shape[-1] // vit.patch] for img in images], dtype=torch.long)
    real = int(grid.prod(-1).sum())  # patches
    if real > budget * u:
        raise ValueError(f"a micro-batch of images {[tuple(img.shape[-2:]) for img in images]} needs {real // u} visual "
                         f"tokens, more than the budget of {budget}; raise --visual-token-budget to at least {real // u}")
    pad_units = budget - real // u
    pixel_values = torch.cat([patch_rows(img.unsqueeze(0), vit) for img in images]
                             + [torch.zeros(pad_units * u, vit.patch_dim, dtype=images[0].dtype)])
    patch_rc = torch.cat([patch_positions(grid, vit.merge), torch.zeros(pad_units * u, 2, dtype=torch.long)])
    # each merge unit's image, padding units an image of their own (id b)
    unit_image = torch.cat([torch.repeat_interleave(torch.arange(b), grid.prod(-1) // u), torch.full((pad_units,), b)])
    identity = torch.arange(budget)
    if vit.kind == "qwen2_5_vl":
        win_order, lengths = window_index(grid, vit)
        order = torch.cat([win_order, identity[real // u:]])  # padding units stay last
        unit_window = torch.cat([torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths) // u),
                                 torch.full((pad_units,), len(lengths))])
    else:
        order, unit_window = identity, unit_image  # full attention in every block: no windows
    segment_ids = torch.stack([unit_image[order], unit_window]).repeat_interleave(u, dim=1)  # (2, P) tower order
    is_image = (input_ids == cfg.image_token_id).flatten()
    if int(is_image.sum()) != real // u:
        raise ValueError(f"input_ids hold {int(is_image.sum())} image-pad tokens for {real // u} visual tokens")
    token_src = torch.arange(b * s)
    token_src[is_image] = b * s + torch.arange(real // u)  # the k-th image-pad position takes visual token k
    return PackedImages(pixel_values, input_ids, patch_rc, segment_ids, order, token_src, rope_index(cfg, input_ids, grid))


def packed_key(item: PackedImages) -> tuple[str, int, tuple[int, ...]]:
    """What a padded micro-batch's step depends on beyond its tensors' values: its patch count and ``input_ids``
    shape (the same for every micro-batch of a run: one CUDA graph). Reads nothing on the device."""
    return ("padded", int(item.pixel_values.shape[0]), tuple(item.input_ids.shape))


def packed_layout(item: PackedImages, vit: ViTConfig) -> VisionLayout:
    """The tower's :class:`~braid.models.vit.VisionLayout` of a padded micro-batch, by device work alone
    (rotary angles from the patches' rows and columns, segment masks, the window order's inverse)."""
    u = vit.merge ** 2
    cos, sin = _rotary(item.patch_rc, vit.head_dim, vit.rope_theta)  # (P, head_dim), patch order
    full = item.segment_ids[0]
    masks = (full[:, None] == full[None, :],) * 2  # (P, P) block-diagonal, tower order; Qwen2-VL has no windows
    order = reverse = None
    if vit.kind == "qwen2_5_vl":
        window = item.segment_ids[1]
        masks = (masks[0], window[:, None] == window[None, :])
        order = item.order
        reverse = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
        cos, sin = _reorder(cos, order, u), _reorder(sin, order, u)
    return VisionLayout(cos, sin, [], [], order, reverse, masks)


def take_rows(text: torch.Tensor, visual: torch.Tensor, token_src: torch.Tensor) -> torch.Tensor:
    """The LM's input (b, s, h): row ``token_src[i]`` of ``[text (b*s, h); visual (n, h)]`` at each flat position ``i``.

    A gather, so its backward adds each row's gradient where it came from: padded visual tokens
    (taken by nobody) and the text rows under image pads get zero."""
    b, s, h = text.shape
    return torch.cat([text.reshape(b * s, h), visual.to(text.dtype)]).index_select(0, token_src).view(b, s, h)


def padding_waste(real_tokens: Sequence[int], budget: int) -> float:
    """Fraction of the visual tokens (``budget`` per micro-batch) that are padding, over micro-batches with
    ``real_tokens`` real ones each."""
    return 1.0 - sum(real_tokens) / (budget * len(real_tokens)) if real_tokens else 0.0


__all__ = ["PackedImages", "check_image_sizes", "image_tokens_of", "pack_images", "packed_key", "packed_layout",
           "padding_waste", "take_rows"]
