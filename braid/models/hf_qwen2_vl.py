"""Hugging Face Qwen2-VL / Qwen2.5-VL checkpoints <-> braid's :class:`~braid.models.qwen2_vl.Qwen2VLModel`.

Pure mappings, no file IO (``config.json`` is a dict here, weights a ``name -> tensor``
dict; reading and writing them belongs to the caller):

* :func:`config_from_hf` / :func:`config_to_hf` -- ``model_type`` ``qwen2_vl`` or
  ``qwen2_5_vl``; flat configs (the released ``config.json`` files: text fields at the top,
  ``rope_scaling.mrope_section``) and nested ones (``text_config``, ``rope_parameters``:
  what recent ``transformers`` write) are both read;
* :func:`weight_map` -- which HF tensor each braid parameter comes from (for sharded reads);
* :func:`model_from_hf` -- both at once: the model, its weights assigned (meta-device build);
* :func:`state_dict_from_hf` / :func:`state_dict_to_hf` -- weight names and shapes: the
  vision attention's fused ``qkv`` is split into q/k/v, the ``Conv3d`` patch embedding is
  braid's linear over flattened patches. Both HF layouts are read (``model.visual.*`` /
  ``model.language_model.*`` and the released ``visual.*`` / ``model.*``); the recent one
  is written.

Tied word embeddings (Qwen2-VL-2B, Qwen2.5-VL-3B) are refused for now: braid's Qwen2 LM
keeps the embedding and the head apart.
"""

from __future__ import annotations

from typing import Any

import torch

from braid.models.qwen2 import Qwen2Config
from braid.models.qwen2_vl import Qwen2VLConfig, Qwen2VLModel
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
    if cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)):
        raise ValueError("tied word embeddings are not supported for Qwen2-VL models yet (use a checkpoint with a separate lm_head)")
    if text.get("use_sliding_window"):
        raise ValueError("sliding-window attention (use_sliding_window) is not supported")
    theta, section = _rope(text)
    heads = text["num_attention_heads"]
    lm = Qwen2Config(vocab_size=text["vocab_size"], hidden=text["hidden_size"], layers=text["num_hidden_layers"],
                     heads=heads, kv_heads=text.get("num_key_value_heads") or heads, ffn=text["intermediate_size"],
                     rope_theta=theta, rms_eps=text.get("rms_norm_eps", 1e-6))
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
            "text_config": text, "vision_config": vis, "tie_word_embeddings": False,
            "image_token_id": cfg.image_token_id, "vision_start_token_id": cfg.vision_start_token_id,
            "vision_end_token_id": cfg.vision_end_token_id}


# -- weights -----------------------------------------------------------------------------------
_LM_LAYER = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight", "self_attn.q_proj.bias",
             "self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias",
             "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def _vision_block_names(kind: str, norm_bias: bool) -> dict[str, str]:
    """braid block parameter -> HF block parameter (q/k/v handled apart: HF fuses them)."""
    names = {"norm1.weight": "norm1.weight", "norm2.weight": "norm2.weight",
             "o_proj.weight": "attn.proj.weight", "o_proj.bias": "attn.proj.bias"}
    if norm_bias:
        names.update({"norm1.bias": "norm1.bias", "norm2.bias": "norm2.bias"})
    mlp = ("fc1", "fc2") if kind == "qwen2_vl" else ("gate_proj", "up_proj", "down_proj")
    for n in mlp:
        names.update({f"{n}.weight": f"mlp.{n}.weight", f"{n}.bias": f"mlp.{n}.bias"})
    return names


def _hf_prefixes(tensors: dict[str, torch.Tensor]) -> tuple[str, str]:
    """(vision prefix, LM prefix) of an HF state dict: the recent layout or the released one."""
    if any(k.startswith("model.visual.") for k in tensors):
        return "model.visual.", "model.language_model."
    if any(k.startswith("visual.") for k in tensors):
        return "visual.", "model."
    raise ValueError("no vision tower weights (model.visual.* or visual.*) in the state dict: is this a Qwen2-VL checkpoint?")


