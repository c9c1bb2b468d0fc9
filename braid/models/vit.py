"""A Qwen2-VL-style vision tower on one device, whose blocks expose the four braid units.

Shapes follow Qwen2-VL / Qwen2.5-VL: a patch embedding (a linear over flattened
``patch x patch`` pixel patches), transformer blocks with *2D* rotary positions (half of
each head's dimensions rotate with the patch row, half with the column) and
non-causal attention, then a patch merger that joins every 2x2 neighbourhood of patches
(norm, then an MLP from ``4 * hidden`` to the language model's hidden size) into one
visual token. Blocks use RMSNorm and a SwiGLU MLP (the Qwen2.5-VL choice), so a block is a
:class:`~braid.models.qwen2.Qwen2Layer` with another position encoding and no causal
mask -- the chunk runner drives its units (Pre-Attn, Attn, Pre-MLP, MLP) exactly like LM
layers, which is what lets braided schedules run on the vision stage (paper Sec. 5, MLLM).

Patches are ordered merge-block-major (the four patches of one 2x2 block are
consecutive), so the merger's grouping is a reshape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from braid.models.qwen2 import Qwen2Config, Qwen2Layer, RMSNorm, parallelize_layer


@dataclass(frozen=True, slots=True)
class ViTConfig:
    """Vision tower shape. Defaults are tiny (tests); Qwen2-VL-7B: hidden 1280, 32 layers, 16 heads, patch 14."""

    hidden: int = 32
    layers: int = 2
    heads: int = 4
    ffn: int = 64
    patch: int = 4
    image_size: int = 16
    merge: int = 2  # the merger joins merge x merge neighbouring patches
    channels: int = 3
    rope_theta: float = 10_000.0
    rms_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.hidden % self.heads or (self.hidden // self.heads) % 4:
            raise ValueError(f"ViT hidden ({self.hidden}) / heads ({self.heads}) must be a head size divisible by 4 (2D rotary)")
        if self.layers < 1:
            raise ValueError(f"the ViT needs at least one block, got layers={self.layers}")
        if self.image_size % (self.patch * self.merge):
            raise ValueError(
                f"image size {self.image_size} must be a multiple of patch*merge = {self.patch}*{self.merge}; "
                f"use e.g. --image-size {self.patch * self.merge * max(1, self.image_size // (self.patch * self.merge))}"
            )

    @property
    def grid(self) -> int:
        """Patches per image side."""
        return self.image_size // self.patch

    @property
    def patches(self) -> int:
        return self.grid * self.grid

    @property
    def visual_tokens(self) -> int:
        """Tokens the merger hands to the language model per image."""
        return self.patches // (self.merge * self.merge)

    @property
    def patch_dim(self) -> int:
        return self.channels * self.patch * self.patch

    def block_config(self) -> Qwen2Config:
        """The block shape in the LM layer's terms (no KV-head grouping)."""
        return Qwen2Config(hidden=self.hidden, layers=self.layers, heads=self.heads, kv_heads=self.heads, ffn=self.ffn,
                           rope_theta=self.rope_theta, rms_eps=self.rms_eps)


def patchify(pixels: torch.Tensor, cfg: ViTConfig) -> torch.Tensor:
    """(b, c, H, W) -> (b, patches, c*p*p), merge-block-major patch order."""
    b, c, hgt, wid = pixels.shape
    if (c, hgt, wid) != (cfg.channels, cfg.image_size, cfg.image_size):
        raise ValueError(f"pixels of shape {tuple(pixels.shape)}; the ViT expects (b, {cfg.channels}, {cfg.image_size}, {cfg.image_size})")
    g, m, p = cfg.grid // cfg.merge, cfg.merge, cfg.patch
    x = pixels.reshape(b, c, g, m, p, g, m, p)  # b, c, Gy, my, py, Gx, mx, px
    return x.permute(0, 2, 5, 3, 6, 1, 4, 7).reshape(b, cfg.patches, cfg.patch_dim)


