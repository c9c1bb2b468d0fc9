"""A Qwen2-style decoder written for one device, whose layers expose the four units.

The paper (Sec. 3, Fig. 2) cuts a transformer layer into Pre-Attn (RMSNorm + QKV
projection), Attn (attention + output projection), Pre-MLP (RMSNorm + gate/up projection)
and MLP (SwiGLU + down projection). Each unit is a separate method here, and the residual
is *fused* into the unit that ends with the TP all-reduce:
``X_attn = AR(Attention(LN(X)) + detach(X)/t)``; the residual's gradient (+1) is added
explicitly in backward by the chunk runner. With ``tp == 1`` (the reference model) the
all-reduce is the identity and the code is plain single-device Qwen2.

Tensor parallelism is applied from outside: :func:`parallelize_layer` builds the TP shard
of a layer from the single-device layer by slicing its weights.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from braid.models.recompute import recomputed, swiglu
from braid.tp.layers import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from braid.models.sequence_parallel import SequenceParallel


@dataclass(frozen=True, slots=True)
class Qwen2Config:
    """Model shape. Defaults are a tiny model for tests; Qwen2-7B: hidden 3584, 28 layers, 28/4 heads, ffn 18944."""

    vocab_size: int = 128
    hidden: int = 32
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 64
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) not divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) not divisible by kv_heads ({self.kv_heads})")
        if self.tie_embeddings:
            raise ValueError("tied embeddings are not supported (first and last stage live on different ranks)")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rope(x: torch.Tensor, theta: float, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding of ``x`` (b, heads, s, d) at ``positions`` (s,), default 0..s-1 (Qwen2's rotate-half form).

    Under sequence parallelism a rank holds tokens of scattered (zigzag) positions; RoPE
    must rotate each by its position in the full sequence.
    """
    s, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    pos = torch.arange(s, device=x.device) if positions is None else positions.to(x.device)
    ang = torch.outer(pos.to(torch.float32), inv)
    ang = torch.cat([ang, ang], dim=-1)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Qwen2Layer(nn.Module):
    """One decoder layer. ``heads``/``kv_heads`` are the *local* counts and ``tp`` the TP size.

    ``recompute``: ``"selective"`` recomputes the attention core and the SwiGLU product in
    the backward instead of keeping their activations (:mod:`braid.models.recompute`).
    """

    recompute: str = "none"

    def __init__(self, cfg: Qwen2Config, heads: int | None = None, kv_heads: int | None = None, ffn: int | None = None, tp: int = 1) -> None:
        super().__init__()
        h, hd = cfg.hidden, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = heads or cfg.heads, kv_heads or cfg.kv_heads, hd
        self.tp, self.theta = tp, cfg.rope_theta
        self.sp: SequenceParallel | None = None  # set by the chunk builder: attention runs as 2D-Attention
        f = ffn or cfg.ffn
        self.input_layernorm = RMSNorm(h, cfg.rms_eps)
        self.q_proj = nn.Linear(h, self.heads * hd, bias=True)
        self.k_proj = nn.Linear(h, self.kv_heads * hd, bias=True)
        self.v_proj = nn.Linear(h, self.kv_heads * hd, bias=True)
        self.o_proj = nn.Linear(self.heads * hd, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_eps)
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    # -- units (each a forward piece; see the module doc) --------------------------------
    def norm1(self, x: torch.Tensor) -> torch.Tensor:
        return self.input_layernorm(x)

    def qkv(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pre-Attn after the norm: (b, s, h) -> q (b, H/t, s, d), k, v (b, Hkv/t, s, d); RoPE at ``positions``."""
        b, s, _ = h.shape
        q = self.q_proj(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        return rope(q, self.theta, positions), rope(k, self.theta, positions), v

    def attn_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal GQA attention and the out-projection: (b, H/t, s, d) -> (b, s, h) partial over TP.

        With a sequence-parallel context (``self.sp``) ``s`` is the rank's share of the
        sequence and attention is LoongTrain's 2D-Attention over the SP group.
        """
        if self.sp is not None:
            o = self.sp.attention(q, k, v, causal=True)
        elif self.recompute == "selective":
            o = recomputed(self._sdpa, q, k, v)
        else:
            o = self._sdpa(q, k, v)
        b, _, s, _ = o.shape
        o = o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)  # (b, s, h/t)
        return self.o_proj(o)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)

    def attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attn unit: attention, out-projection and the fused residual ``detach(x)/t`` (partial over TP)."""
        return self.attn_core(q, k, v) + residual.detach() / self.tp

    def norm2(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_attention_layernorm(x)

    def gate_up(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_proj(h), self.up_proj(h)  # (b, s, ffn/t) each

    def mlp_core(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.down_proj(recomputed(swiglu, gate, up) if self.recompute == "selective" else swiglu(gate, up))

    def mlp(self, gate: torch.Tensor, up: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """MLP unit: SwiGLU, down-projection and the fused residual (partial over TP)."""
        return self.mlp_core(gate, up) + residual.detach() / self.tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Single-device forward (tp must be 1): the residual flows through autograd normally."""
        if self.tp != 1 or self.sp is not None:
            raise ValueError("Qwen2Layer.forward is the single-device path; a TP/SP shard runs through the chunk runner")
        x = self.attn_core(*self.qkv(self.norm1(x))) + x
        return self.mlp_core(*self.gate_up(self.norm2(x))) + x


