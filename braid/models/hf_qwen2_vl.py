"""Hugging Face Qwen2-VL / Qwen2.5-VL checkpoints <-> braid's :class:`~braid.models.qwen2_vl.Qwen2VLModel`.

Pure mappings, no file IO (``config.json`` is a dict here, weights a ``name -> tensor``
dict; reading and writing them belongs to the caller):

* :func:`config_from_hf` / :func:`config_to_hf` -- ``model_type`` ``qwen2_vl`` or
  ``qwen2_5_vl``; flat configs (the released ``config.json`` files: text fields at the top,
  ``rope_scaling.mrope_section``) and nested ones (``text_config``, ``rope_parameters``:
  what recent ``transformers`` write) are both read;
* :func:`hf_key` / :func:`weight_map` -- which HF tensor each braid parameter comes from
  (for sharded reads); :class:`VLWeights` -- names and shapes, one place: the vision
  attention's fused ``qkv`` is split into q/k/v, the ``Conv3d`` patch embedding is braid's
  linear over flattened patches. Both HF layouts are read (``model.visual.*`` /
  ``model.language_model.*``, the names of transformers' modules, and the released
  ``visual.*`` / ``model.*``, which ``save_pretrained`` writes);
* :func:`state_dict_from_hf` / :func:`state_dict_to_hf` -- whole state dicts
  (``state_dict_to_hf`` gives the module names, for ``load_state_dict``);
* :func:`model_from_hf` -- the model, its weights assigned (meta-device build).

The family's registry entry (:mod:`braid.models.registry`, HF ``model_type`` ``qwen2_vl`` and
``qwen2_5_vl``) is here too: :func:`braid.hf.load` / :func:`braid.hf.save` read and write
these checkpoints through :class:`VLWeights`. Tied word embeddings (Qwen2-VL-2B,
Qwen2.5-VL-3B) are read and written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection

import torch

from braid.models.qwen2 import Qwen2Config, decoder_hf_key
from braid.models.qwen2_vl import Qwen2VLConfig, Qwen2VLModel
from braid.models.registry import Family, register
from braid.models.vit import ViTConfig

MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def _text(cfg: dict[str, Any]) -> dict[str, Any]:
    return {**cfg, **cfg["text_config"]} if isinstance(cfg.get("text_config"), dict) else cfg


def _rope(text: dict[str, Any]) -> tuple[float, list[int]]:
    rp = text.get("rope_parameters") or {}
    rs = text.get("rope_scaling") or {}
    theta = rp.get("rope_theta", text.get("rope_theta", 1_000_000.0))
    section = rp.get("mrope_section") or rs.get("mrope_section")
    if not section:
        raise ValueError("config has no mrope_section (in rope_parameters or rope_scaling); is this a Qwen2-VL config?")
    return float(theta), [int(x) for x in section]


def config_from_hf(cfg: dict[str, Any]) -> Qwen2VLConfig:
    """braid's config from an HF ``config.json`` dict of ``model_type`` ``qwen2_vl`` / ``qwen2_5_vl``."""
    kind = cfg.get("model_type")
    if kind not in MODEL_TYPES:
        raise ValueError(f"model_type {kind!r} is not a Qwen2-VL family model ({', '.join(MODEL_TYPES)})")
    text, vis = _text(cfg), cfg["vision_config"]
    tied = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    if text.get("use_sliding_window"):
        raise ValueError("sliding-window attention (use_sliding_window) is not supported")
    theta, section = _rope(text)
    heads = text["num_attention_heads"]
    lm = Qwen2Config(vocab_size=text["vocab_size"], hidden=text["hidden_size"], layers=text["num_hidden_layers"],
                     heads=heads, kv_heads=text.get("num_key_value_heads") or heads, ffn=text["intermediate_size"],
                     rope_theta=theta, rms_eps=text.get("rms_norm_eps", 1e-6), tie_embeddings=tied)
    if lm.head_dim != text.get("head_dim", lm.head_dim):
        raise ValueError(f"head_dim {text['head_dim']} != hidden_size / num_attention_heads = {lm.head_dim} is not supported")
    vrope = (vis.get("rope_parameters") or {}).get("rope_theta", 10_000.0)
    image_size = vis["patch_size"] * vis["spatial_merge_size"] * 16  # the examples' default image: 448 px for patch 14
    common = dict(kind=kind, layers=vis["depth"], heads=vis["num_heads"], patch=vis["patch_size"],
                  temporal_patch=vis["temporal_patch_size"], merge=vis["spatial_merge_size"], channels=vis["in_channels"],
                  rope_theta=float(vrope))
    if kind == "qwen2_vl":
        if vis.get("hidden_act", "quick_gelu") != "quick_gelu":
            raise ValueError(f"Qwen2-VL vision hidden_act {vis['hidden_act']!r}: only quick_gelu is supported")
        hv = vis["embed_dim"]
        vit = ViTConfig(hidden=hv, ffn=int(hv * vis["mlp_ratio"]), image_size=image_size, **common)
        out_hidden = vis["hidden_size"]
    else:
        if vis.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Qwen2.5-VL vision hidden_act {vis['hidden_act']!r}: only silu is supported")
        vit = ViTConfig(hidden=vis["hidden_size"], ffn=vis["intermediate_size"], window=vis["window_size"],
                        full_attention_blocks=tuple(vis["fullatt_block_indexes"]),
                        image_size=image_size, **common)
        out_hidden = vis["out_hidden_size"]
    if out_hidden != lm.hidden:
        raise ValueError(f"vision output size {out_hidden} != text hidden_size {lm.hidden}")
    return Qwen2VLConfig(lm, vit, tuple(section), image_token_id=cfg["image_token_id"],
                         vision_start_token_id=cfg["vision_start_token_id"], vision_end_token_id=cfg["vision_end_token_id"])


