"""A megatron-core GPT model driven by braid's schedules, through the model seam.

:class:`McoreGPT` is a megatron-core ``GPTModel`` (:func:`braid.baselines.megatron_gpt.gpt_model`, one
device: tp = pp = 1) seen as a :class:`braid.models.seam.StageModel`: its ``embed_tokens``,
``layers`` (megatron-core ``TransformerLayer`` modules), ``norm`` and ``lm_head`` *are*
the GPT model's modules, so its parameters, its ``state_dict`` and its
``sharded_state_dict`` are megatron-core's. :meth:`McoreGPT.shard_layer` turns one
``TransformerLayer`` into an :class:`McoreUnitLayer`: megatron-core's norms, and its fused
``linear_qkv`` / ``linear_proj`` / ``linear_fc1`` / ``linear_fc2`` weights as braid's
deferred-gradient TP linears (the executor splits weight gradients off and runs the TP
all-reduces itself, braided). ``linear_fc1`` stays ``[gate; up]`` per TP rank as two
linears (``linear_fc1.gate`` / ``linear_fc1.up``), so the TP shards join into megatron-core's
full layout; :func:`gpt_state` turns a chunk state (:func:`braid.models.build.chunk_state`)
back into the GPT model's names, which megatron-core then loads and checkpoints
(:meth:`McoreGPT.gpt`, ``sharded_state_dict``).

megatron-core is imported only when a model is built (optional extra ``megatron``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from braid.core.braiding import Unit
from braid.models.init import init_by_name
from braid.models.qwen2 import EAGER, Qwen2Config, RopeCache, UnitFns, cached_rope_tables, qwen2_to_hf
from braid.models.registry import Family, register
from braid.models.seam import fused_residual
from braid.tp.layers import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from braid.models.sequence_parallel import SequenceParallel


@dataclass(frozen=True, slots=True)
class McoreConfig(Qwen2Config):
    """A decoder shape for megatron-core's GPT model (GQA, SwiGLU, RMSNorm, RoPE); ``qkv_bias``: Qwen2's Q/K/V biases."""

    qkv_bias: bool = True


class McoreUnitLayer(nn.Module):
    """One megatron-core ``TransformerLayer`` (a TP shard of it) as braid's four units.

    Parameter names follow megatron-core's layer (``input_layernorm``,
    ``self_attention.linear_qkv``, ``self_attention.linear_proj``, ``pre_mlp_layernorm``,
    ``mlp.linear_fc1.{gate,up}``, ``mlp.linear_fc2``). ``groups``: the local KV groups.
    """

    fns: UnitFns = EAGER

    def __init__(self, layer: nn.Module, cfg: McoreConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        import copy

        for what, n in (("heads", cfg.heads), ("KV heads", cfg.kv_heads), ("ffn", cfg.ffn)):
            if n % tp_size:
                raise ValueError(f"{what} ({n}) not divisible by tp={tp_size}")
        self.tp, self.theta, self.head_dim = tp_size, cfg.rope_theta, cfg.head_dim
        self.groups, self.per_group = cfg.kv_heads // tp_size, cfg.heads // cfg.kv_heads
        self.sp: SequenceParallel | None = None
        self.seq_rank: int | None = None  # set by the chunk builder under sequence sharding (braid.tp.seq_shard)
        self.rope_cache = RopeCache()
        att, mlp = layer.self_attention, layer.mlp
        self.input_layernorm = copy.deepcopy(layer.input_layernorm)
        self.pre_mlp_layernorm = copy.deepcopy(layer.pre_mlp_layernorm)
        self.self_attention = nn.Module()
        self.self_attention.linear_qkv = ColumnParallelLinear.from_full(att.linear_qkv, tp_rank, tp_size)  # whole KV groups
        self.self_attention.linear_proj = RowParallelLinear.from_full(att.linear_proj, tp_rank, tp_size)
        f, per = cfg.ffn, cfg.ffn // tp_size
        rows = torch.arange(tp_rank * per, (tp_rank + 1) * per)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Module()
        self.mlp.linear_fc1.gate = ColumnParallelLinear.from_full(mlp.linear_fc1, tp_rank, tp_size, rows)
        self.mlp.linear_fc1.up = ColumnParallelLinear.from_full(mlp.linear_fc1, tp_rank, tp_size, rows + f)
        self.mlp.linear_fc2 = RowParallelLinear.from_full(mlp.linear_fc2, tp_rank, tp_size)

    # -- the model seam (braid.models.seam.UnitLayer) ------------------------------------
    def unit_norm(self, unit: Unit) -> nn.Module:
        return self.input_layernorm if unit is Unit.PRE_ATTN else self.pre_mlp_layernorm

    def unit_forward(self, unit: Unit, *inputs: torch.Tensor, residual: torch.Tensor | None = None,
                     positions: torch.Tensor | None = None) -> tuple[torch.Tensor, ...] | torch.Tensor:
        if unit is Unit.PRE_ATTN:
            return self._qkv(inputs[0], positions)
        if unit is Unit.PRE_MLP:
            fc1 = self.mlp.linear_fc1
            return fc1.gate(inputs[0]), fc1.up(inputs[0])
        if residual is None:
            raise ValueError(f"unit {unit.value} needs the residual")
        if unit is Unit.ATTN:
            out = self.self_attention.linear_proj(self._attention(*inputs))
        else:
            out = self.mlp.linear_fc2(self.fns.swiglu(*inputs))
        return fused_residual(self, out, residual)

    def unit_weights(self, unit: Unit) -> tuple[nn.Module, ...]:
        return {
            Unit.PRE_ATTN: (self.self_attention.linear_qkv,),
            Unit.ATTN: (self.self_attention.linear_proj,),
            Unit.PRE_MLP: (self.mlp.linear_fc1.gate, self.mlp.linear_fc1.up),
            Unit.MLP: (self.mlp.linear_fc2,),
        }[unit]

    # -- units ---------------------------------------------------------------------------
    def _qkv(self, h: torch.Tensor, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """megatron-core's fused QKV rows (per KV group: its queries, key, value) -> q (b, H/t, s, d), k, v (b, G/t, s, d)."""
        b, s, _ = h.shape
        g = self.self_attention.linear_qkv(h).view(b, s, self.groups, self.per_group + 2, self.head_dim)
        q = g[:, :, :, : self.per_group].reshape(b, s, self.groups * self.per_group, self.head_dim).transpose(1, 2)
        k, v = g[:, :, :, self.per_group].transpose(1, 2), g[:, :, :, self.per_group + 1].transpose(1, 2)
        q, k = self.fns.rope_qk(q, k, *cached_rope_tables(self.rope_cache, self.theta, s, self.head_dim, h.device, h.dtype, positions))
        return q, k, v

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.sp is not None:
            o = self.sp.attention(q, k, v, causal=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        b, heads, s, d = o.shape
        return o.transpose(1, 2).reshape(b, s, heads * d)


class McoreGPT(nn.Module):
    """A single-device megatron-core ``GPTModel`` as a braid :class:`~braid.models.seam.StageModel`.

    Building it initialises megatron-core's model-parallel state at tp = pp = 1 when it is
    not (collective over the default process group, which must exist).
    """

    def __init__(self, cfg: McoreConfig) -> None:
        super().__init__()
        from braid.baselines import megatron_gpt as bm

        self.cfg = cfg
        bm.ensure_parallel_state(1, 1, None)
        gpt = bm.gpt_model(cfg, bm.transformer_config(cfg), seq_len=4096)
        object.__setattr__(self, "_gpt", gpt)  # not a child: the parameters live under braid's names below
        self.embed_tokens = gpt.embedding.word_embeddings
        self.layers = gpt.decoder.layers
        self.norm = gpt.decoder.final_layernorm
        self.lm_head = gpt.output_layer

    def __deepcopy__(self, memo: dict) -> "McoreGPT":
        """A new model with copies of the parameters (megatron-core's modules hold process groups, which do not copy)."""
        p = next(self.parameters())
        out = McoreGPT(self.cfg).to(device=p.device, dtype=p.dtype)
        with torch.no_grad():
            for (_, a), (_, b) in zip(out.named_parameters(), self.named_parameters()):
                a.copy_(b)
                a.requires_grad_(b.requires_grad)
        memo[id(self)] = out
        return out

    @property
    def gpt(self) -> nn.Module:
        """The megatron-core ``GPTModel`` (its modules are this model's): ``state_dict``, ``sharded_state_dict``."""
        return self._gpt

    def init_weights(self, seed: int, std: float = 0.2) -> "McoreGPT":
        """Initialise every parameter from ``seed`` and its name (:func:`braid.models.init.init_by_name`)."""
        init_by_name(self, seed, std)
        return self

    def shard_layer(self, layer: nn.Module, tp_rank: int, tp_size: int) -> McoreUnitLayer:
        return McoreUnitLayer(layer, self.cfg, tp_rank, tp_size)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """(b, s) token ids -> (b, s, vocab) fp32 logits, by megatron-core's forward."""
        b, s = tokens.shape
        pos = torch.arange(s, device=tokens.device).expand(b, s)
        return self._gpt(tokens, pos, None).float()

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy of next-token ``labels`` (already shifted; -100 ignored)."""
        logits = self.logits(tokens)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def gpt_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A chunk state of :class:`McoreGPT` chunks (braid's names, TP joined) -> the ``GPTModel``'s names."""
    top = {"embed_tokens.weight": "embedding.word_embeddings.weight", "norm.weight": "decoder.final_layernorm.weight",
           "lm_head.weight": "output_layer.weight"}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name in top:
            out[top[name]] = t
        elif name.endswith("mlp.linear_fc1.gate.weight"):
            out["decoder." + name.replace("linear_fc1.gate.", "linear_fc1.")] = torch.cat(
                [t, state[name.replace(".gate.", ".up.")]])
        elif not name.endswith("mlp.linear_fc1.up.weight"):
            out["decoder." + name] = t
    return out


def _no_hf(*_: Any) -> Any:
    raise ValueError("the megatron-core family reads no HF config; convert with braid.baselines.megatron_gpt.from_mcore to a qwen2/llama model")


def _to_hf(cfg: McoreConfig) -> dict[str, Any]:
    return qwen2_to_hf(cfg)


def _hf_key(name: str) -> str:
    raise ValueError(f"{name}: megatron-core's fused tensors have no single HF name; "
                     "convert with braid.baselines.megatron_gpt.from_mcore first")


register(Family(
    "mcore_gpt", McoreGPT, McoreConfig, (), _no_hf, _to_hf, _hf_key,
    "megatron-core GPTModel (local layer spec): GQA (optional QKV bias), SwiGLU, RMSNorm, RoPE; needs megatron-core",
))