class Qwen2Model(nn.Module):
    """Embedding, decoder layers, final norm and LM head, on one device."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(Qwen2Layer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.2) -> None:
        """Deterministic init under the caller's seed; norms perturbed so their gradients matter."""
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("layernorm.weight") or name == "norm.weight":
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                else:
                    p.normal_(0.0, std)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy of next-token ``labels`` (b, s)."""
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def _head_rows(n_heads: int, head_dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    per = n_heads // tp_size
    return torch.arange(tp_rank * per * head_dim, (tp_rank + 1) * per * head_dim)


def parallelize_layer(layer: Qwen2Layer, cfg: Qwen2Config, tp_rank: int, tp_size: int) -> Qwen2Layer:
    """The TP shard of ``layer`` for ``tp_rank``: heads, KV heads and FFN split over ``tp_size`` ranks.

    Q/K/V and gate/up become column-parallel, out- and down-projections row-parallel; the
    norms are replicated. The shard copies its slices, so it can be trained independently.
    """
    for what, n in (("heads", cfg.heads), ("KV heads", cfg.kv_heads), ("ffn", cfg.ffn)):
        if n % tp_size:
            raise ValueError(f"{what} ({n}) not divisible by tp={tp_size}")
    out = Qwen2Layer(cfg, cfg.heads // tp_size, cfg.kv_heads // tp_size, cfg.ffn // tp_size, tp=tp_size)
    out.input_layernorm = copy.deepcopy(layer.input_layernorm)
    out.post_attention_layernorm = copy.deepcopy(layer.post_attention_layernorm)
    hd = cfg.head_dim
    out.q_proj = ColumnParallelLinear.from_full(layer.q_proj, tp_rank, tp_size, _head_rows(cfg.heads, hd, tp_rank, tp_size))
    out.k_proj = ColumnParallelLinear.from_full(layer.k_proj, tp_rank, tp_size, _head_rows(cfg.kv_heads, hd, tp_rank, tp_size))
    out.v_proj = ColumnParallelLinear.from_full(layer.v_proj, tp_rank, tp_size, _head_rows(cfg.kv_heads, hd, tp_rank, tp_size))
    out.o_proj = RowParallelLinear.from_full(layer.o_proj, tp_rank, tp_size)
    out.gate_proj = ColumnParallelLinear.from_full(layer.gate_proj, tp_rank, tp_size)
    out.up_proj = ColumnParallelLinear.from_full(layer.up_proj, tp_rank, tp_size)
    out.down_proj = RowParallelLinear.from_full(layer.down_proj, tp_rank, tp_size)
    return out
