"""Qwen3-MoE (transformers' ``Qwen3MoeForCausalLM``): Qwen3's attention, a mixture of experts in sparse layers.

Layer ``i`` is a mixture-of-experts layer unless it is in ``mlp_only_layers`` or
``(i + 1) % decoder_sparse_step`` is not 0 (then it is a dense :class:`braid.models.qwen3.Qwen3Layer`
of width ``ffn``). An MoE layer's units (:mod:`braid.models.seam`, :data:`braid.core.braiding.MOE_LAYER_UNITS`):
Pre-Attn and Attn are Qwen3's; Pre-MLP the norm, the router, top-k and the permutation
(:meth:`Qwen3MoeLayer.route_rows`), ending with the dispatch of the rows to their experts;
Experts the grouped expert GEMMs (:mod:`braid.models.moe`), ending with the combine's exchange
back; MLP the un-permutation, the weighted sum and the residual. A cut chunk runs them
(:mod:`braid.models.moe_ops`); in one piece (the single-device model, a fused chunk)
:func:`braid.models.moe_dispatch.moe_forward` runs them with blocking exchanges. Expert
parallelism swaps the layer's ``dispatcher`` (:mod:`braid.runtime.expert_parallel`).

The load-balancing loss (``router_aux_loss_coef`` times :func:`braid.models.moe.load_balancing_loss`)
is added to the single-device model's loss when ``output_router_logits`` is set, as
transformers does. It couples every MoE layer of a batch (one sum over all of them, then a
product), so a pipelined run would have to carry every stage's counts to every other;
chunks are not built for such a config (:func:`check_chunkable`).

Checkpoints: transformers keeps each expert's ``gate_proj``/``up_proj``/``down_proj`` as
tensors of their own (``mlp.experts.{e}.*``); braid stacks them into ``experts.gate_up``
(E, 2 ffn, hidden) and ``experts.down`` (E, hidden, ffn) (:class:`MoeWeights`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Collection

import torch
import torch.nn.functional as F
from torch import nn

from braid.core.braiding import Unit
from braid.models import tp_partial
from braid.models.moe import Experts, load_balancing_loss, permute, route
from braid.models.moe_dispatch import LOCAL, Dispatcher, ExpertSlice, moe_forward
from braid.models.seam import fused_residual
from braid.models.qwen3 import (
    Qwen3Config, Qwen3Layer, Qwen3Model, qwen3_fields_from_hf, qwen3_fields_to_hf, qwen3_hf_key,
    shard_qwen3_layer,
)
from braid.models.registry import Family, register
from braid.tp.layers import ColumnParallelLinear


@dataclass(frozen=True, slots=True)
class Qwen3MoeConfig(Qwen3Config):
    """Model shape; defaults are a tiny model for tests. Qwen3-30B-A3B: hidden 2048, 48 layers, 32/4 heads
    of 128, 128 experts of width 768, 8 per token.

    ``experts``: experts per MoE layer; ``experts_per_token``: the router's top-k;
    ``moe_ffn``: an expert's width; ``ffn``: the width of the dense layers (``mlp_only_layers``,
    or those ``decoder_sparse_step`` skips); ``norm_topk_prob``: the top-k probabilities are
    renormalised to sum to one; ``router_aux_loss_coef`` / ``output_router_logits``: the
    load-balancing loss's weight and whether it is added (transformers' switches).
    """

    experts: int = 4
    experts_per_token: int = 2
    moe_ffn: int = 16
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False

    def __post_init__(self) -> None:
        Qwen3Config.__post_init__(self)
        if self.experts < 1 or self.moe_ffn < 1 or self.decoder_sparse_step < 1:
            raise ValueError(f"experts ({self.experts}), moe_ffn ({self.moe_ffn}) and decoder_sparse_step "
                             f"({self.decoder_sparse_step}) must be positive")
        if not 1 <= self.experts_per_token <= self.experts:
            raise ValueError(f"experts_per_token (top-k {self.experts_per_token}) must be between 1 and "
                             f"the {self.experts} experts")
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer`` is a mixture of experts (transformers' rule)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


class Qwen3MoeLayer(Qwen3Layer):
    """One Qwen3-MoE decoder layer: Qwen3 attention, a router and ``cfg.experts`` SwiGLU experts."""

    def __init__(self, cfg: Qwen3MoeConfig, heads: int | None = None, kv_heads: int | None = None, ffn: int | None = None,
                 tp: int = 1) -> None:
        super().__init__(cfg, heads, kv_heads, 1, tp)
        self.gate_proj = self.up_proj = self.down_proj = None  # the experts take the dense MLP's place
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = Experts(cfg.experts, cfg.hidden, cfg.moe_ffn)
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.experts, cfg.experts_per_token, cfg.norm_topk_prob
        self.dispatcher: Dispatcher = LOCAL

    def gate_up(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-MLP after the norm, in one piece: the normed states (a view) and the router logits (b, s, E)."""
        return h.view_as(h), self.router(h)

    def mlp_core(self, h: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Route, permute, run the experts (through the dispatcher, blocking), combine: (b, s, hidden)."""
        return moe_forward(h, logits, self.experts, top_k=self.top_k, norm_topk_prob=self.norm_topk_prob,
                           num_experts=self.num_experts, dispatcher=self.dispatcher)

    def route_rows(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pre-MLP after the norm, cut: normed states (b, s, h) -> their top-k rows sorted by expert (T*k, h),
        the slots' weights (T, k), ``order`` (T*k,) and rows per expert (E,) (:func:`braid.models.moe.permute`)."""
        h2 = h.reshape(-1, h.shape[-1])
        weights, chosen = route(self.router(h).reshape(h2.shape[0], -1), self.top_k, self.norm_topk_prob)
        rows, order, counts = permute(h2, chosen, self.num_experts)
        return rows, weights, order, counts

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by local expert, ``counts`` per local expert -> the experts' outputs."""
        return self.experts(rows, counts)

    def unit_forward(self, unit: Unit, *inputs: torch.Tensor, residual: torch.Tensor | None = None,
                     positions: torch.Tensor | None = None) -> tuple[torch.Tensor, ...] | torch.Tensor:
        """In one piece (a fused chunk): Pre-MLP -> (states, logits); Experts -> the MoE output; MLP -> + residual/tp."""
        if unit is Unit.EXPERTS:
            return self.mlp_core(*inputs)
        return super().unit_forward(unit, *inputs, residual=residual, positions=positions)

    def mlp(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The MLP unit of an MoE layer (the combine), in one piece: the Experts unit's output plus the fused residual."""
        out, residual = inputs
        return fused_residual(self, out, residual)

    def unit_weights(self, unit: Unit) -> tuple[nn.Module, ...]:
        if unit is Unit.PRE_MLP:
            return (self.router,)
        if unit is Unit.EXPERTS:
            return (self.experts.gate_up, self.experts.down)
        if unit is Unit.MLP:
            return ()
        return super().unit_weights(unit)

    def forward_routed(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Single-device forward that also returns the router logits (for the load-balancing loss)."""
        x = self.attn_core(*self.qkv(self.norm1(x))) + x
        h, logits = self.gate_up(self.norm2(x))
        return self.mlp_core(h, logits) + x, logits


def check_chunkable(cfg: Qwen3MoeConfig) -> None:
    """Chunks run the units of one layer at a time; the load-balancing loss needs all layers' routing at once."""
    if cfg.output_router_logits and cfg.router_aux_loss_coef:
        raise ValueError("qwen3_moe: the load-balancing loss (output_router_logits with router_aux_loss_coef "
                         f"{cfg.router_aux_loss_coef}) couples every layer of a batch and is not supported by pipelined "
                         "runs yet; set output_router_logits false")


def shard_moe_layer(layer: Qwen3MoeLayer, cfg: Qwen3MoeConfig, tp_rank: int, tp_size: int) -> Qwen3MoeLayer:
    """The TP shard of an MoE layer: Qwen3's attention shard; the router whole on every rank (a linear
    whose weight gradient can be deferred); the experts split over the TP ranks
    (:class:`braid.models.moe.ExpertSlice`: each rank runs its experts on the tokens every rank
    holds, the MLP's all-reduce sums them). The router's gradient then comes from the rank's
    experts only: marked partial over TP (:mod:`braid.models.tp_partial`)."""
    if cfg.experts % tp_size:
        raise ValueError(f"qwen3_moe: the {cfg.experts} experts are split over TP ranks; tp={tp_size} must divide them")
    out = shard_qwen3_layer(layer, cfg, tp_rank, tp_size)
    out.router = ColumnParallelLinear.from_full(layer.router, 0, 1)
    out.router.tp_split = None  # whole on every TP rank (braid.models.build.chunk_state)
    out.experts = copy.deepcopy(layer.experts)
    if tp_size > 1:
        per = cfg.experts // tp_size
        for lin in (out.experts.gate_up, out.experts.down):
            lin.weight = nn.Parameter(lin.weight.detach()[tp_rank * per:(tp_rank + 1) * per].clone())
            lin.tp_split = 0
        tp_partial.mark(out.router.weight)
        out.dispatcher = ExpertSlice(tp_rank * per, per)
    return out


class Qwen3MoeModel(Qwen3Model):
    """Embedding, Qwen3-MoE decoder layers (MoE or dense by :meth:`Qwen3MoeConfig.is_moe`), final norm, LM head."""

    layer_cls = Qwen3Layer  # the dense layers'; make_layer builds the MoE ones

    def make_layer(self, cfg: Qwen3MoeConfig, index: int) -> Qwen3Layer:
        return Qwen3MoeLayer(cfg) if cfg.is_moe(index) else Qwen3Layer(cfg)

    def shard_layer(self, layer: nn.Module, tp_rank: int, tp_size: int) -> Qwen3Layer:
        check_chunkable(self.cfg)
        if isinstance(layer, Qwen3MoeLayer):
            return shard_moe_layer(layer, self.cfg, tp_rank, tp_size)
        return shard_qwen3_layer(layer, self.cfg, tp_rank, tp_size)  # type: ignore[arg-type]

    def routed_logits(self, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(b, s) token ids -> (b, s, vocab) float logits and every MoE layer's router logits (b, s, E)."""
        x = self.embed_tokens(tokens)
        routers = []
        for layer in self.layers:
            if isinstance(layer, Qwen3MoeLayer):
                x, r = layer.forward_routed(x)
                routers.append(r)
            else:
                x = layer(x)
        logits = self.lm_head(self.norm(x))
        return logits.to(torch.promote_types(logits.dtype, torch.float32)), routers

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.routed_logits(tokens)[0]

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy of shifted ``labels``, plus ``router_aux_loss_coef`` times the
        load-balancing loss when ``cfg.output_router_logits`` (transformers' loss)."""
        logits, routers = self.routed_logits(tokens)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        cfg = self.cfg
        if cfg.output_router_logits and routers:
            loss = loss + cfg.router_aux_loss_coef * load_balancing_loss(routers, cfg.experts, cfg.experts_per_token)
        return loss


# -- Hugging Face names, config and expert tensors (the family's registry entry) ---------------
_EXPERT_PARTS = {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


def _expert_param(name: str) -> tuple[str, str] | None:
    """``layers.{i}.experts.{gate_up|down}.weight`` -> (layer index, part); None for other names."""
    parts = name.split(".")
    if len(parts) == 5 and parts[0] == "layers" and parts[2] == "experts" and parts[3] in _EXPERT_PARTS:
        return parts[1], parts[3]
    return None


def moe_hf_key(name: str) -> str:
    """A Qwen3-MoE parameter name -> its checkpoint tensor name (an expert stack: expert 0's first tensor)."""
    got = _expert_param(name)
    if got is not None:
        return f"model.layers.{got[0]}.mlp.experts.0.{_EXPERT_PARTS[got[1]][0]}.weight"
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[0] == "layers" and parts[2] == "router":
        return f"model.layers.{parts[1]}.mlp.gate.{parts[3]}"
    return qwen3_hf_key(name)


@dataclass(frozen=True, slots=True)
class MoeWeights:
    """The :class:`braid.models.registry.HFWeights` of a Qwen3-MoE checkpoint: each expert stack is
    ``experts`` per-expert tensors (``gate_up``: gate and up rows, concatenated)."""

    experts: int

    def key(self, name: str) -> str:
        return moe_hf_key(name)

    def keys(self, name: str) -> tuple[str, ...]:
        got = _expert_param(name)
        if got is None:
            return (moe_hf_key(name),)
        i, part = got
        return tuple(f"model.layers.{i}.mlp.experts.{e}.{p}.weight" for e in range(self.experts) for p in _EXPERT_PARTS[part])

    def read(self, name: str, tensor: Callable[[str], torch.Tensor]) -> torch.Tensor:
        got = _expert_param(name)
        if got is None:
            return tensor(moe_hf_key(name))
        per = len(_EXPERT_PARTS[got[1]])
        keys = self.keys(name)
        return torch.stack([torch.cat([tensor(k) for k in keys[e * per:(e + 1) * per]]) for e in range(self.experts)])

    def write(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            got = _expert_param(name)
            if got is None:
                out[moe_hf_key(name)] = t
                continue
            per = len(_EXPERT_PARTS[got[1]])
            pieces = [piece.clone() for stack in t for piece in stack.chunk(per)]  # own storage each; gate before up
            out.update(zip(self.keys(name), pieces))
        return out


def moe_weights(cfg: Qwen3MoeConfig, keys: Collection[str] | None = None) -> MoeWeights:
    return MoeWeights(cfg.experts)


def qwen3_moe_from_hf(d: dict[str, Any]) -> Qwen3MoeConfig:
    experts = d.get("num_experts", d.get("num_local_experts"))
    if experts is None:
        raise KeyError("num_experts")
    fields = qwen3_fields_from_hf(d)
    return Qwen3MoeConfig(
        **fields, experts=int(experts), experts_per_token=int(d["num_experts_per_tok"]),
        moe_ffn=int(d["moe_intermediate_size"]), norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        decoder_sparse_step=int(d.get("decoder_sparse_step", 1)), mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
        router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
        output_router_logits=bool(d.get("output_router_logits", False)),
    )


def qwen3_moe_to_hf(cfg: Qwen3MoeConfig) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **qwen3_fields_to_hf(cfg),
        "num_experts": cfg.experts, "num_experts_per_tok": cfg.experts_per_token, "moe_intermediate_size": cfg.moe_ffn,
        "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": cfg.decoder_sparse_step,
        "mlp_only_layers": list(cfg.mlp_only_layers), "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": cfg.output_router_logits,
    }


register(Family(
    "qwen3_moe", Qwen3MoeModel, Qwen3MoeConfig, ("qwen3_moe",), qwen3_moe_from_hf, qwen3_moe_to_hf, moe_hf_key,
    "Qwen3-MoE decoder: Qwen3 attention (QK-norm), top-k routed SwiGLU experts, load-balancing loss",
    hf_weights=moe_weights,
))
