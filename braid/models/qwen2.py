"""A Qwen2-style decoder written for one device, whose layers expose the four units.

The paper (Sec. 3, Fig. 2) cuts a transformer layer into Pre-Attn (RMSNorm + QKV
projection), Attn (attention + output projection), Pre-MLP (RMSNorm + gate/up projection)
and MLP (SwiGLU + down projection). Each unit is a separate method here, and the residual
is *fused* into the unit that ends with the TP all-reduce:
``X_attn = AR(Attention(LN(X)) + X/t)``; the chunk runner passes ``X`` detached where it
cuts the graph between units (and adds the residual's +1 gradient explicitly in backward),
attached where it runs a chunk's backward in one call (fused mode, tp=1). With ``tp == 1`` (the reference model) the
all-reduce is the identity and the code is plain single-device Qwen2.

Tensor parallelism is applied from outside: :func:`parallelize_layer` builds the TP shard
of a layer from the single-device layer by slicing its weights. The layer implements
:class:`braid.models.seam.UnitLayer` and the model :class:`braid.models.seam.StageModel`;
other decoder families (:mod:`braid.models.llama`) derive from these classes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from braid.core.braiding import Unit
from braid.models.init import init_by_name
from braid.models.registry import Family, register
from braid.models.seam import UnitMethods, fused_residual
from braid.tp.embedding import vocab_parallel_cross_entropy
from braid.models.recompute import recomputed
from braid.tp.swiglu_down import swiglu_down
from braid.tp.layers import ColumnParallelGroup, ColumnParallelLinear, RowParallelLinear, group_pays

if TYPE_CHECKING:
    from braid.models.sequence_parallel import SequenceParallel


@dataclass(frozen=True, slots=True)
class Qwen2Config:
    """Model shape. Defaults are a tiny model for tests; Qwen2-7B: hidden 3584, 28 layers, 28/4 heads, ffn 18944.

    ``tie_embeddings``: the LM head reuses the embedding matrix (Qwen2-0.5B/1.5B, Qwen2.5
    up to 3B); pipeline stages then hold one copy each and sum their gradients.
    """

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

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dimension, computed in fp32 (or fp64 for fp64 input), scaled by ``weight``."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def rope_inv_freq(theta: float, d: int, device: torch.device | str | None = None) -> torch.Tensor:
    """RoPE's inverse frequencies for head dimension ``d`` (fp32, d/2 values)."""
    return 1.0 / (theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))