def config_to_hf(cfg: Qwen2VLConfig) -> dict[str, Any]:
    """An HF ``config.json`` dict (nested ``text_config``/``vision_config``) for ``cfg``."""
    lm, v = cfg.lm, cfg.vit
    text = {"vocab_size": lm.vocab_size, "hidden_size": lm.hidden, "intermediate_size": lm.ffn,
            "num_hidden_layers": lm.layers, "num_attention_heads": lm.heads, "num_key_value_heads": lm.kv_heads,
            "rms_norm_eps": lm.rms_eps, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": lm.rope_theta, "mrope_section": list(cfg.mrope_section)}}
    vis: dict[str, Any] = {"depth": v.layers, "num_heads": v.heads, "patch_size": v.patch, "temporal_patch_size": v.temporal_patch,
                           "spatial_merge_size": v.merge, "in_channels": v.channels,
                           "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta}}
    if v.kind == "qwen2_vl":
        if v.ffn % v.hidden:
            raise ValueError(f"Qwen2-VL expresses the vision MLP as mlp_ratio: ffn {v.ffn} must be a multiple of hidden {v.hidden}")
        vis.update(embed_dim=v.hidden, mlp_ratio=v.ffn // v.hidden, hidden_size=lm.hidden, hidden_act="quick_gelu")
    else:
        vis.update(hidden_size=v.hidden, intermediate_size=v.ffn, out_hidden_size=lm.hidden, hidden_act="silu",
                   window_size=v.window, fullatt_block_indexes=list(v.full_attention_blocks))
    return {"model_type": v.kind, "architectures": ["Qwen2VLForConditionalGeneration" if v.kind == "qwen2_vl" else
                                                    "Qwen2_5_VLForConditionalGeneration"],
            "text_config": {**text, "tie_word_embeddings": lm.tie_embeddings}, "vision_config": vis,
            "tie_word_embeddings": lm.tie_embeddings,
            "image_token_id": cfg.image_token_id, "vision_start_token_id": cfg.vision_start_token_id,
            "vision_end_token_id": cfg.vision_end_token_id}


# -- weights -----------------------------------------------------------------------------------
_BLOCK_MODULES = {"norm1": "norm1", "norm2": "norm2", "q_proj": "attn.qkv", "k_proj": "attn.qkv", "v_proj": "attn.qkv",
                  "o_proj": "attn.proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2", "gate_proj": "mlp.gate_proj",
                  "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}
_MERGER_MODULES = {"ln_q": "ln_q", "fc1": "mlp.0", "fc2": "mlp.2"}
_QKV = ("q_proj", "k_proj", "v_proj")
RECENT, RELEASED = ("model.visual.", "model.language_model."), ("visual.", "model.")


def hf_key(name: str, released: bool = False) -> str:
    """A braid parameter name -> the HF tensor it lives in (q/k/v: the fused ``qkv``).

    ``released``: the ``visual.*`` / ``model.*`` layout of the published checkpoints; else
    the ``model.visual.*`` / ``model.language_model.*`` one recent ``transformers`` write.
    """
    vis, lm = RELEASED if released else RECENT
    if name.startswith("visual."):
        rest = name.removeprefix("visual.")
        if rest == "patch_embed.weight":
            return f"{vis}patch_embed.proj.weight"
        top, *parts = rest.split(".")
        if top == "merger" and len(parts) == 2 and parts[0] in _MERGER_MODULES:
            return f"{vis}merger.{_MERGER_MODULES[parts[0]]}.{parts[1]}"
        if top == "blocks" and len(parts) == 3 and parts[1] in _BLOCK_MODULES:
            return f"{vis}blocks.{parts[0]}.{_BLOCK_MODULES[parts[1]]}.{parts[2]}"
    elif name.startswith("lm."):
        rest = name.removeprefix("lm.")
        key = decoder_hf_key(rest)
        return key if rest.startswith("lm_head.") else lm + key.removeprefix("model.")
    raise ValueError(f"{name!r} is not a parameter of braid's Qwen2-VL model")


@dataclass(frozen=True, slots=True)
class VLWeights:
    """The :class:`braid.models.registry.HFWeights` of a Qwen2-VL / Qwen2.5-VL checkpoint: the vision
    attention's q/k/v are thirds of HF's fused ``qkv``, the patch embedding is HF's ``Conv3d`` kernel flattened."""

    cfg: Qwen2VLConfig
    released: bool = False

    def key(self, name: str) -> str:
        return hf_key(name, self.released)

    def keys(self, name: str) -> tuple[str, ...]:
        return (self.key(name),)

    def read(self, name: str, tensor: Callable[[str], torch.Tensor]) -> torch.Tensor:
        t = tensor(self.key(name))
        module = name.split(".")[-2]
        if name.startswith("visual.blocks.") and module in _QKV:
            return t.chunk(3, dim=0)[_QKV.index(module)]
        if name == "visual.patch_embed.weight":
            return t.reshape(self.cfg.vit.hidden, self.cfg.vit.patch_dim)
        return t

    def write(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        v = self.cfg.vit
        out: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            module = name.split(".")[-2]
            if name.startswith("visual.blocks.") and module in _QKV:
                if module != "q_proj":
                    continue
                parts = [name.replace(".q_proj.", f".{p}.") for p in _QKV]
                missing = [n for n in parts if n not in state]
                if missing:
                    raise ValueError(f"{missing[0]!r} must be written with {name!r} (HF fuses them into one qkv tensor)")
                t = torch.cat([state[n] for n in parts], dim=0)
            elif name == "visual.patch_embed.weight":
                t = t.reshape(v.hidden, v.channels, v.temporal_patch, v.patch, v.patch)
            out[self.key(name)] = t
        return out


def hf_weights(cfg: Qwen2VLConfig, keys: Collection[str] | None = None) -> VLWeights:
    """The layout of a checkpoint holding tensors ``keys``; None: the one :func:`braid.hf.save` writes --
    the released layout, which ``save_pretrained`` writes too and every ``transformers`` version reads."""
    if keys is None:
        return VLWeights(cfg, released=True)
    if any(k.startswith(RECENT[0]) for k in keys):
        return VLWeights(cfg)
    if any(k.startswith(RELEASED[0]) for k in keys):
        return VLWeights(cfg, released=True)
    raise ValueError("no vision tower weights (model.visual.* or visual.*) in the checkpoint: is this a Qwen2-VL checkpoint?")


def _param_names(cfg: Qwen2VLConfig) -> list[str]:
    with torch.device("meta"):
        return [n for n, _ in Qwen2VLModel(cfg).named_parameters()]


def weight_map(cfg: Qwen2VLConfig, released: bool = False) -> dict[str, str]:
    """braid parameter name -> the HF tensor it is read from (a slice of the fused ``qkv`` for q/k/v), so a
    loader can read only the tensors of the parameters it needs. ``released``: the ``visual.*`` / ``model.*`` layout."""
    return {n: hf_key(n, released) for n in _param_names(cfg)}


def state_dict_from_hf(cfg: Qwen2VLConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """braid's state dict (for :class:`~braid.models.qwen2_vl.Qwen2VLModel`) from HF weights; missing or
    unused HF tensors are one clear error (a tied model's checkpoint may also hold ``lm_head.weight``)."""
    weights = hf_weights(cfg, tensors.keys())
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in tensors:
            raise ValueError(f"HF weight {key!r} missing from the checkpoint")
        used.add(key)
        return tensors[key]

    out = {n: weights.read(n, take).contiguous() for n in _param_names(cfg)}
    if cfg.lm.tie_embeddings:
        used.add("lm_head.weight")
    extra = sorted(k for k in tensors if k not in used)
    if extra:
        raise ValueError(f"{len(extra)} HF weights have no place in braid's model, e.g. {extra[:3]}")
    if cfg.lm.tie_embeddings:
        out["lm.lm_head.weight"] = out["lm.embed_tokens.weight"]
    return out


def state_dict_to_hf(cfg: Qwen2VLConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF weights (the recent ``model.visual.*`` / ``model.language_model.*`` layout) from braid's state dict.

    A tied model's head is left out (HF ties ``lm_head.weight`` to the embedding on load)."""
    if cfg.lm.tie_embeddings:
        state = {n: t for n, t in state.items() if n != "lm.lm_head.weight"}
    return {k: t.detach().contiguous() for k, t in VLWeights(cfg).write(state).items()}


def model_from_hf(config: dict[str, Any], tensors: dict[str, torch.Tensor], *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> Qwen2VLModel:
    """braid's single-device model holding the HF weights (built on the meta device, no random init of real memory)."""
    cfg = config_from_hf(config)
    with torch.device("meta"):
        model = Qwen2VLModel(cfg)
    state = {k: t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)
             for k, t in state_dict_from_hf(cfg, tensors).items()}
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.lm.tie_embeddings:
        model.lm.lm_head.weight = model.lm.embed_tokens.weight
    return model


register(Family(
    "qwen2_vl", Qwen2VLModel, Qwen2VLConfig, MODEL_TYPES, config_from_hf, config_to_hf, hf_key,
    "Qwen2-VL / Qwen2.5-VL: vision tower (window attention for 2.5), M-RoPE Qwen2 LM; optionally tied head",
    hf_weights=hf_weights,
))
