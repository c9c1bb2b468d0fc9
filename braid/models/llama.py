"""A Llama-3-style decoder: Qwen2's layer without Q/K/V biases, optionally a tied head.

The whole family in one module: its config (Llama's defaults: RoPE base 500000, RMSNorm
epsilon 1e-5), its layer and model (the unit structure of
:class:`braid.models.qwen2.Qwen2Layer`, so they implement the model seam,
:mod:`braid.models.seam`), and its registry entry (HF ``model_type`` ``llama``; tensor
names as Qwen2's). Nothing in the chunk runner, the builder or the executor names it.
Plain RoPE only: a checkpoint with ``rope_scaling`` (Llama-3.1's ``llama3`` frequencies)
is refused with one line by :func:`llama_from_hf`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from braid.models.qwen2 import Qwen2Config, Qwen2Layer, Qwen2Model, decoder_fields_from_hf, decoder_fields_to_hf, decoder_hf_key
from braid.models.registry import Family, register


@dataclass(frozen=True, slots=True)
class LlamaConfig(Qwen2Config):
    """Model shape; defaults are a tiny model for tests. Llama-3-8B: hidden 4096, 32 layers, 32/8 heads, ffn 14336."""

    rope_theta: float = 500_000.0
    rms_eps: float = 1e-5


class LlamaLayer(Qwen2Layer):
    """One decoder layer: no biases anywhere."""

    qkv_bias = False


class LlamaModel(Qwen2Model):
    """Embedding, Llama decoder layers, final norm and LM head (tied when ``cfg.tie_embeddings``)."""

    layer_cls = LlamaLayer


def llama_from_hf(d: dict[str, Any]) -> LlamaConfig:
    for flag in ("attention_bias", "mlp_bias"):
        if d.get(flag):
            raise ValueError(f"{flag}=true is not supported by the Llama family (no biases)")
    return LlamaConfig(**decoder_fields_from_hf(d, 500_000.0))


def llama_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **decoder_fields_to_hf(cfg),
            "attention_bias": False, "mlp_bias": False}


register(Family(
    "llama", LlamaModel, LlamaConfig, ("llama",), llama_from_hf, llama_to_hf, decoder_hf_key,
    "Llama-3-style decoder: GQA without biases, SwiGLU, RMSNorm, RoPE; optionally tied head",
))
