"""The Qwen2-VL and Qwen2.5-VL vision towers on one device; their blocks expose braid's four units.

The tower reads what Hugging Face's Qwen2-VL image processor produces: ``pixel_values``
of shape ``(N, channels * temporal_patch * patch * patch)`` -- the patches of every image
of a batch, one after another, each image's patches merge-block-major (the ``merge x
merge`` patches of one merged token are consecutive) -- and ``image_grid_thw`` ``(images,
3)``: each image's grid of ``t x h x w`` patches. It returns one token per merge block,
``(N / merge**2, lm_hidden)``, in the same order.

* patch embedding: HF's ``Conv3d`` with kernel = stride = ``(temporal_patch, patch,
  patch)`` is a linear map of each flattened patch (no bias);
* blocks: pre-norm attention with a QKV bias and an out-projection bias, 2D rotary
  positions (a head's dimensions rotate with the patch row and column: HF's axial
  layout), bidirectional attention within one image (``cu_seqlens``); then a pre-norm MLP.
  Qwen2-VL: LayerNorm (with bias) and a QuickGELU ``fc1 -> fc2`` MLP. Qwen2.5-VL: RMSNorm,
  a SwiGLU MLP with biases, and **window attention**: patches are reordered window by
  window (:func:`window_index`), and every block not in ``full_attention_blocks``
  attends only within its window;
* merger: norm (Qwen2-VL LayerNorm, Qwen2.5-VL RMSNorm), group ``merge x merge``
  patches, MLP ``4*hv -> 4*hv -> lm_hidden`` with exact GELU; Qwen2.5-VL undoes the window
  order on the merged tokens.

A block's units (Pre-Attn, Attn, Pre-MLP, MLP) are the LM layer's, so the chunk runner
drives them like LM layers and braided schedules run on the vision stage (paper Sec. 5,
MLLM). Per-batch facts (rotary angles, attention segments, window order) live in a
:class:`VisionLayout` that the tower or the vision chunk hands to every block.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from braid.core.braiding import Unit
from braid.models.qwen2 import RMSNorm, _head_rows
from braid.models.seam import UnitMethods
from braid.tp.layers import ColumnParallelLinear, RowParallelLinear

VISION_KINDS = ("qwen2_vl", "qwen2_5_vl")


@dataclass(frozen=True, slots=True)
class ViTConfig:
    """Vision tower shape. Defaults are tiny (tests); Qwen2-VL-7B: hidden 1280, 32 layers, 16 heads, ffn 5120, patch 14.

    ``kind``: ``qwen2_vl`` (LayerNorm, QuickGELU MLP, full attention) or ``qwen2_5_vl``
    (RMSNorm, SwiGLU, window attention of ``window`` pixels except in
    ``full_attention_blocks``). ``image_size`` is only the examples' default image side
    (and what FLOP counts assume): the tower takes any image whose sides are multiples of
    ``patch * merge``.
    """

    kind: str = "qwen2_vl"
    hidden: int = 32
    layers: int = 2
    heads: int = 4
    ffn: int = 64
    patch: int = 4
    temporal_patch: int = 2
    merge: int = 2
    channels: int = 3
    window: int = 0
    full_attention_blocks: tuple[int, ...] = ()
    rope_theta: float = 10_000.0
    eps: float = 1e-6
    image_size: int = 16

    def __post_init__(self) -> None:
        if self.kind not in VISION_KINDS:
            raise ValueError(f"unknown vision tower kind {self.kind!r}; valid: {', '.join(VISION_KINDS)}")
        if self.hidden % self.heads or (self.hidden // self.heads) % 4:
            raise ValueError(f"ViT hidden ({self.hidden}) / heads ({self.heads}) must be a head size divisible by 4 (2D rotary)")
        if self.layers < 1:
            raise ValueError(f"the ViT needs at least one block, got layers={self.layers}")
        if self.image_size % (self.patch * self.merge):
            raise ValueError(
                f"image size {self.image_size} must be a multiple of patch*merge = {self.patch}*{self.merge}; "
                f"use e.g. --image-size {self.patch * self.merge * max(1, self.image_size // (self.patch * self.merge))}"
            )
        if self.kind == "qwen2_5_vl" and (self.window <= 0 or self.window % (self.patch * self.merge)):
            raise ValueError(f"a qwen2_5_vl tower needs a window (pixels) that is a positive multiple of patch*merge, got {self.window}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def patch_dim(self) -> int:
        """Features of one flattened patch (channels x temporal patch x patch x patch)."""
        return self.channels * self.temporal_patch * self.patch * self.patch

    @property
    def grid(self) -> int:
        """Patches per side of an ``image_size`` image."""
        return self.image_size // self.patch

    @property
    def patches(self) -> int:
        return self.grid * self.grid

    @property
    def visual_tokens(self) -> int:
        """Tokens the merger hands to the language model for one ``image_size`` image."""
        return self.patches // (self.merge * self.merge)

    def full_attention(self, block: int) -> bool:
        """Whether ``block`` attends over the whole image (always, for Qwen2-VL)."""
        return self.kind == "qwen2_vl" or block in self.full_attention_blocks


# -- per-batch layout: positions, attention segments, window order ----------------------------
def patchify(images: torch.Tensor, cfg: ViTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``(b, c, H, W)`` -> ``(pixel_values (N, patch_dim), image_grid_thw (b, 3))`` as HF's processor lays them out.

    Each image is one frame repeated ``temporal_patch`` times (HF's image path); no
    resizing or normalisation. ``H`` and ``W`` must be multiples of ``patch * merge``.
    """
    b, _, hgt, wid = images.shape
    pixel_values = patch_rows(images, cfg)
    grid = torch.tensor([[1, hgt // cfg.patch, wid // cfg.patch]] * b, dtype=torch.long, device=images.device)
    return pixel_values, grid


def patch_rows(images: torch.Tensor, cfg: ViTConfig) -> torch.Tensor:
    """The ``pixel_values`` of :func:`patchify` alone: device work only (no grid tensor made from the host)."""
    b, c, hgt, wid = images.shape
    p, m, t = cfg.patch, cfg.merge, cfg.temporal_patch
    if c != cfg.channels or hgt % (p * m) or wid % (p * m):
        raise ValueError(f"images of shape {tuple(images.shape)}: need {cfg.channels} channels and sides that are multiples of {p * m}")
    gh, gw = hgt // p, wid // p
    x = images.unsqueeze(1).expand(b, t, c, hgt, wid)
    x = x.reshape(b, t, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(b * gh * gw, cfg.patch_dim)


def patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """Row and column ``(N, 2)`` of every patch, merge-block-major, frames repeated (HF's vision position ids)."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        pos = torch.stack([rows.reshape(shape).transpose(1, 2).flatten(), cols.reshape(shape).transpose(1, 2).flatten()], -1)
        out.append(pos.repeat(t, 1))
    return torch.cat(out).to(grid_thw.device)


def window_index(grid_thw: torch.Tensor, cfg: ViTConfig) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's window order: merge-unit permutation and the lengths (in patches) of the attention windows.

    Windows are ``window / patch / merge`` merged tokens on a side, tiled from the top
    left of each frame; partial windows at the right and bottom edges are smaller.
    """
    side = cfg.window // cfg.merge // cfg.patch
    index, lengths, offset = [], [], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // cfg.merge, w // cfg.merge
        ids = torch.arange(t * gh * gw).reshape(t, gh, gw)
        ph, pw = -gh % side, -gw % side
        padded = F.pad(ids, (0, pw, 0, ph), value=-1)
        nh, nw = (gh + ph) // side, (gw + pw) // side
        padded = padded.reshape(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(-1, side * side)
        for win in padded:
            keep = win[win >= 0]
            if keep.numel():
                index.append(keep + offset)
                lengths.append(keep.numel() * cfg.merge * cfg.merge)
        offset += t * gh * gw
    return torch.cat(index).to(grid_thw.device), lengths


def _rotary(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Axial 2D rotary angles ``(N, head_dim)``: ``[row | col | row | col]`` frequencies, fp32."""
    spatial = head_dim // 2
    inv = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float32, device=positions.device) / spatial))
    freqs = positions[..., None].float() * inv  # (N, 2, head_dim/4)
    hw = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
    ang = torch.cat([hw, hw], dim=-1)
    return ang.cos(), ang.sin()


@dataclass(frozen=True, slots=True)
class VisionLayout:
    """What every block needs about one batch of images.

    ``cos``/``sin`` ``(N, head_dim)`` in the tower's patch order; ``full``/``windows``:
    lengths of the attention segments (one per frame / per window); ``order`` (merge units,
    window order) and ``reverse`` (its inverse) for Qwen2.5-VL, ``None`` for Qwen2-VL.
    ``masks``: where the segments are device data instead (a micro-batch padded to a fixed
    patch count, :mod:`braid.models.vlm_pack`), the block-diagonal ``(N, N)`` masks of the
    full and the window segments (``full``/``windows`` are then empty).
    """

    cos: torch.Tensor
    sin: torch.Tensor
    full: list[int]
    windows: list[int]
    order: torch.Tensor | None
    reverse: torch.Tensor | None
    masks: tuple[torch.Tensor, torch.Tensor] | None = None

    def segments(self, full_attention: bool) -> list[int]:
        return self.full if full_attention else self.windows

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, full_attention: bool) -> torch.Tensor:
        """Attention of ``q, k, v`` (1, heads, N, d) within the full or window segments: by their lengths
        (:func:`segment_attention`), or one call under their block-diagonal mask (a static shape)."""
        if self.masks is None:
            return segment_attention(q, k, v, self.segments(full_attention))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.masks[0 if full_attention else 1])

    def reorder(self, x: torch.Tensor, unit: int) -> torch.Tensor:
        """Rows of ``x`` (N, ...) in window order (groups of ``unit`` rows move together); identity without windows."""
        return x if self.order is None else _reorder(x, self.order, unit)


def _reorder(x: torch.Tensor, order: torch.Tensor, unit: int) -> torch.Tensor:
    return x.reshape(x.shape[0] // unit, unit, *x.shape[1:])[order].reshape(x.shape)


def vision_layout(grid_thw: torch.Tensor, cfg: ViTConfig) -> VisionLayout:
    """The :class:`VisionLayout` of a batch of images with grids ``grid_thw`` (images, 3)."""
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"image_grid_thw must be (images, 3), got shape {tuple(grid_thw.shape)}")
    if bool(((grid_thw[:, 1:] % cfg.merge) != 0).any()):
        raise ValueError(f"every image grid's height and width must be multiples of merge={cfg.merge}, got {grid_thw.tolist()}")
    cos, sin = _rotary(patch_positions(grid_thw, cfg.merge), cfg.head_dim, cfg.rope_theta)
    full = [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]
    order = reverse = None
    windows = full
    if cfg.kind == "qwen2_5_vl":
        order, windows = window_index(grid_thw, cfg)
        reverse = torch.argsort(order)
        unit = cfg.merge * cfg.merge
        cos, sin = _reorder(cos, order, unit), _reorder(sin, order, unit)
    return VisionLayout(cos, sin, full, windows, order, reverse)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (b, heads, N, d) by angles ``(N, d)`` in fp32 (rotate-half form), back to ``x``'s dtype."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    d = x.shape[-1]
    rot = torch.cat([-xf[..., d // 2 :], xf[..., : d // 2]], dim=-1)
    return (xf * cos + rot * sin).to(x.dtype)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Bidirectional attention of ``q, k, v`` (1, heads, N, d) within consecutive segments of ``lengths``.

    Runs of equal-length segments (the full windows of Qwen2.5-VL, equal images) go through
    one batched attention call each.
    """
    outs, start, i = [], 0, 0
    heads, d = q.shape[1], q.shape[-1]
    while i < len(lengths):
        j = i
        while j < len(lengths) and lengths[j] == lengths[i]:
            j += 1
        n, L = j - i, lengths[i]
        qs, ks, vs = (t[:, :, start : start + n * L].reshape(heads, n, L, d).transpose(0, 1) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1).reshape(1, heads, n * L, d))
        start, i = start + n * L, j
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# -- blocks ------------------------------------------------------------------------------------
class VisionBlock(UnitMethods, nn.Module):
    """One ViT block of ``cfg.kind``; ``heads``/``ffn`` are the *local* (TP shard) sizes, ``tp`` the TP size.

    The residual is fused into the Attn and MLP units as in :class:`~braid.models.qwen2.Qwen2Layer`.
    ``layout`` must be set (by the tower or the chunk) before a forward.
    """

    def __init__(self, cfg: ViTConfig, index: int, heads: int | None = None, ffn: int | None = None, tp: int = 1) -> None:
        super().__init__()
        h, hd = cfg.hidden, cfg.head_dim
        self.cfg, self.index, self.tp = cfg, index, tp
        self.heads = self.kv_heads = heads or cfg.heads
        self.head_dim = hd
        self.full_attention = cfg.full_attention(index)
        self.layout: VisionLayout | None = None
        self.sp = None  # no sequence parallelism in the vision tower
        f = ffn or cfg.ffn
        norm = (lambda: nn.LayerNorm(h, eps=cfg.eps)) if cfg.kind == "qwen2_vl" else (lambda: RMSNorm(h, cfg.eps))
        self.norm1, self.norm2 = norm(), norm()
        self.q_proj = nn.Linear(h, self.heads * hd, bias=True)
        self.k_proj = nn.Linear(h, self.heads * hd, bias=True)
        self.v_proj = nn.Linear(h, self.heads * hd, bias=True)
        self.o_proj = nn.Linear(self.heads * hd, h, bias=True)
        if cfg.kind == "qwen2_vl":
            self.fc1 = nn.Linear(h, f, bias=True)
            self.fc2 = nn.Linear(f, h, bias=True)
        else:
            self.gate_proj = nn.Linear(h, f, bias=True)
            self.up_proj = nn.Linear(h, f, bias=True)
            self.down_proj = nn.Linear(f, h, bias=True)

    # -- units (the four-unit layer protocol of the chunk runner) ---------------------------
    def unit_norm(self, unit: Unit) -> nn.Module:
        """The norm that starts ``pre_attn`` / ``pre_mlp`` (Qwen2-VL: a LayerNorm, with a bias)."""
        return self.norm1 if unit is Unit.PRE_ATTN else self.norm2

    def unit_weights(self, unit: Unit) -> tuple[nn.Module, ...]:
        """The linear layers of ``unit`` (their weight gradients are the unit's W work)."""
        swiglu = self.cfg.kind == "qwen2_5_vl"
        return {
            Unit.PRE_ATTN: (self.q_proj, self.k_proj, self.v_proj),
            Unit.ATTN: (self.o_proj,),
            Unit.PRE_MLP: (self.gate_proj, self.up_proj) if swiglu else (self.fc1,),
            Unit.MLP: (self.down_proj,) if swiglu else (self.fc2,),
        }[unit]

    def qkv(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(1, N, hv) -> q, k, v (1, heads/t, N, d), q and k rotated by patch row/column (``positions`` unused)."""
        if self.layout is None:
            raise RuntimeError("VisionBlock.layout is not set: the tower or the vision chunk sets it per batch")
        b, n, _ = h.shape
        q, k, v = (p(h).view(b, n, self.heads, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        lay = self.layout
        return apply_rotary(q, lay.cos, lay.sin), apply_rotary(k, lay.cos, lay.sin), v

    def attn_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Bidirectional attention within each segment (frame or window) and the out-projection (partial over TP)."""
        o = self.layout.attend(q, k, v, self.full_attention)
        b, _, n, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))

    def attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.attn_core(q, k, v) + residual / self.tp

    def gate_up(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.cfg.kind == "qwen2_vl":
            return (self.fc1(h),)
        return self.gate_proj(h), self.up_proj(h)

    def mlp_core(self, *acts: torch.Tensor) -> torch.Tensor:
        if self.cfg.kind == "qwen2_vl":
            return self.fc2(quick_gelu(acts[0]))
        gate, up = acts
        return self.down_proj(F.silu(gate) * up)

    def mlp(self, *acts_and_residual: torch.Tensor) -> torch.Tensor:
        *acts, residual = acts_and_residual
        return self.mlp_core(*acts) + residual / self.tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Single-device forward (tp must be 1)."""
        if self.tp != 1:
            raise ValueError("VisionBlock.forward is the single-device path; a TP shard runs through the chunk runner")
        x = self.attn_core(*self.qkv(self.norm1(x))) + x
        return self.mlp_core(*self.gate_up(self.norm2(x))) + x


def parallelize_block(block: VisionBlock, tp_rank: int, tp_size: int) -> VisionBlock:
    """The TP shard of a ViT block (heads and MLP split, norms replicated), copied."""
    cfg = block.cfg
    for what, n in (("ViT heads", cfg.heads), ("ViT ffn", cfg.ffn)):
        if n % tp_size:
            raise ValueError(f"{what} ({n}) not divisible by tp={tp_size}")
    out = VisionBlock(cfg, block.index, cfg.heads // tp_size, cfg.ffn // tp_size, tp=tp_size)
    out.norm1, out.norm2 = copy.deepcopy(block.norm1), copy.deepcopy(block.norm2)
    rows = _head_rows(cfg.heads, cfg.head_dim, tp_rank, tp_size)
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(out, name, ColumnParallelLinear.from_full(getattr(block, name), tp_rank, tp_size, rows))
    out.o_proj = RowParallelLinear.from_full(block.o_proj, tp_rank, tp_size)
    cols = ("fc1",) if cfg.kind == "qwen2_vl" else ("gate_proj", "up_proj")
    for name in cols:
        setattr(out, name, ColumnParallelLinear.from_full(getattr(block, name), tp_rank, tp_size))
    down = "fc2" if cfg.kind == "qwen2_vl" else "down_proj"
    setattr(out, down, RowParallelLinear.from_full(getattr(block, down), tp_rank, tp_size))
    return out


class PatchMerger(nn.Module):
    """Norm, group ``merge x merge`` patches, MLP ``4*hv -> 4*hv -> lm_hidden`` (exact GELU): one token per group."""

    def __init__(self, vit: ViTConfig, lm_hidden: int) -> None:
        super().__init__()
        self.vit = vit
        wide = vit.hidden * vit.merge * vit.merge
        self.ln_q = nn.LayerNorm(vit.hidden, eps=vit.eps) if vit.kind == "qwen2_vl" else RMSNorm(vit.hidden, vit.eps)
        self.fc1 = nn.Linear(wide, wide, bias=True)
        self.fc2 = nn.Linear(wide, lm_hidden, bias=True)

    def group(self, x: torch.Tensor) -> torch.Tensor:
        """(1, N, hv) -> (1, N/4, 4*hv): normalised, the patches of one merge block side by side."""
        b, n, hv = x.shape
        return self.ln_q(x).reshape(b, n // (self.vit.merge ** 2), hv * self.vit.merge ** 2)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """(1, nv, 4*hv) -> (1, nv, lm_hidden); partial over TP when fc1/fc2 are column/row-parallel."""
        return self.fc2(F.gelu(self.fc1(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.group(x))


class VisionTower(nn.Module):
    """Patch embedding, ViT blocks and patch merger on one device: HF ``pixel_values`` -> visual tokens."""

    def __init__(self, vit: ViTConfig, lm_hidden: int) -> None:
        super().__init__()
        self.cfg = vit
        self.patch_embed = nn.Linear(vit.patch_dim, vit.hidden, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(vit, i) for i in range(vit.layers))
        self.merger = PatchMerger(vit, lm_hidden)
        self.vl_cfg: object | None = None  # the Qwen2VLConfig of the model holding the tower (set by Qwen2VLModel)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` (N, patch_dim), ``grid_thw`` (images, 3) -> (N / merge**2, lm_hidden) in image order."""
        check_pixels(pixel_values, grid_thw, self.cfg)
        layout = vision_layout(grid_thw, self.cfg)
        unit = self.cfg.merge ** 2
        x = self.patch_embed(layout.reorder(pixel_values.to(self.patch_embed.weight.dtype), unit)).unsqueeze(0)
        for blk in self.blocks:
            blk.layout = layout
            x = blk(x)
            blk.layout = None
        out = self.merger(x)[0]
        return out if layout.reverse is None else out[layout.reverse]


def check_pixels(pixel_values: torch.Tensor, grid_thw: torch.Tensor, cfg: ViTConfig) -> None:
    """One clear error when ``pixel_values`` do not match the grids or the patch size."""
    n = int(grid_thw.prod(-1).sum())
    if pixel_values.dim() != 2 or pixel_values.shape != (n, cfg.patch_dim):
        raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)}; image_grid_thw {grid_thw.tolist()} "
                         f"needs ({n}, {cfg.patch_dim}) (channels*temporal_patch*patch^2)")
