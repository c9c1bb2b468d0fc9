"""megatron-core GPT models with braid's decoder shapes and weights (optional extra ``megatron``).

One braid decoder config (:class:`braid.models.qwen2.Qwen2Config`, or a Llama config
without RoPE scaling) maps to one megatron-core ``TransformerConfig`` (:func:`transformer_config`)
and a ``GPTModel`` built from megatron-core's local (torch) layer spec with the attention
core swapped for ``scaled_dot_product_attention`` (:class:`SdpaCoreAttention`: the kernel
braid's layers call, so a side-by-side timing compares schedules, not attention kernels).

Weights convert both ways by name (:func:`to_mcore`, :func:`from_mcore`): megatron-core
fuses Q/K/V into ``linear_qkv`` (rows grouped per KV head: the group's queries, then its
key, then its value) and gate/up into ``linear_fc1`` (``[gate; up]``); :func:`tp_shard`
cuts a full megatron-core state into the tensors one TP rank's modules hold (``linear_fc1``
of rank r is ``[gate_r; up_r]``, as megatron-core's own checkpoints lay it out).

megatron-core 0.16 hard-codes CUDA in a few places of its pipeline schedules and RoPE;
:func:`allow_cpu` redirects those to the CPU inside megatron-core's modules only, so its
schedules run on gloo in tests. Every import of megatron-core is inside a function
(:func:`require`), with one error line if it is missing.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

INSTALL_HINT = "megatron-core is not installed: pip install -e '.[megatron]' (megatron-core==0.16.1)"


# megatron-core's modules warn as they are imported that Transformer Engine and Apex are missing and that they
# fall back to torch: what the bench's notes already say of its rows (braid.measure.peers), repeated per rank.
_FALLBACK_NOTICE = r"(Transformer Engine and Apex are|Apex is) not installed"


def require() -> Any:
    """The ``megatron.core`` module, or one ``ModuleNotFoundError`` saying how to install it; its import-time
    notices of the missing Transformer Engine and Apex are not printed (:data:`_FALLBACK_NOTICE`)."""
    import warnings

    warnings.filterwarnings("ignore", message=_FALLBACK_NOTICE, category=UserWarning, module=r"megatron\.")
    try:
        import megatron.core as mc
    except ImportError as e:
        raise ModuleNotFoundError(INSTALL_HINT) from e
    return mc


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


def ensure_parallel_state(tp: int, pp: int, vp: int | None, timeout_s: float = 120.0, ep: int = 1) -> None:
    """megatron-core's ``parallel_state`` for a tp x pp job, ``ep`` expert-parallel ranks carved from its
    data-parallel ones (collective; redone when the sizes change).

    Its rank order (TP fastest, PP slowest) is braid's :class:`~braid.core.topology.Topology`
    grid with dp = cp = 1, so both put a TP group on the same neighbouring ranks. With dp > 1
    (expert parallelism) and pp > 1 the grids differ (braid's DP is slowest; megatron-core needs PP
    last then): read this rank's stage and replica from ``parallel_state``, not from braid's groups.
    """
    require()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError("megatron-core models need torch.distributed initialised first (gloo or nccl, any world size)")
    if ps.model_parallel_is_initialized():
        same = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_virtual_pipeline_model_parallel_world_size(), ps.get_expert_model_parallel_world_size())
        if same == (tp, pp, vp, ep):
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vp, expert_model_parallel_size=ep,
                                 distributed_timeout_minutes=max(1, int(timeout_s // 60)))


# -- configuration -------------------------------------------------------------------------
def check_config(cfg: Any) -> None:
    """Raise ``ValueError`` when megatron-core's GPT model cannot express ``cfg``."""
    if getattr(cfg, "llama3_rope", None) is not None:
        raise ValueError("megatron-core models: Llama-3.1 RoPE scaling is not mapped; use plain RoPE")
    if getattr(cfg, "tie_embeddings", False):
        raise ValueError("megatron-core models: tied embeddings are not supported here; use an untied model")