def rope_tables(theta: float, s: int, d: int, device: torch.device, dtype: torch.dtype,
                positions: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's (cos, sin) tables (s, d) in ``dtype`` for positions ``positions`` (default 0..s-1),
    for Qwen2's rotate-half form (:func:`rope_qk`).

    Under sequence parallelism a rank holds tokens of scattered (zigzag) positions; RoPE
    must rotate each by its position in the full sequence. ``inv_freq`` overrides the
    frequencies of base ``theta`` (a family's RoPE scaling)."""
    inv = rope_inv_freq(theta, d, device) if inv_freq is None else inv_freq.to(device)
    pos = torch.arange(s, device=device) if positions is None else positions.to(device)
    ang = torch.outer(pos.to(torch.float32), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class RopeCache(dict):
    """A layer's RoPE tables by (length, head_dim, device, dtype) (:func:`cached_rope_tables`).

    :attr:`ptrs`: the data pointers of the tensors it holds. They outlive every micro-batch
    and step, as parameters do, so a chunk keeps them out of the saved activations it counts
    and offloads. Filling it is a plain dict store, which ``torch.compile`` traces (a compiled
    layer, as the baselines', then reads the tables as inputs). A copy or a pickle starts
    empty: its tables are made again where it runs."""

    @property
    def ptrs(self) -> set[int]:
        return {t.data_ptr() for tables in self.values() for t in tables}

    def __reduce__(self) -> tuple:
        return RopeCache, ()


def cached_rope_tables(cache: RopeCache, theta: float, s: int, d: int, device: torch.device, dtype: torch.dtype,
                       positions: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_tables`, kept in ``cache`` (a layer's) for the default positions 0..s-1.

    Every micro-batch and step then reuses two small tables, and a compiled RoPE reads them
    instead of evaluating sin and cos for every element of q and k (at large angles that
    evaluation cost more than the rotation). Positions given (sequence parallelism, M-RoPE)
    are tabled per call."""
    if positions is not None:
        return rope_tables(theta, s, d, device, dtype, positions, inv_freq)
    key = (s, d, device, dtype)
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = rope_tables(theta, s, d, device, dtype, None, inv_freq)
    return hit


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of the queries and the keys (b, heads, s, d) from one pair of :func:`rope_tables`,
    both returned as (b, heads, s, d) views of new (b, s, heads, d) memory: the layout the
    attention kernels (cuDNN's, flash attention's) read and write without a copy, so the
    attention output's (b, s, h) view for the out-projection is free (no second copy of it kept
    for the backward) and a compiled RoPE's backward takes the gradients they hand back as they
    come (measured on an H200, ``benchmarks/results/sdpa_layout_h200.txt``)."""
    c, s_ = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return _rotate(q.transpose(1, 2), c, s_).transpose(1, 2), _rotate(k.transpose(1, 2), c, s_).transpose(1, 2)


def split_qkv(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The joined Q/K/V projection (b, s, (H + 2 Hkv) d) -> q (b, H, s, d), k, v (b, Hkv, s, d), views.

    Their backward is one node that writes the joined gradient (a concatenation)."""
    b, s, _ = qkv.shape
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (q.view(b, s, heads, head_dim).transpose(1, 2), k.view(b, s, kv_heads, head_dim).transpose(1, 2),
            v.view(b, s, kv_heads, head_dim).transpose(1, 2))


def split_rope_qkv(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`split_qkv` and :func:`rope_qk`: q and k rotated, v copied out, all three in new
    (b, s, heads, d) memory (so no view keeps the joined projection alive; compiled, the three
    come out of one kernel and its backward writes the joined gradient in one more)."""
    q, k, v = split_qkv(qkv, heads, kv_heads, head_dim)
    q, k = rope_qk(q, k, cos, sin)
    return q, k, v.transpose(1, 2).contiguous().transpose(1, 2)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU gate ``silu(gate) * up`` (b, s, ffn/t)."""
    return F.silu(gate) * up


def swiglu_joined(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`swiglu` of the joined gate/up projection (b, s, 2 ffn/t): gate first, then up.

    Read as (b, s, 2, ffn/t) and indexed rather than split: compiled, the backward then
    writes the joined gradient without a concatenation's per-element branch (one kernel
    either way; this one the shorter on GPUs)."""
    pair = gate_up.unflatten(-1, (2, -1))
    return F.silu(pair[..., 0, :]) * pair[..., 1, :]


def swiglu_grad(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`swiglu`'s gate and up for the product's gradient ``grad``, and the
    product itself, made again (:mod:`braid.tp.swiglu_down`): autograd's formulas for ``silu`` and
    ``*``, so eager values equal autograd's through :func:`swiglu`.

    In place: gate's gradient is written into ``gate`` and up's into ``up`` -- after their last
    reads, each element where its input was -- and those two are returned. The backward's only
    readers of gate and up are these formulas, so it allocates the product alone instead of three
    ``ffn/t`` tensors beside the two it frees (the MLP backward's peak, under every schedule)."""
    silu = F.silu(gate)
    product = silu * up
    d_silu = grad * up
    torch.mul(grad, silu, out=up)  # up's gradient; up is not read again
    torch.ops.aten.silu_backward.grad_input(d_silu, gate, grad_input=gate)  # reads gate[i], then writes it
    return gate, up, product


def swiglu_joined_grad(gate_up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`swiglu_grad` of a joined gate/up projection: its gradient (b, s, 2 ffn/t), written into
    ``gate_up`` itself once both halves are computed (gate's half is read by up's gradient), and the product.
    Not :func:`swiglu_grad` on the two halves: its ``out=`` into a strided half stops ``torch.compile``'s graph."""
    pair = gate_up.unflatten(-1, (2, -1))
    gate, up = pair.unbind(-2)
    silu = F.silu(gate)
    product = silu * up
    pair.copy_(torch.stack((torch.ops.aten.silu_backward(grad * up, gate), grad * silu), dim=-2))
    return gate_up, product


def add_residual(out: torch.Tensor, residual: torch.Tensor, tp: int) -> torch.Tensor:
    """The fused residual of a unit that ends with the TP all-reduce: ``out + residual / tp``
    (the chunk runner passes the residual detached when it cuts the graph between units and
    adds the +1 gradient itself; in fused mode the residual stays attached)."""
    return out + residual if tp == 1 else out + residual / tp  # x / 1 == x: no division kernel at tp=1


class UnitFns(NamedTuple):
    """The pure tensor functions the units call between their linears and attention kernels.

    :data:`EAGER` by default; :mod:`braid.runtime.compiled` swaps in ``torch.compile``d
    versions per module (the linears, with their deferred weight gradients, and the
    attention kernels stay outside: they already are single kernels).
    """

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    rope_qk: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    split_rope_qkv: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # of a joined Q/K/V projection
    swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    swiglu_joined: Callable[[torch.Tensor], torch.Tensor]  # of a joined gate/up projection
    swiglu_grad: Callable[..., tuple[torch.Tensor, ...]]  # gate's and up's gradients and the product
    swiglu_joined_grad: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    add_residual: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    cross_entropy: Callable[..., torch.Tensor]  # per-token loss of the head: (logits, labels, vocab_start, tp_group)


EAGER = UnitFns(rms_norm, rope_qk, split_rope_qkv, swiglu, swiglu_joined, swiglu_grad, swiglu_joined_grad, add_residual,
                vocab_parallel_cross_entropy)


class RMSNorm(nn.Module):
    fns: UnitFns = EAGER

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fns.rms_norm(x, self.weight, self.eps)


class Qwen2Layer(UnitMethods, nn.Module):
    """One decoder layer. ``heads``/``kv_heads`` are the *local* counts and ``tp`` the TP size.

    ``qkv_bias``: Qwen2 has biases on the Q/K/V projections (a family without them, as
    Llama, sets it False in a subclass). ``recompute``: ``"selective"`` recomputes the
    attention core in the backward instead of keeping its activations
    (:mod:`braid.models.recompute`); the SwiGLU product a TP shard remakes in the backward
    under every mode (:mod:`braid.tp.swiglu_down`).

    ``qkv_group`` / ``gate_up_group``: a TP shard (:func:`parallelize_layer`) of small layers
    runs Q/K/V and gate/up as one GEMM each (:class:`braid.tp.layers.ColumnParallelGroup`),
    and its Pre-MLP unit hands on the joined gate/up projection; large layers and the
    single-device layer run them one by one, as Hugging Face's does (None).
    """

    qkv_bias: bool = True
    recompute: str = "none"

    fns: UnitFns = EAGER  # the pure tensor functions of the units (eager or compiled)

    def __init__(self, cfg: Qwen2Config, heads: int | None = None, kv_heads: int | None = None, ffn: int | None = None, tp: int = 1) -> None:
        super().__init__()
        h, hd = cfg.hidden, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = heads or cfg.heads, kv_heads or cfg.kv_heads, hd
        self.tp, self.theta = tp, cfg.rope_theta
        self.sp: SequenceParallel | None = None  # set by the chunk builder: attention runs as 2D-Attention
        self.seq_rank: int | None = None  # set by the chunk builder under sequence sharding (braid.tp.seq_shard)
        f = ffn or cfg.ffn
        self.input_layernorm = RMSNorm(h, cfg.rms_eps)
        self.q_proj = nn.Linear(h, self.heads * hd, bias=self.qkv_bias)
        self.k_proj = nn.Linear(h, self.kv_heads * hd, bias=self.qkv_bias)
        self.v_proj = nn.Linear(h, self.kv_heads * hd, bias=self.qkv_bias)
        self.o_proj = nn.Linear(self.heads * hd, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_eps)
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)
        self.qkv_group: ColumnParallelGroup | None = None
        self.gate_up_group: ColumnParallelGroup | None = None
        self.rope_cache = RopeCache()

    # -- units (each a forward piece; see the module doc) --------------------------------
    def norm1(self, x: torch.Tensor) -> torch.Tensor:
        return self.input_layernorm(x)

    def qkv(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pre-Attn after the norm: (b, s, h) -> q (b, H/t, s, d), k, v (b, Hkv/t, s, d); RoPE at ``positions``."""
        cos, sin = self.rope_tables(h.shape[1], h.device, h.dtype, positions)
        if self.qkv_group is not None:
            return self.fns.split_rope_qkv(self.qkv_group(h), self.heads, self.kv_heads, self.head_dim, cos, sin)
        q, k, v = self.project_qkv(h)
        q, k = self.fns.rope_qk(q, k, cos, sin)
        return q, k, v

    def project_qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The Q/K/V projections before RoPE: (b, s, h) -> q (b, H/t, s, d), k, v (b, Hkv/t, s, d)."""
        if self.qkv_group is not None:
            return split_qkv(self.qkv_group(h), self.heads, self.kv_heads, self.head_dim)
        b, s, _ = h.shape
        q = self.q_proj(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def rope_freqs(self, device: torch.device) -> torch.Tensor | None:
        """RoPE's inverse frequencies on ``device``: None for plain base ``theta``; a family
        with scaled frequencies (Llama-3.1) overrides this."""
        return None

    def rope_tables(self, s: int, device: torch.device, dtype: torch.dtype,
                    positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's (cos, sin) tables (s, head_dim) at ``positions``, with the family's frequencies (:func:`cached_rope_tables`)."""
        return cached_rope_tables(self.rope_cache, self.theta, s, self.head_dim, device, dtype, positions, self.rope_freqs(device))

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
        """Attn unit: attention, out-projection and the fused residual ``x/t`` (partial over TP)."""
        return fused_residual(self, self.attn_core(q, k, v), residual)

    def norm2(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_attention_layernorm(x)

    def gate_up(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Pre-MLP after the norm: gate and up (b, s, ffn/t) each, or both joined (b, s, 2 ffn/t) in a group."""
        if self.gate_up_group is not None:
            return (self.gate_up_group(h),)
        return self.gate_proj(h), self.up_proj(h)

    def mlp_core(self, *acts: torch.Tensor) -> torch.Tensor:
        """SwiGLU and the down-projection of :meth:`gate_up`'s activations. A TP shard's down-projection
        keeps gate and up for its backward, not their product (:mod:`braid.tp.swiglu_down`)."""
        joined = len(acts) == 1
        swiglu_fn = self.fns.swiglu_joined if joined else self.fns.swiglu
        if isinstance(self.down_proj, RowParallelLinear):
            return swiglu_down(self.down_proj, swiglu_fn, self.fns.swiglu_joined_grad if joined else self.fns.swiglu_grad, *acts)
        return self.down_proj(swiglu_fn(*acts))

    def mlp(self, *inputs: torch.Tensor) -> torch.Tensor:
        """MLP unit: SwiGLU, down-projection and the fused residual (partial over TP); ``inputs``:
        :meth:`gate_up`'s activations, then the residual."""
        *acts, residual = inputs
        return fused_residual(self, self.mlp_core(*acts), residual)

    # -- the model seam (braid.models.seam.UnitLayer) ------------------------------------
    def unit_norm(self, unit: Unit) -> RMSNorm:
        return self.input_layernorm if unit is Unit.PRE_ATTN else self.post_attention_layernorm

    def unit_weights(self, unit: Unit) -> tuple[nn.Module, ...]:
        return {
            Unit.PRE_ATTN: (self.q_proj, self.k_proj, self.v_proj) if self.qkv_group is None else (self.qkv_group,),
            Unit.ATTN: (self.o_proj,),
            Unit.PRE_MLP: (self.gate_proj, self.up_proj) if self.gate_up_group is None else (self.gate_up_group,),
            Unit.MLP: (self.down_proj,),
        }[unit]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Single-device forward (tp must be 1): the residual flows through autograd normally."""
        if self.tp != 1 or self.sp is not None:
            raise ValueError("Qwen2Layer.forward is the single-device path; a TP/SP shard runs through the chunk runner")
        x = self.attn_core(*self.qkv(self.norm1(x))) + x
        return self.mlp_core(*self.gate_up(self.norm2(x))) + x


class Qwen2Model(nn.Module):
    """Embedding, decoder layers, final norm and LM head, on one device.

    Built under ``torch.device("meta")`` it holds no storage: the chunk builder then
    materialises only the layers a rank runs (:mod:`braid.models.build`), initialised by
    :meth:`init_weights`'s rule.
    """

    layer_cls: type[Qwen2Layer] = Qwen2Layer

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if self.embed_tokens.weight.device.type != "meta":
            self.reset_parameters()

    def make_layer(self, cfg: Qwen2Config, index: int) -> Qwen2Layer:
        """Decoder layer ``index`` (a family whose layers differ by index overrides this)."""
        return self.layer_cls(cfg)

    def init_weights(self, seed: int, std: float = 0.2) -> "Qwen2Model":
        """Initialise every parameter from ``seed`` and its name alone (:func:`braid.models.init.init_by_name`).

        A chunk built from a meta-device model gets the same values for its layers.
        """
        init_by_name(self, seed, std)
        return self

    def shard_layer(self, layer: nn.Module, tp_rank: int, tp_size: int) -> Qwen2Layer:
        return parallelize_layer(layer, self.cfg, tp_rank, tp_size, self.layer_cls)  # type: ignore[arg-type]

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """(b, s) token ids -> (b, s, vocab) logits in fp32 (fp64 for an fp64 model)."""
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def reset_parameters(self, std: float = 0.2) -> None:
        """Deterministic init under the caller's seed; norms perturbed so their gradients matter."""
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("layernorm.weight") or name == "norm.weight":
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                else:
                    p.normal_(0.0, std)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy of next-token ``labels`` (b, s), already shifted
        (``labels[:, i]`` is the token after ``tokens[:, i]``; see :func:`braid.hf.shift_labels`)."""
        logits = self.logits(tokens)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def _head_rows(n_heads: int, head_dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    per = n_heads // tp_size
    return torch.arange(tp_rank * per * head_dim, (tp_rank + 1) * per * head_dim)


def parallelize_layer(layer: Qwen2Layer, cfg: Qwen2Config, tp_rank: int, tp_size: int,
                      layer_cls: type[Qwen2Layer] = Qwen2Layer) -> Qwen2Layer:
    """The TP shard of ``layer`` for ``tp_rank``: heads, KV heads and FFN split over ``tp_size`` ranks.

    Q/K/V and gate/up become column-parallel, each set grouped into one GEMM where that pays
    (:func:`braid.tp.layers.group_pays`), out- and down-projections row-parallel; the norms
    are replicated. The shard copies its slices, so it can be trained independently.
    ``layer_cls``: the shard's class (a family's layer class; its constructor takes Qwen2Layer's arguments).
    """
    for what, n in (("heads", cfg.heads), ("KV heads", cfg.kv_heads), ("ffn", cfg.ffn)):
        if n % tp_size:
            raise ValueError(f"{what} ({n}) not divisible by tp={tp_size}")
    with torch.device("meta"):  # a skeleton: every parameter is replaced below
        out = layer_cls(cfg, cfg.heads // tp_size, cfg.kv_heads // tp_size, cfg.ffn // tp_size, tp=tp_size)
    out.input_layernorm = copy.deepcopy(layer.input_layernorm)
    out.post_attention_layernorm = copy.deepcopy(layer.post_attention_layernorm)
    hd = cfg.head_dim
    out.q_proj = ColumnParallelLinear.from_full(layer.q_proj, tp_rank, tp_size, _head_rows(cfg.heads, hd, tp_rank, tp_size))
    out.k_proj = ColumnParallelLinear.from_full(layer.k_proj, tp_rank, tp_size, _head_rows(cfg.kv_heads, hd, tp_rank, tp_size))
    out.v_proj = ColumnParallelLinear.from_full(layer.v_proj, tp_rank, tp_size, _head_rows(cfg.kv_heads, hd, tp_rank, tp_size))
    out.o_proj = RowParallelLinear.from_full(layer.o_proj, tp_rank, tp_size)
    if layer.gate_proj is not None:  # (a mixture-of-experts layer has experts instead: braid.models.qwen3_moe)
        out.gate_proj = ColumnParallelLinear.from_full(layer.gate_proj, tp_rank, tp_size)
        out.up_proj = ColumnParallelLinear.from_full(layer.up_proj, tp_rank, tp_size)
        out.down_proj = RowParallelLinear.from_full(layer.down_proj, tp_rank, tp_size)
    for name, parts in (("qkv_group", (out.q_proj, out.k_proj, out.v_proj)), ("gate_up_group", (out.gate_proj, out.up_proj))):
        if parts[0] is not None and group_pays(parts):
            setattr(out, name, ColumnParallelGroup(parts))
    return out


# -- Hugging Face names and config (the family's registry entry) ------------------------------
_HF_LAYER_MODULES = {
    "input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm",
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
}


def decoder_hf_key(name: str) -> str:
    """A decoder LM's parameter name -> its tensor name in a HF ``*ForCausalLM`` checkpoint."""
    if name.startswith("layers."):
        _, index, module, rest = name.split(".", 3)
        return f"model.layers.{index}.{_HF_LAYER_MODULES[module]}.{rest}"
    return name if name.startswith("lm_head.") else f"model.{name}"


def rope_theta_from_hf(d: dict[str, Any], default: float) -> float:
    """``rope_theta`` of a HF config (top level, or ``rope_parameters`` since transformers 5); only plain RoPE."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling:
        raise ValueError(f"RoPE scaling {scaling!r} is not supported (plain RoPE only)")
    return float(d.get("rope_theta", params.get("rope_theta", default)))


def decoder_fields_from_hf(d: dict[str, Any], default_theta: float) -> dict[str, Any]:
    """The shape fields every decoder config shares, read from a HF ``config.json`` dict."""
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (SwiGLU with silu only)")
    heads = int(d["num_attention_heads"])
    head_dim = d.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != int(d["hidden_size"]):
        raise ValueError(f"head_dim {head_dim} x {heads} heads != hidden_size {d['hidden_size']} is not supported")
    return dict(
        vocab_size=int(d["vocab_size"]), hidden=int(d["hidden_size"]), layers=int(d["num_hidden_layers"]), heads=heads,
        kv_heads=int(d.get("num_key_value_heads") or heads), ffn=int(d["intermediate_size"]),
        rope_theta=rope_theta_from_hf(d, default_theta), rms_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
    )


def decoder_fields_to_hf(cfg: Qwen2Config) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "intermediate_size": cfg.ffn,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings, "max_position_embeddings": 32768,
    }


def qwen2_from_hf(d: dict[str, Any]) -> Qwen2Config:
    """Qwen2 / Qwen2.5 (``model_type`` ``qwen2``): full attention only."""
    if d.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported (full attention only)")
    return Qwen2Config(**decoder_fields_from_hf(d, 1_000_000.0))


def qwen2_to_hf(cfg: Qwen2Config) -> dict[str, Any]:
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **decoder_fields_to_hf(cfg), "use_sliding_window": False}


register(Family(
    "qwen2", Qwen2Model, Qwen2Config, ("qwen2",), qwen2_from_hf, qwen2_to_hf, decoder_hf_key,
    "Qwen2 / Qwen2.5 decoder: GQA with QKV biases, SwiGLU, RMSNorm, RoPE; optionally tied head",
))
