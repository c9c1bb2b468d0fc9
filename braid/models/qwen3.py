"""A Qwen3-style dense decoder: Qwen2's layer without Q/K/V biases, with QK-norm and an explicit head size.

Qwen3 (transformers' ``Qwen3ForCausalLM``) normalises every query and key head with an
RMSNorm over the head dimension before RoPE (``q_norm``, ``k_norm``), and its head size is
a field of its own (``head_dim``; Qwen3-30B-A3B: hidden 2048 but 32 heads of 128). The
head norms are :class:`HeadNorm` modules whose weight gradient is deferred like a linear's
(:class:`braid.tp.layers.DeferredWeightGrad`): the chunk runner computes only input
gradients in a unit's backward, so every weight inside a unit must be one it can split off.

The family implements the model seam (:mod:`braid.models.seam`) through
:class:`braid.models.qwen2.Qwen2Layer`'s units; :mod:`braid.models.qwen3_moe` derives its
mixture-of-experts layers from :class:`Qwen3Layer`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from braid.core.braiding import Unit
from braid.models.qwen2 import (
    Qwen2Config, Qwen2Layer, Qwen2Model, decoder_fields_from_hf, decoder_fields_to_hf, decoder_hf_key, parallelize_layer,
)
from braid.models import tp_partial
from braid.models.registry import Family, register
from braid.tp.autograd_calls import fast_apply
from braid.tp.layers import DeferredWeightGrad


@dataclass(frozen=True, slots=True)
class Qwen3Config(Qwen2Config):
    """Model shape; defaults are a tiny model for tests. Qwen3-8B: hidden 4096, 36 layers, 32/8 heads of 128, ffn 12288.

    ``head_dim``: the size of one attention head (0: ``hidden // heads``); Q, K and V
    project to ``heads * head_dim``, which need not equal ``hidden``.
    """

    head_dim: int = 0  # type: ignore[assignment]  # a field here, Qwen2Config's derived property

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) not divisible by kv_heads ({self.kv_heads})")
        if self.head_dim == 0:
            if self.hidden % self.heads:
                raise ValueError(f"hidden ({self.hidden}) not divisible by heads ({self.heads}); give head_dim")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even number, got {self.head_dim}")


class _HeadNormFn(torch.autograd.Function):
    """RMSNorm over the last dimension, computed in fp32 (fp64 for fp64 input), times ``weight``;
    the weight gradient goes through the module (stashed for a W task, or returned)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, mod: "HeadNorm") -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, r, weight)
        ctx.mod = mod
        return weight * (xf * r).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        x, r, weight = ctx.saved_tensors
        y = x.to(r.dtype) * r
        dy = (g * weight).to(r.dtype)
        dx = r * (dy - y * (dy * y).mean(-1, keepdim=True))
        (dw,) = ctx.mod._stash_or_grad(y.to(x.dtype), g)
        return dx.to(x.dtype), dw, None, None


_head_norm = fast_apply(_HeadNormFn)


class HeadNorm(DeferredWeightGrad):
    """Qwen3's per-head RMSNorm of the queries or keys (weight of ``dim`` = head_dim), with a
    deferrable weight gradient (a unit's W task computes it, as for the linears)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self._init_deferred()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _head_norm(x, self.weight, self.eps, self)

    def _deferred_params(self) -> list[nn.Parameter | None]:
        return [self.weight]

    def _weight_grads(self, inp: torch.Tensor, grad_out: torch.Tensor) -> list[torch.Tensor | None]:
        # inp: the normalised input (..., d) in the input's dtype; d(weight * y)/d weight = y
        return [(grad_out * inp).reshape(-1, inp.shape[-1]).sum(0)]


class Qwen3Layer(Qwen2Layer):
    """One dense Qwen3 decoder layer: no biases, QK-norm before RoPE, ``cfg.head_dim`` per head."""

    qkv_bias = False

    def __init__(self, cfg: Qwen3Config, heads: int | None = None, kv_heads: int | None = None, ffn: int | None = None,
                 tp: int = 1) -> None:
        super().__init__(cfg, heads, kv_heads, ffn, tp)
        self.q_norm = HeadNorm(self.head_dim, cfg.rms_eps)
        self.k_norm = HeadNorm(self.head_dim, cfg.rms_eps)

    def qkv(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pre-Attn after the norm: Q/K/V projections, Q and K head norms, RoPE at ``positions``."""
        cos, sin = self.rope_tables(h.shape[1], h.device, h.dtype, positions)
        q, k, v = self.project_qkv(h)  # (b, H, s, d), (b, Hkv, s, d)
        q, k = self.fns.rope_qk(self.q_norm(q), self.k_norm(k), cos, sin)
        return q, k, v

    def unit_weights(self, unit: Unit) -> tuple[nn.Module, ...]:
        mods = super().unit_weights(unit)
        return mods + (self.q_norm, self.k_norm) if unit is Unit.PRE_ATTN else mods