def patch_positions(cfg: ViTConfig, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every patch, in :func:`patchify`'s order."""
    g, m = cfg.grid // cfg.merge, cfg.merge
    big = torch.arange(g, device=device)
    small = torch.arange(m, device=device)
    rows = (big.view(g, 1, 1, 1) * m + small.view(1, 1, m, 1)).expand(g, g, m, m)
    cols = (big.view(1, g, 1, 1) * m + small.view(1, 1, 1, m)).expand(g, g, m, m)
    return rows.reshape(-1), cols.reshape(-1)


def _rope_1d(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = torch.outer(pos.to(torch.float32), inv)
    ang = torch.cat([ang, ang], dim=-1)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rope_2d(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, theta: float) -> torch.Tensor:
    """2D rotary embedding of ``x`` (b, heads, n, d): first half of ``d`` by row, second half by column."""
    half = x.shape[-1] // 2
    return torch.cat([_rope_1d(x[..., :half], rows, theta), _rope_1d(x[..., half:], cols, theta)], dim=-1)


class VisionBlock(Qwen2Layer):
    """A ViT block: the LM layer's units with 2D rotary positions and bidirectional attention."""

    def __init__(self, vit: ViTConfig, heads: int | None = None, ffn: int | None = None, tp: int = 1) -> None:
        super().__init__(vit.block_config(), heads, heads, ffn, tp)
        self.vit = vit

    def qkv(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(b, n, hv) -> q, k, v (b, heads/t, n, d), q and k rotated by patch row/column."""
        b, n, _ = h.shape
        q = self.q_proj(h).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        rows, cols = patch_positions(self.vit, h.device)
        return rope_2d(q, rows, cols, self.theta), rope_2d(k, rows, cols, self.theta), v

    def attn_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Bidirectional attention over the image's patches and the out-projection (partial over TP)."""
        o = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        b, _, n, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))  # (b, n, hv) partial


def parallelize_block(block: VisionBlock, tp_rank: int, tp_size: int) -> VisionBlock:
    """The TP shard of a ViT block (heads and FFN split, norms replicated), copied."""
    cfg = block.vit.block_config()
    shard = parallelize_layer(block, cfg, tp_rank, tp_size)
    out = VisionBlock(block.vit, cfg.heads // tp_size, cfg.ffn // tp_size, tp=tp_size)
    for name, child in shard.named_children():
        setattr(out, name, child)
    return out


class PatchMerger(nn.Module):
    """Norm, group 2x2 patches, MLP ``4*hv -> 4*hv -> lm_hidden`` (GELU): one visual token per group."""

    def __init__(self, vit: ViTConfig, lm_hidden: int) -> None:
        super().__init__()
        self.vit = vit
        wide = vit.hidden * vit.merge * vit.merge
        self.ln_q = RMSNorm(vit.hidden, vit.rms_eps)
        self.fc1 = nn.Linear(wide, wide, bias=True)
        self.fc2 = nn.Linear(wide, lm_hidden, bias=True)

    def group(self, x: torch.Tensor) -> torch.Tensor:
        """(b, n, hv) -> (b, n/4, 4*hv): normalised, neighbouring patches side by side."""
        b, n, hv = x.shape
        return self.ln_q(x).reshape(b, n // (self.vit.merge ** 2), hv * self.vit.merge ** 2)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """(b, nv, 4*hv) -> (b, nv, lm_hidden); partial over TP when fc1/fc2 are column/row-parallel."""
        return self.fc2(F.gelu(self.fc1(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.group(x))


class VisionTower(nn.Module):
    """Patch embedding, ViT blocks and patch merger on one device: pixels -> visual tokens."""

    def __init__(self, vit: ViTConfig, lm_hidden: int) -> None:
        super().__init__()
        self.cfg = vit
        self.patch_embed = nn.Linear(vit.patch_dim, vit.hidden, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(vit) for _ in range(vit.layers))
        self.merger = PatchMerger(vit, lm_hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """(b, c, H, W) -> (b, visual_tokens, lm_hidden)."""
        x = self.patch_embed(patchify(pixels, self.cfg))  # (b, n, hv)
        for blk in self.blocks:
            x = blk(x)
        return self.merger(x)
