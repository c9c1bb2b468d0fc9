"""A Qwen2-VL-shaped vision-language model on one device: ViT -> patch merger -> Qwen2 LM.

The language model reads ``[visual tokens ; text tokens]``: the merger's outputs for one
image, then the caption's token embeddings. The loss is next-token cross-entropy on the
caption only (image positions and padding carry label ``-100``). Positions in the LM are
plain 1D RoPE over the joint sequence (Qwen2-VL's M-RoPE is a refinement this
reproduction leaves out: it changes no shape and no cost).

Placement for pipelines (paper Sec. 5, MLLM): the whole ViT with the merger is the first
virtual stage (on device 0), the LM's layers are spread over the other virtual stages, the
last one ``last_stage_lighter`` layers lighter (its head over a large vocabulary is heavy).
:func:`vlm_stage_layers` gives that split; :mod:`braid.models.vision_chunk` builds the chunks.

Size presets: ``tiny`` (CPU tests, seconds), ``small`` (one GPU), ``7b`` (Qwen2-VL-7B
shapes) and ``15b`` (the paper-sized MLLM of :mod:`braid.models_catalog`: a 14B LM with a 0.6B ViT).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from braid.models.qwen2 import Qwen2Config, Qwen2Model
from braid.models.vit import ViTConfig, VisionTower
from braid.partition import split_layers

IGNORE_INDEX = -100


@dataclass(frozen=True, slots=True)
class Qwen2VLConfig:
    """The language model and the vision tower."""

    lm: Qwen2Config
    vit: ViTConfig

    @property
    def visual_tokens(self) -> int:
        return self.vit.visual_tokens


LM_PRESETS: dict[str, Qwen2Config] = {
    "tiny": Qwen2Config(vocab_size=32, hidden=32, layers=4, heads=4, kv_heads=2, ffn=64),
    "small": Qwen2Config(vocab_size=32768, hidden=1024, layers=16, heads=16, kv_heads=4, ffn=2816),
    "7b": Qwen2Config(vocab_size=152064, hidden=3584, layers=28, heads=28, kv_heads=4, ffn=18944),
    "15b": Qwen2Config(vocab_size=152064, hidden=4096, layers=57, heads=32, kv_heads=8, ffn=14976),  # as qwen2-vl-15b in braid.models_catalog
}
VIT_PRESETS: dict[str, ViTConfig] = {
    "tiny": ViTConfig(hidden=32, layers=2, heads=4, ffn=64, patch=4, image_size=16),
    "small": ViTConfig(hidden=512, layers=8, heads=8, ffn=1536, patch=14, image_size=224),
    "7b": ViTConfig(hidden=1280, layers=32, heads=16, ffn=5120, patch=14, image_size=448),
    "15b": ViTConfig(hidden=1280, layers=32, heads=16, ffn=5120, patch=14, image_size=448),
}


def vlm_preset(name: str, image_size: int | None = None) -> Qwen2VLConfig:
    """A preset by name (``tiny``, ``small``, ``7b``, ``15b``); ``image_size`` overrides the ViT's."""
    if name not in LM_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid: {', '.join(LM_PRESETS)}")
    vit = VIT_PRESETS[name]
    if image_size is not None and image_size != vit.image_size:
        vit = ViTConfig(**{**{f: getattr(vit, f) for f in vit.__dataclass_fields__}, "image_size": image_size})
    return Qwen2VLConfig(LM_PRESETS[name], vit)


class Qwen2VLModel(nn.Module):
    """Vision tower + Qwen2 language model; the single-device reference of the pipelined runs."""

    def __init__(self, cfg: Qwen2VLConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.visual = VisionTower(cfg.vit, cfg.lm.hidden)
        self.lm = Qwen2Model(cfg.lm)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.2) -> None:
        """Deterministic init under the caller's seed (norm weights perturbed around 1, as the LM's)."""
        self.lm.reset_parameters(std)
        for name, p in self.visual.named_parameters():
            with torch.no_grad():
                if "norm" in name or "ln_q" in name:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                else:
                    p.normal_(0.0, std)

    def full_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Caption labels (b, s) -> labels of the joint sequence (b, visual_tokens + s), images masked."""
        pad = torch.full((labels.shape[0], self.cfg.visual_tokens), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
        return torch.cat([pad, labels], dim=1)

    def forward(self, pixels: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean caption-token cross-entropy: ``pixels`` (b, 3, H, W), ``tokens``/``labels`` (b, s)."""
        vis = self.visual(pixels)  # (b, nv, h)
        x = torch.cat([vis, self.lm.embed_tokens(tokens)], dim=1)  # (b, nv + s, h)
        for layer in self.lm.layers:
            x = layer(x)
        logits = self.lm.lm_head(self.lm.norm(x)).float()
        full = self.full_labels(labels)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), full.view(-1), ignore_index=IGNORE_INDEX)


def vlm_stage_layers(cfg: Qwen2VLConfig, num_stages: int, last_stage_lighter: int = 2) -> tuple[int, ...]:
    """Layers per virtual stage: the ViT's blocks on stage 0, the LM's spread over the rest.

    Raises ``ValueError`` with what to change when the LM cannot fill the stages.
    """
    if num_stages < 2:
        raise ValueError("a VLM needs at least 2 virtual stages (the ViT has its own): use pp >= 2 or a 2-chunk schedule (braided_v, zb_v, 1f1b_i)")
    lm = split_layers(cfg.lm.layers, num_stages, last_stage_lighter=last_stage_lighter, first_stage_layers=0)
    return (cfg.vit.layers,) + lm[1:]


def vlm_train_flops_per_sample(cfg: Qwen2VLConfig, text_seq: int) -> float:
    """Model FLOPs of forward + backward of one sample (3x forward; no recompute), for MFU."""
    v, lm = cfg.vit, cfg.lm
    n = v.patches
    vit_layer = 2 * n * (4 * v.hidden * v.hidden + 3 * v.hidden * v.ffn) + 4 * n * n * v.hidden
    wide = v.hidden * v.merge ** 2
    merger = 2 * v.visual_tokens * (wide * wide + wide * lm.hidden)
    vit = 2 * n * v.patch_dim * v.hidden + v.layers * vit_layer + merger
    return 3 * (vit + lm_forward_flops(lm, cfg.visual_tokens + text_seq))


def lm_forward_flops(lm: Qwen2Config, seq: int) -> float:
    """Forward FLOPs of one sequence through the LM (matmuls, causal attention, head)."""
    kv = lm.kv_heads * lm.head_dim
    layer = 2 * seq * (lm.hidden * (2 * lm.hidden + 2 * kv) + 3 * lm.hidden * lm.ffn) + 2 * seq * seq * lm.hidden
    return lm.layers * layer + 2 * seq * lm.hidden * lm.vocab_size