def qkv_bias(cfg: Any) -> bool:
    """Whether the model has Q/K/V biases (Qwen2: yes; Llama: no; :class:`braid.models.mcore.McoreConfig`: its field)."""
    from braid.models import registry

    if hasattr(cfg, "qkv_bias"):
        return bool(cfg.qkv_bias)

    for name in registry.names():
        fam = registry.get_family(name)
        if type(cfg) is fam.config_cls:
            return bool(fam.model_cls.layer_cls.qkv_bias)
    raise ValueError(f"{type(cfg).__name__} belongs to no registered decoder family")


def transformer_config(cfg: Any, *, tp: int = 1, pp: int = 1, vp: int | None = None, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu", graphed: bool = False, extra: dict[str, Any] | None = None) -> Any:
    """megatron-core's ``TransformerConfig`` for braid decoder ``cfg`` at ``tp`` x ``pp`` (``vp`` virtual stages per rank);
    ``extra``: more fields (a mixture of experts': :func:`braid.baselines.megatron_moe.moe_fields`).

    ``graphed``: the whole forward-backward runs in one CUDA graph (``cuda_graph_impl="local"``,
    ``cuda_graph_scope="full_iteration"``, as Megatron-LM's ``--cuda-graph-impl local
    --cuda-graph-scope full_iteration``), so the P2P calls must not synchronise the device.
    """
    require()
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_config(cfg)
    cpu = torch.device(device).type == "cpu"
    return TransformerConfig(
        num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads, num_query_groups=cfg.kv_heads,
        ffn_hidden_size=cfg.ffn, kv_channels=cfg.head_dim, normalization="RMSNorm", layernorm_epsilon=cfg.rms_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=qkv_bias(cfg),
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if pp > 1 else None,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=cpu, perform_initialization=False,
        # Unbatched P2P, as Megatron-LM runs its interleaved schedule (--overlap-p2p-communication,
        # its default there): megatron-core's unbatched ops keep the two directions apart when
        # both neighbours are one rank (pp=2), which its batched ops do not (the batched run at
        # pp=2 matches a received activation with a sent gradient: loss and gradients off, on
        # gloo as on NCCL). Overlapped on eager CUDA; a graphed step and gloo wait for each
        # transfer where it is issued.
        batch_p2p_comm=False, overlap_p2p_comm=not cpu and not graphed,
        # eager: no scope (the default, "full", is deprecated and warns)
        **({"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration"} if graphed else {"cuda_graph_scope": []}),
        **(extra or {}),
    )


class SdpaCoreAttention(nn.Module):
    """megatron-core's ``core_attention`` slot with causal ``scaled_dot_product_attention`` (GQA).

    Takes megatron-core's layout, ``[s, b, heads, d]``, and returns ``[s, b, heads * d]``.
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str, **_: Any) -> None:
        super().__init__()
        self.scale = None if config.softmax_scale is None else float(config.softmax_scale)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any = None,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SdpaCoreAttention runs plain causal attention (no packed sequences, no attention bias)")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=q.shape[1] != k.shape[1])
        s, b = query.shape[0], query.shape[1]
        return o.permute(2, 0, 1, 3).reshape(s, b, -1)


LAYER_SPECS = ("local", "te")


def layer_spec(spec: str = "local") -> Any:
    """megatron-core's GPT layer spec: ``local`` -- its torch layers (RMSNorm) with :class:`SdpaCoreAttention`
    as the attention core; ``te`` -- its Transformer Engine layers (norms fused into the QKV and FC1
    linears, TE's attention), as Megatron-LM trains by default."""
    require()
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if spec not in LAYER_SPECS:
        raise ValueError(f"unknown megatron-core layer spec {spec!r}; valid: {', '.join(LAYER_SPECS)}")
    if spec == "te":
        return get_gpt_layer_with_transformer_engine_spec()

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SdpaCoreAttention
    return spec


def gpt_model(cfg: Any, tconf: Any, *, seq_len: int, pre_process: bool = True, post_process: bool = True,
              vp_stage: int | None = None, spec: str = "local") -> nn.Module:
    """A megatron-core ``GPTModel`` (one pipeline chunk when ``pre_process``/``post_process`` say so) of layer ``spec``."""
    require()
    allow_cpu()
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        tconf, layer_spec(spec), vocab_size=cfg.vocab_size, max_sequence_length=seq_len, position_embedding_type="rope",
        rotary_base=int(cfg.rope_theta), share_embeddings_and_output_weights=False, pre_process=pre_process,
        post_process=post_process, vp_stage=vp_stage,
    )


# -- weights -------------------------------------------------------------------------------
_LAYER_NAMES = {  # braid layer parameter -> megatron-core layer parameter (Q/K/V and gate/up are fused)
    "input_layernorm.weight": "input_layernorm.weight",
    "o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "down_proj.weight": "mlp.linear_fc2.weight",
}
_TOP_NAMES = {
    "embed_tokens.weight": "embedding.word_embeddings.weight",
    "norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Q/K/V rows (or biases) -> megatron-core's ``linear_qkv`` rows: per KV group, its queries, key, value."""
    parts = [t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def _split_qkv(qkv: torch.Tensor, groups: int, heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    per = heads // groups * head_dim
    g = qkv.reshape(groups, per + 2 * head_dim, *qkv.shape[1:])
    q, k, v = g.split([per, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, *qkv.shape[1:]) for t in (q, k, v))


def to_mcore(state: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """A braid decoder's full state (``Qwen2Model.state_dict()`` names) -> a single-device megatron-core ``GPTModel``'s."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name in _TOP_NAMES:
            out[_TOP_NAMES[name]] = t
            continue
        if not name.startswith("layers."):
            raise KeyError(f"no megatron-core name for braid parameter {name!r}")
        _, i, rest = name.split(".", 2)
        pre = f"decoder.layers.{i}."
        if rest in _LAYER_NAMES:
            out[pre + _LAYER_NAMES[rest]] = t
        elif rest.startswith("q_proj."):
            kind = rest.split(".")[1]
            lay = f"layers.{i}."
            out[pre + f"self_attention.linear_qkv.{kind}"] = _fuse_qkv(
                t, state[f"{lay}k_proj.{kind}"], state[f"{lay}v_proj.{kind}"], cfg.kv_heads)
        elif rest == "gate_proj.weight":
            out[pre + "mlp.linear_fc1.weight"] = torch.cat([t, state[f"layers.{i}.up_proj.weight"]])
        elif not rest.startswith(("k_proj.", "v_proj.", "up_proj.")):
            raise KeyError(f"no megatron-core name for braid parameter {name!r}")
    return out


def from_mcore(state: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """A single-device megatron-core ``GPTModel``'s state -> braid decoder names (the inverse of :func:`to_mcore`)."""
    top = {v: k for k, v in _TOP_NAMES.items()}
    layer = {v: k for k, v in _LAYER_NAMES.items()}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("._extra_state") or name.endswith("inv_freq"):
            continue
        if name in top:
            out[top[name]] = t
            continue
        if not name.startswith("decoder.layers."):
            raise KeyError(f"no braid name for megatron-core parameter {name!r}")
        i, rest = name.removeprefix("decoder.layers.").split(".", 1)
        pre = f"layers.{i}."
        if rest in layer:
            out[pre + layer[rest]] = t
        elif rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]
            for n, part in zip(("q_proj", "k_proj", "v_proj"), _split_qkv(t, cfg.kv_heads, cfg.heads, cfg.head_dim)):
                out[f"{pre}{n}.{kind}"] = part
        elif rest == "mlp.linear_fc1.weight":
            out[pre + "gate_proj.weight"], out[pre + "up_proj.weight"] = t.chunk(2)
        else:
            raise KeyError(f"no braid name for megatron-core parameter {name!r}")
    return out


def tp_shard(state: dict[str, torch.Tensor], tp_rank: int, tp: int) -> dict[str, torch.Tensor]:
    """The tensors TP rank ``tp_rank`` of ``tp`` holds, from a full megatron-core state (names unchanged)."""
    if tp == 1:
        return dict(state)
    out = {}
    for name, t in state.items():
        if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")):
            out[name] = t.chunk(tp)[tp_rank]  # linear_qkv: whole KV groups per rank
        elif name.endswith("linear_fc1.weight"):
            gate, up = t.chunk(2)
            out[name] = torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]])
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            out[name] = t.chunk(tp, dim=1)[tp_rank]
        else:
            out[name] = t
    return out


_TE_NAMES = {  # local spec -> Transformer Engine spec: the norms live in the linears after them
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def te_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A megatron-core state under the local spec's names -> the Transformer Engine spec's names."""
    out = {}
    for name, t in state.items():
        head, _, rest = name.partition("decoder.layers.")
        if not head and rest:
            i, sub = rest.split(".", 1)
            name = f"decoder.layers.{i}.{_TE_NAMES.get(sub, sub)}"
        out[name] = t
    return out


def chunk_state(state: dict[str, torch.Tensor], first_layer: int, layers: int, *, embed: bool, head: bool
                ) -> dict[str, torch.Tensor]:
    """The part of a full megatron-core state that a pipeline chunk holds, under the chunk's local names."""
    out = {}
    for name, t in state.items():
        if name.startswith("decoder.layers."):
            i, rest = name.removeprefix("decoder.layers.").split(".", 1)
            if first_layer <= int(i) < first_layer + layers:
                out[f"decoder.layers.{int(i) - first_layer}.{rest}"] = t
        elif name.startswith("embedding."):
            if embed:
                out[name] = t
        elif head:
            out[name] = t
    return out


# -- CPU -----------------------------------------------------------------------------------
class _CpuEvent:
    """A CUDA event on a CPU-only job: the work it marks is done when it is recorded."""

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuStream:
    """The one CUDA stream of a CPU-only job: work runs in program order, so there is nothing to wait for."""

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _CpuEvent:
        return event or _CpuEvent()

    def synchronize(self) -> None:
        pass


_CPU_STREAM = _CpuStream()


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as megatron-core's modules see it on a CPU-only job: the current device is the CPU,
    and every stream is the one in-order CPU stream (megatron-core's MoE dispatcher keeps a side stream
    for its host copies)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> _CpuStream:  # noqa: N802 - torch.cuda's name
        return _CPU_STREAM

    @staticmethod
    def current_stream(*args: Any) -> _CpuStream:
        return _CPU_STREAM

    @staticmethod
    def stream(s: Any) -> Any:
        import contextlib

        return contextlib.nullcontext()

    @staticmethod
    def Event(*args: Any, **kwargs: Any) -> _CpuEvent:  # noqa: N802 - torch.cuda's name
        return _CpuEvent()


class _CpuTorch(types.ModuleType):
    """``torch`` as megatron-core's schedules see it on a CPU-only job: ``device="cuda"`` means the CPU."""

    cuda = _CpuCuda("torch.cuda")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def allow_cpu() -> None:
    """Let megatron-core 0.16's pipeline schedules and RoPE run on a CPU-only (gloo) job.

    They allocate on ``torch.cuda.current_device()`` / ``device="cuda"`` unconditionally;
    this rebinds ``torch`` in those modules only (nothing else in the process changes).
    Idempotent; a no-op when CUDA is available.
    """
    if torch.cuda.is_available():
        return
    require()
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rope
    import megatron.core.pipeline_parallel.p2p_communication as p2p
    import megatron.core.pipeline_parallel.schedules as schedules

    cpu_torch_in(rope, p2p, schedules)


def cpu_torch_in(*modules: types.ModuleType) -> None:
    """Rebind ``torch`` in megatron-core's ``modules`` to the CPU view (:func:`allow_cpu`); idempotent."""
    for mod in modules:
        if not isinstance(mod.torch, _CpuTorch):
            mod.torch = _CpuTorch("torch")