def _name_pairs(cfg: Qwen2VLConfig, vis: str, lm: str) -> list[tuple[str, str]]:
    """(braid name, HF name) for every parameter copied one to one."""
    v = cfg.vit
    pairs = [("visual.merger.fc1.weight", f"{vis}merger.mlp.0.weight"), ("visual.merger.fc1.bias", f"{vis}merger.mlp.0.bias"),
             ("visual.merger.fc2.weight", f"{vis}merger.mlp.2.weight"), ("visual.merger.fc2.bias", f"{vis}merger.mlp.2.bias"),
             ("visual.merger.ln_q.weight", f"{vis}merger.ln_q.weight"),
             ("lm.embed_tokens.weight", f"{lm}embed_tokens.weight"), ("lm.norm.weight", f"{lm}norm.weight"),
             ("lm.lm_head.weight", "lm_head.weight")]
    if v.kind == "qwen2_vl":
        pairs.append(("visual.merger.ln_q.bias", f"{vis}merger.ln_q.bias"))
    block = _vision_block_names(v.kind, norm_bias=v.kind == "qwen2_vl")
    for i in range(v.layers):
        pairs += [(f"visual.blocks.{i}.{b}", f"{vis}blocks.{i}.{h}") for b, h in block.items()]
    for i in range(cfg.lm.layers):
        pairs += [(f"lm.layers.{i}.{n.split('.', 1)[1] if n.startswith(('self_attn.', 'mlp.')) else n}", f"{lm}layers.{i}.{n}")
                  for n in _LM_LAYER]
    return pairs


def weight_map(cfg: Qwen2VLConfig, released: bool = False) -> dict[str, str]:
    """braid parameter name -> the HF tensor it is read from (a slice of the fused ``qkv`` for q/k/v), so a
    loader can read only the tensors of the parameters it needs. ``released``: the ``visual.*`` / ``model.*`` layout."""
    vis, lm = ("visual.", "model.") if released else ("model.visual.", "model.language_model.")
    out = dict(_name_pairs(cfg, vis, lm))
    out["visual.patch_embed.weight"] = f"{vis}patch_embed.proj.weight"
    for i in range(cfg.vit.layers):
        for p in ("q", "k", "v"):
            for part in ("weight", "bias"):
                out[f"visual.blocks.{i}.{p}_proj.{part}"] = f"{vis}blocks.{i}.attn.qkv.{part}"
    return out


def state_dict_from_hf(cfg: Qwen2VLConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """braid's state dict (for :class:`~braid.models.qwen2_vl.Qwen2VLModel`) from HF weights; missing or
    unused HF tensors are one clear error."""
    vis, lm = _hf_prefixes(tensors)
    v = cfg.vit
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"HF weight {name!r} missing from the checkpoint")
        used.add(name)
        return tensors[name]

    out = {b: take(h) for b, h in _name_pairs(cfg, vis, lm)}
    out["visual.patch_embed.weight"] = take(f"{vis}patch_embed.proj.weight").reshape(v.hidden, v.patch_dim)
    for i in range(v.layers):
        for part in ("weight", "bias"):
            q, k, val = take(f"{vis}blocks.{i}.attn.qkv.{part}").chunk(3, dim=0)
            out.update({f"visual.blocks.{i}.q_proj.{part}": q, f"visual.blocks.{i}.k_proj.{part}": k,
                        f"visual.blocks.{i}.v_proj.{part}": val})
    extra = sorted(k for k in tensors if k not in used)
    if extra:
        raise ValueError(f"{len(extra)} HF weights have no place in braid's model, e.g. {extra[:3]}")
    return {k: t.contiguous() for k, t in out.items()}


def state_dict_to_hf(cfg: Qwen2VLConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF weights (the recent ``model.visual.*`` / ``model.language_model.*`` layout) from braid's state dict."""
    vis, lm = "model.visual.", "model.language_model."
    v = cfg.vit
    out = {h: state[b] for b, h in _name_pairs(cfg, vis, lm)}
    out[f"{vis}patch_embed.proj.weight"] = state["visual.patch_embed.weight"].reshape(
        v.hidden, v.channels, v.temporal_patch, v.patch, v.patch)
    for i in range(v.layers):
        for part in ("weight", "bias"):
            out[f"{vis}blocks.{i}.attn.qkv.{part}"] = torch.cat(
                [state[f"visual.blocks.{i}.{p}_proj.{part}"] for p in ("q", "k", "v")], dim=0)
    return {k: t.detach().contiguous() for k, t in out.items()}


def model_from_hf(config: dict[str, Any], tensors: dict[str, torch.Tensor], *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> Qwen2VLModel:
    """braid's single-device model holding the HF weights (built on the meta device, no random init of real memory)."""
    cfg = config_from_hf(config)
    with torch.device("meta"):
        model = Qwen2VLModel(cfg)
    state = {k: t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)
             for k, t in state_dict_from_hf(cfg, tensors).items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model