def shard_qwen3_layer(layer: Qwen3Layer, cfg: Qwen3Config, tp_rank: int, tp_size: int) -> Qwen3Layer:
    """:func:`braid.models.qwen2.parallelize_layer` of a Qwen3 layer, head norms copied. Every head
    shares them, and a TP rank holds only its heads: their gradients are partial over TP ranks
    (marked, :mod:`braid.models.tp_partial`)."""
    out = parallelize_layer(layer, cfg, tp_rank, tp_size, type(layer))
    out.q_norm, out.k_norm = copy.deepcopy(layer.q_norm), copy.deepcopy(layer.k_norm)
    if tp_size > 1:
        tp_partial.mark(out.q_norm.weight)
        tp_partial.mark(out.k_norm.weight)
    return out


class Qwen3Model(Qwen2Model):
    """Embedding, Qwen3 decoder layers, final norm and LM head (tied when ``cfg.tie_embeddings``)."""

    layer_cls = Qwen3Layer

    def shard_layer(self, layer: nn.Module, tp_rank: int, tp_size: int) -> Qwen3Layer:
        return shard_qwen3_layer(layer, self.cfg, tp_rank, tp_size)  # type: ignore[arg-type]

    def reset_parameters(self, std: float = 0.2) -> None:
        """As Qwen2's; the head norms perturbed around one like the other norms."""
        super().reset_parameters(std)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))


# -- Hugging Face names and config (the family's registry entry) ------------------------------
_HEAD_NORMS = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}


def qwen3_hf_key(name: str) -> str:
    """A Qwen3 parameter name -> its checkpoint tensor name (the head norms sit under ``self_attn``)."""
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[0] == "layers" and parts[2] in _HEAD_NORMS:
        return f"model.layers.{parts[1]}.{_HEAD_NORMS[parts[2]]}.{parts[3]}"
    return decoder_hf_key(name)


def qwen3_fields_from_hf(d: dict[str, Any]) -> dict[str, Any]:
    """The decoder fields of a Qwen3 ``config.json`` (``head_dim`` read on its own)."""
    if d.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported by the Qwen3 families (no biases)")
    if d.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported (full attention only)")
    fields = decoder_fields_from_hf({k: v for k, v in d.items() if k != "head_dim"}, 1_000_000.0)
    return {**fields, "head_dim": int(d.get("head_dim") or int(d["hidden_size"]) // int(d["num_attention_heads"]))}


def qwen3_fields_to_hf(cfg: Qwen3Config) -> dict[str, Any]:
    return {**decoder_fields_to_hf(cfg), "head_dim": cfg.head_dim, "attention_bias": False, "use_sliding_window": False}


def qwen3_from_hf(d: dict[str, Any]) -> Qwen3Config:
    return Qwen3Config(**qwen3_fields_from_hf(d))


def qwen3_to_hf(cfg: Qwen3Config) -> dict[str, Any]:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **qwen3_fields_to_hf(cfg)}


register(Family(
    "qwen3", Qwen3Model, Qwen3Config, ("qwen3",), qwen3_from_hf, qwen3_to_hf, qwen3_hf_key,
    "Qwen3 dense decoder: GQA without biases, QK-norm, SwiGLU, RMSNorm, RoPE; optionally tied head",
))
