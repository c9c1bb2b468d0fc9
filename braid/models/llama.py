"""A Llama-3-style decoder: Qwen2's layer without Q/K/V biases, optionally a tied head.

The whole family in one module: its config (Llama's defaults: RoPE base 500000, RMSNorm
epsilon 1e-5; Llama-3.1's ``llama3`` RoPE frequency scaling), its layer and model (the
unit structure of :class:`braid.models.qwen2.Qwen2Layer`, so they implement the model
seam, :mod:`braid.models.seam`), and its registry entry (HF ``model_type`` ``llama``;
tensor names as Qwen2's). Nothing in the chunk runner, the builder or the executor names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from braid.models.qwen2 import (
    Qwen2Config, Qwen2Layer, Qwen2Model, decoder_fields_from_hf, decoder_fields_to_hf, decoder_hf_key, rope_inv_freq,
)
from braid.models.registry import Family, register


@dataclass(frozen=True, slots=True)
class LlamaConfig(Qwen2Config):
    """Model shape; defaults are a tiny model for tests. Llama-3-8B: hidden 4096, 32 layers, 32/8 heads, ffn 14336.

    ``llama3_rope``: Llama-3.1's RoPE scaling as ``(factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings)``, or None for plain RoPE.
    """

    rope_theta: float = 500_000.0
    rms_eps: float = 1e-5
    llama3_rope: tuple[float, float, float, int] | None = None


def llama3_inv_freq(theta: float, d: int, scaling: tuple[float, float, float, int]) -> torch.Tensor:
    """Llama-3.1's RoPE frequencies: long wavelengths divided by ``factor``, a smooth blend between."""
    factor, low, high, old_len = scaling
    inv = rope_inv_freq(theta, d, "cpu")  # explicit: layers are also built under a meta-device context
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, blended, scaled)


class LlamaLayer(Qwen2Layer):
    """One decoder layer: no biases anywhere; RoPE with Llama-3.1 scaling when configured."""

    qkv_bias = False

    def __init__(self, cfg: LlamaConfig, heads: int | None = None, kv_heads: int | None = None, ffn: int | None = None,
                 tp: int = 1) -> None:
        super().__init__(cfg, heads, kv_heads, ffn, tp)
        scaling = getattr(cfg, "llama3_rope", None)
        self._inv_freq = None if scaling is None else llama3_inv_freq(cfg.rope_theta, self.head_dim, scaling)


class LlamaModel(Qwen2Model):
    """Embedding, Llama decoder layers, final norm and LM head (tied when ``cfg.tie_embeddings``)."""

    layer_cls = LlamaLayer


def llama_from_hf(d: dict[str, Any]) -> LlamaConfig:
    for flag in ("attention_bias", "mlp_bias"):
        if d.get(flag):
            raise ValueError(f"{flag}=true is not supported by the Llama family (no biases)")
    params = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    scaling = None
    if params.get("rope_type", params.get("type")) == "llama3":
        scaling = (float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"]),
                   int(params.get("original_max_position_embeddings") or d["max_position_embeddings"]))
        theta = d.get("rope_theta", params.get("rope_theta", 500_000.0))
        d = {**d, "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    return LlamaConfig(**decoder_fields_from_hf(d, 500_000.0), llama3_rope=scaling)


def llama_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **decoder_fields_to_hf(cfg),
           "attention_bias": False, "mlp_bias": False}
    if cfg.llama3_rope is not None:
        factor, low, high, old_len = cfg.llama3_rope
        out["rope_parameters"] = out["rope_scaling"] = {
            "rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": old_len,
        }
    return out


register(Family(
    "llama", LlamaModel, LlamaConfig, ("llama",), llama_from_hf, llama_to_hf, decoder_hf_key,
    "Llama-3-style decoder: GQA without biases, SwiGLU, RMSNorm, RoPE (Llama-3.1 scaling); optionally tied head",
))
