"""Qwen2-VL / Qwen2.5-VL on one device: vision tower -> visual tokens in the text -> Qwen2 LM with M-RoPE.

Inputs are what Hugging Face's processor produces: ``input_ids`` (b, s) where every image
is ``<|vision_start|> <|image_pad|> x n <|vision_end|>`` (``n`` = the image's merged
tokens), ``pixel_values`` (N, channels*temporal_patch*patch^2) and ``image_grid_thw``
(images, 3). The embeddings of the image-pad tokens are replaced by the tower's tokens, in
order (several images of different sizes per batch are fine).

Positions are M-RoPE (:func:`rope_index`, as HF's ``get_rope_index``): a text token has
the same position on the three axes (temporal, height, width), counting on from the
previous token; an image's tokens take ``(t, row, col)`` offsets from the position after
the text before it, and the text after the image continues at ``start + max(h, w) /
merge``. A head's rotary frequencies are split into ``mrope_section`` parts, each rotated
by one axis (:func:`mrope`).

Labels: braid's are already shifted (``labels[i]`` is the target of token ``i``, ``-100``
where no loss is taken); :func:`shift_labels` turns HF's (unshifted) labels into them.

Placement for pipelines (paper Sec. 5, MLLM): the whole vision tower with the merger and
the text embedding is the first virtual stage (on device 0), the LM's layers are spread
over the others, the last one ``last_stage_lighter`` layers lighter.
:func:`vlm_stage_layers` gives that split; :mod:`braid.models.vision_chunk` builds the chunks.

Size presets live in :mod:`braid.cost.catalog` (the one list): ``qwen2-vl-tiny`` (CPU
tests), ``-small`` (one GPU), ``-2b``/``-7b`` (Qwen2-VL's shapes), ``-15b`` (the paper-sized
MLLM: a 14B LM with a 0.6B ViT), and ``qwen2.5-vl-tiny``/``-3b``/``-7b`` (Qwen2.5-VL's
tower); :func:`vlm_preset` and :func:`vl_config` make them runnable.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from braid.models.qwen2 import Qwen2Config, Qwen2Layer, Qwen2Model
from braid.models.vit import ViTConfig, VisionTower, patchify
from braid.core.partition import split_layers

if TYPE_CHECKING:
    from braid.cost.catalog import ModelConfig

IGNORE_INDEX = -100


@dataclass(frozen=True, slots=True)
class Qwen2VLConfig:
    """The language model, the vision tower, M-RoPE sections and the vision token ids."""

    lm: Qwen2Config
    vit: ViTConfig
    mrope_section: tuple[int, int, int] = (2, 1, 1)
    image_token_id: int = 31
    vision_start_token_id: int = 29
    vision_end_token_id: int = 30

    def __post_init__(self) -> None:
        if sum(self.mrope_section) != self.lm.head_dim // 2:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to head_dim/2 = {self.lm.head_dim // 2}")
        ids = (self.image_token_id, self.vision_start_token_id, self.vision_end_token_id)
        if any(not 0 <= i < self.lm.vocab_size for i in ids):
            raise ValueError(f"vision token ids {ids} must lie in the vocabulary (size {self.lm.vocab_size})")

    @property
    def tie_embeddings(self) -> bool:
        """Whether the LM head reuses the text embedding (Qwen2-VL-2B, Qwen2.5-VL-3B)."""
        return self.lm.tie_embeddings

    @property
    def visual_tokens(self) -> int:
        """Merged tokens of one ``vit.image_size`` image."""
        return self.vit.visual_tokens

    def image_tokens(self, n: int | None = None) -> list[int]:
        """The token ids of one image in the text: start, ``n`` image pads (default: one ``image_size`` image), end."""
        n = self.visual_tokens if n is None else n
        return [self.vision_start_token_id] + [self.image_token_id] * n + [self.vision_end_token_id]


# Qwen2-VL's vision token ids in its 151k vocabulary; smaller (synthetic) vocabularies use their last three ids.
_VISION_TOKEN_IDS = (151655, 151652, 151653)  # image pad, vision start, vision end
VL_PREFIX = "qwen2-vl-"  # the family prefix of the examples' short preset names (tiny, small, 2b, 7b, 15b)


def _mrope_section(head_dim: int) -> tuple[int, int, int]:
    """Qwen2-VL's split of a head's rotary frequencies over (time, row, column): 2:3:3 ((16, 24, 24) at head
    size 128), or as near as a small head allows."""
    half = head_dim // 2
    if half % 8 == 0:
        return half // 4, 3 * half // 8, 3 * half // 8
    return half - 2 * (half // 4), half // 4, half // 4


def vl_config(model: "ModelConfig", image_size: int | None = None) -> Qwen2VLConfig:
    """The runnable config of a vision-language preset of :mod:`braid.cost.catalog` (the one preset list).

    ``image_size`` overrides the preset's image side (the examples' images; FLOP counts).
    """
    from braid.models.shapes import decoder_config

    if model.vit is None:
        raise ValueError(f"model {model.name!r} has no vision tower; pick a vision-language preset ({', '.join(vl_names())})")
    lm = decoder_config(model)
    v = model.vit
    vit = ViTConfig(kind=v.kind, hidden=v.hidden, layers=v.layers, heads=v.heads, ffn=v.ffn, patch=v.patch,
                      temporal_patch=v.temporal_patch, merge=v.merge, channels=v.channels, window=v.window,
                      full_attention_blocks=v.full_attention_blocks, image_size=image_size or v.image_size)
    ids = _VISION_TOKEN_IDS if lm.vocab_size > max(_VISION_TOKEN_IDS) else (lm.vocab_size - 1, lm.vocab_size - 3, lm.vocab_size - 2)
    return Qwen2VLConfig(lm, vit, _mrope_section(lm.head_dim), *ids)


def vl_names() -> list[str]:
    """The vision-language presets of :mod:`braid.cost.catalog`."""
    from braid.cost.catalog import MODELS

    return [n for n, m in MODELS.items() if m.vit is not None]


def vlm_preset(name: str, image_size: int | None = None, kind: str | None = None) -> Qwen2VLConfig:
    """A vision-language preset of :mod:`braid.cost.catalog` by name: ``qwen2-vl-7b``, ``qwen2.5-vl-7b``, ...,
    or short (``tiny``, ``small``, ``2b``, ``7b``, ``15b`` mean ``qwen2-vl-*``).

    ``image_size`` overrides the examples' image side; ``kind="qwen2_5_vl"`` gives the
    Qwen2.5-VL tower (RMSNorm, SwiGLU, window attention; full attention in every eighth
    block from the eighth, as Qwen2.5-VL's [7, 15, 23, 31]) of the same widths.
    """
    from braid.cost.catalog import MODELS

    full = name if name in MODELS else VL_PREFIX + name
    if full not in MODELS or MODELS[full].vit is None:
        raise ValueError(f"unknown model preset {name!r}; valid: {', '.join(vl_names())} "
                         f"(or short: {', '.join(n.removeprefix(VL_PREFIX) for n in vl_names() if n.startswith(VL_PREFIX))})")
    cfg = vl_config(MODELS[full], image_size)
    vit = cfg.vit
    if kind is not None and kind != vit.kind:
        window = vit.window or min(112, vit.image_size)
        full_blocks = tuple(range(min(7, vit.layers - 1), vit.layers, 8)) if kind == "qwen2_5_vl" else ()
        vit = replace(vit, kind=kind, window=window, full_attention_blocks=full_blocks)
    return replace(cfg, vit=vit)


def __getattr__(name: str) -> object:
    """``PRESETS`` / ``LM_PRESETS``: the short-named Qwen2-VL presets (and their LMs), read from the catalog."""
    if name in ("PRESETS", "LM_PRESETS"):
        presets = {n: vlm_preset(n) for n in ("tiny", "small", "7b", "15b")}
        return presets if name == "PRESETS" else {n: c.lm for n, c in presets.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- positions ---------------------------------------------------------------------------------
def rope_index(cfg: Qwen2VLConfig, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None = None,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """M-RoPE positions ``(3, b, s)`` of ``input_ids`` (b, s), as HF's ``get_rope_index`` (padding gets 0).

    Every maximal run of image-pad tokens is one image, taking the next row of
    ``image_grid_thw``; its length must be the image's merged token count.
    """
    b, s = input_ids.shape
    out = torch.zeros(3, b, s, dtype=torch.long, device=input_ids.device)
    grids = iter([] if image_grid_thw is None else image_grid_thw.tolist())
    m = cfg.vit.merge
    for i in range(b):
        keep = torch.ones(s, dtype=torch.bool, device=input_ids.device) if attention_mask is None else attention_mask[i].bool()
        is_image = (input_ids[i][keep] == cfg.image_token_id).tolist()
        parts, pos, j = [], 0, 0
        while j < len(is_image):
            k = j
            while k < len(is_image) and is_image[k] == is_image[j]:
                k += 1
            if not is_image[j]:
                parts.append(torch.arange(pos, pos + k - j).expand(3, -1))
                pos += k - j
            else:
                try:
                    t, h, w = next(grids)
                except StopIteration:
                    raise ValueError(f"sample {i}: more images in input_ids than rows in image_grid_thw") from None
                gh, gw = h // m, w // m
                if t * gh * gw != k - j:
                    raise ValueError(f"sample {i}: an image of grid {(t, h, w)} needs {t * gh * gw} image tokens, input_ids has {k - j}")
                tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
                parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
                pos += max(h, w) // m
            j = k
        if parts:
            out[:, i, keep] = torch.cat(parts, dim=1).to(out.device)
    if next(grids, None) is not None:
        raise ValueError("image_grid_thw has more rows than there are images in input_ids")
    return out


def mrope(x: torch.Tensor, positions: torch.Tensor, theta: float, section: tuple[int, int, int]) -> torch.Tensor:
    """Multimodal rotary embedding of ``x`` (b, heads, s, d) at ``positions`` (3, b, s): section ``i`` of the
    frequencies rotates with axis ``i % 3`` (HF's ``mrope_section`` layout)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    freqs = positions.to(x.device)[..., None].float() * inv  # (3, b, s, d/2)
    parts = freqs.split(list(section), dim=-1)
    ang = torch.cat([p[i % 3] for i, p in enumerate(parts)], dim=-1)  # (b, s, d/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    cos, sin = torch.cat([cos, cos], -1).unsqueeze(1), torch.cat([sin, sin], -1).unsqueeze(1)
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1) * sin


class MRopeLayer(Qwen2Layer):
    """A Qwen2 decoder layer whose positions may be M-RoPE ``(3, b, s)`` (1D positions: plain RoPE)."""

    mrope_section: tuple[int, int, int] = (2, 1, 1)

    @classmethod
    def from_layer(cls, layer: Qwen2Layer, section: tuple[int, int, int]) -> "MRopeLayer":
        """``layer`` (a freshly built full layer or TP shard, not shared) turned into an M-RoPE layer in place."""
        layer.__class__ = cls
        layer.mrope_section = tuple(section)
        return layer

    def qkv(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if positions is None or positions.dim() != 3:
            return super().qkv(h, positions)
        q, k, v = self.project_qkv(h)
        return mrope(q, positions, self.theta, self.mrope_section), mrope(k, positions, self.theta, self.mrope_section), v


# -- the model ---------------------------------------------------------------------------------
def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF's labels (the target of token ``i`` at ``i``; the model shifts) -> braid's (target of token ``i`` at ``i``'s successor)."""
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1)


def vision_inputs(cfg: Qwen2VLConfig, pixels: torch.Tensor | Sequence[torch.Tensor] | None,
                  image_grid_thw: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(pixel_values, image_grid_thw)`` from either HF's processor outputs, a batch of images ``(b, c, H, W)``
    (one image per sample, laid out by :func:`braid.models.vit.patchify`), or a list of images ``(c, H, W)``
    of any sizes (one per sample: the examples' ``--image-sizes``)."""
    if pixels is None:
        return None, None
    if isinstance(pixels, (list, tuple)):
        if image_grid_thw is not None or not pixels or any(img.dim() != 3 for img in pixels):
            raise ValueError("a list of images needs one (c, H, W) image per sample and no image_grid_thw")
        parts = [patchify(img.unsqueeze(0), cfg.vit) for img in pixels]
        return torch.cat([pv for pv, _ in parts]), torch.cat([grid for _, grid in parts])
    if image_grid_thw is None:
        if pixels.dim() != 4:
            raise ValueError(f"pixel_values of shape {tuple(pixels.shape)} need image_grid_thw (or pass images (b, c, H, W))")
        return patchify(pixels, cfg.vit)
    return pixels, image_grid_thw


def split_item(cfg: Qwen2VLConfig, item: tuple, pixels: bool = True
               ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """A pipeline micro-batch item -> ``(pixel_values, input_ids, image_grid_thw)``.

    Items are ``(pixel_values, input_ids, image_grid_thw)`` (HF processor outputs) or
    ``(images (b, c, H, W), input_ids)`` (one image per sample). ``pixels=False`` skips
    building ``pixel_values`` from images (the LM chunks need only the grids).
    """
    if len(item) == 3:
        return item[0], item[1], item[2]
    if len(item) != 2:
        raise ValueError(f"a VLM micro-batch is (pixel_values, input_ids, image_grid_thw) or (images, input_ids), got {len(item)} tensors")
    images, ids = item
    if images.dim() != 4:
        raise ValueError(f"(images, input_ids) items need images (b, c, H, W), got shape {tuple(images.shape)}")
    if pixels:
        pv, grid = patchify(images, cfg.vit)
        return pv, ids, grid
    b, _, hgt, wid = images.shape
    return None, ids, torch.tensor([[1, hgt // cfg.vit.patch, wid // cfg.vit.patch]] * b, device=images.device)


class Qwen2VLModel(nn.Module):
    """Vision tower + Qwen2 language model with M-RoPE; the single-device reference of the pipelined runs."""

    def __init__(self, cfg: Qwen2VLConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.visual = VisionTower(cfg.vit, cfg.lm.hidden)
        self.visual.vl_cfg = cfg  # token ids and M-RoPE for stage wrappers that hold the tower only (braid.baselines.torch_pp)
        self.lm = Qwen2Model(cfg.lm)
        self.lm.layers = nn.ModuleList(MRopeLayer.from_layer(lay, cfg.mrope_section) for lay in self.lm.layers)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.2) -> None:
        """Deterministic init under the caller's seed (norm weights perturbed around 1, as the LM's)."""
        self.lm.reset_parameters(std)
        for name, p in self.visual.named_parameters():
            with torch.no_grad():
                if ("norm" in name or "ln_q" in name) and name.endswith("weight"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                else:
                    p.normal_(0.0, std)

    def embed(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
              image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings (b, s, h) with the image-pad tokens' replaced by the vision tower's outputs."""
        x = self.lm.embed_tokens(input_ids)
        if pixel_values is None:
            return x
        vis = self.visual(pixel_values, image_grid_thw)
        return scatter_visual(x, input_ids, vis.to(x.dtype), self.cfg.image_token_id)

    def logits(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
               image_grid_thw: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
               mm_token_type_ids: torch.Tensor | None = None, pixel_values_videos: torch.Tensor | None = None,
               video_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (b, s, vocab) for HF processor outputs (``model.logits(**processor(...))``).

        ``attention_mask`` may mark right padding only; ``mm_token_type_ids`` (transformers 5)
        must agree with the image-pad tokens; videos are refused.
        """
        if pixel_values_videos is not None or video_grid_thw is not None:
            raise ValueError("video inputs are not supported by braid's Qwen2-VL yet; pass images only")
        if mm_token_type_ids is not None and not torch.equal(mm_token_type_ids == 1, input_ids == self.cfg.image_token_id):
            raise ValueError("mm_token_type_ids marks other tokens as image tokens than input_ids' image-pad tokens")
        if attention_mask is not None:
            check_right_padding(attention_mask)
        pixel_values, image_grid_thw = vision_inputs(self.cfg, pixel_values, image_grid_thw)
        x = self.embed(input_ids, pixel_values, image_grid_thw)
        positions = rope_index(self.cfg, input_ids, image_grid_thw, attention_mask)
        for layer in self.lm.layers:
            x = layer.attn_core(*layer.qkv(layer.norm1(x), positions)) + x
            x = layer.mlp_core(*layer.gate_up(layer.norm2(x))) + x
        return self.lm.lm_head(self.lm.norm(x))

    def forward(self, pixels: torch.Tensor | None, input_ids: torch.Tensor, labels: torch.Tensor,
                image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy over labels != -100; ``labels`` (b, s) in braid's shifted convention.

        ``pixels``: HF ``pixel_values`` with ``image_grid_thw``, or images (b, c, H, W).
        """
        logits = self.logits(input_ids, pixels, image_grid_thw)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX)


def synthetic_batch(cfg: Qwen2VLConfig, batch: int, seq: int, generator: torch.Generator
                    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One micro-batch item ``(images (b, c, H, W), input_ids (b, seq))`` and braid's labels, random, as the
    examples' samples are laid out (one ``vit.image_size`` image per sample, its tokens
    :meth:`Qwen2VLConfig.image_tokens` first, then text; no loss on the image's tokens): what a
    measurement runs where the values do not matter. Text ids stay below the vision token ids.
    """
    img = cfg.image_tokens()
    if seq <= len(img):
        raise ValueError(f"a sequence of {seq} tokens leaves no text after the image's {len(img)} tokens")
    v = cfg.vit
    images = torch.rand(batch, v.channels, v.image_size, v.image_size, generator=generator)
    text_ids = min(cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id)
    text = torch.randint(0, text_ids, (batch, seq - len(img)), generator=generator)
    ids = torch.cat([torch.tensor(img).expand(batch, -1), text], dim=1)
    labels = torch.randint(0, cfg.lm.vocab_size, (batch, seq), generator=generator)
    labels[:, : len(img)] = IGNORE_INDEX
    return (images, ids), labels


def check_image_tokens(input_ids: torch.Tensor, visual_tokens: int, image_token_id: int) -> None:
    """One clear error when ``input_ids`` do not hold one image-pad token per visual token (a host sync)."""
    n = int((input_ids == image_token_id).sum())
    if n != visual_tokens:
        raise ValueError(f"input_ids hold {n} image tokens but the images give {visual_tokens} visual tokens")


def scatter_visual(x: torch.Tensor, input_ids: torch.Tensor, vis: torch.Tensor, image_token_id: int,
                   check: bool = True) -> torch.Tensor:
    """``x`` (b, s, h) with the rows at image-pad tokens replaced, in order, by ``vis`` (n, h).

    ``check=False`` skips the count check (done once per batch by the caller, off the hot path).
    """
    if check:
        check_image_tokens(input_ids, vis.shape[0], image_token_id)
    return x.masked_scatter((input_ids == image_token_id).unsqueeze(-1), vis)


def check_right_padding(attention_mask: torch.Tensor) -> None:
    """braid's attention is causal without a padding mask: padding must come last (HF's right padding)."""
    m = attention_mask.bool()
    if bool((~m[:, :-1] & m[:, 1:]).any()):
        raise ValueError("attention_mask has padding before tokens; braid's VL model needs right padding (padding_side='right')")


def vlm_stage_layers(cfg: Qwen2VLConfig, num_stages: int, last_stage_lighter: int = 2) -> tuple[int, ...]:
    """Layers per virtual stage: the ViT's blocks on stage 0, the LM's spread over the rest.

    Raises ``ValueError`` with what to change when the LM cannot fill the stages.
    """
    if num_stages < 2:
        raise ValueError("a VLM needs at least 2 virtual stages (the ViT has its own): use pp >= 2 or a 2-chunk schedule (braided_v, zb_v, 1f1b_i)")
    if last_stage_lighter != int(last_stage_lighter):
        raise ValueError(f"--last-stage-lighter {last_stage_lighter}: the VLM's stages hold whole layers; "
                         "half-layer cuts are for the decoder LM (examples/qwen2.py)")
    lm = split_layers(cfg.lm.layers, num_stages, last_stage_lighter=last_stage_lighter, first_stage_layers=0)
    return (cfg.vit.layers,) + lm[1:]


def vlm_train_flops_per_sample(cfg: Qwen2VLConfig, text_seq: int) -> float:
    """Model FLOPs of forward + backward of one sample with one ``image_size`` image (3x forward; no recompute), for MFU.

    Counted by the cost model (:func:`braid.cost.costs.model_forward_flops`; Qwen2.5-VL's window
    blocks as full attention, an upper bound).
    """
    from braid.cost.costs import model_forward_flops

    return 3 * model_forward_flops(catalog_shape(cfg, seq=cfg.visual_tokens + 2 + text_seq))


def lm_forward_flops(lm: Qwen2Config, seq: int) -> float:
    """Forward FLOPs of one sequence through the LM (matmuls, causal attention, head), by the cost model."""
    from braid.cost.costs import model_forward_flops
    from braid.models.shapes import from_decoder_config

    return model_forward_flops(from_decoder_config("lm", lm, seq=seq, micro_batch_size=1))


def catalog_shape(cfg: Qwen2VLConfig, name: str = "qwen2-vl", **changes: object) -> "ModelConfig":
    """The cost model's shape (:class:`braid.cost.catalog.ModelConfig`) of ``cfg`` (one sample per micro-batch)."""
    from braid.cost.catalog import ViTConfig as ShapeConfig
    from braid.models.shapes import from_decoder_config

    vit = ShapeConfig(**{f: getattr(cfg.vit, f) for f in ShapeConfig.__dataclass_fields__})
    return from_decoder_config(name, cfg.lm, "qwen2", vit=vit, **{"micro_batch_size": 1, **changes})


__all__ = ["IGNORE_INDEX", "MRopeLayer", "Qwen2VLConfig", "Qwen2VLModel", "catalog_shape", "mrope", "rope_index",
           "shift_labels", "split_item", "synthetic_batch", "vision_inputs", "vl_config", "vlm_preset", "vlm_stage_layers",
           "vlm_train_flops_per_sample"]
