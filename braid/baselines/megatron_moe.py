"""megatron-core GPT models with mixture-of-experts layers holding braid's Qwen3-MoE weights (optional extra ``megatron``).

A braid :class:`~braid.models.qwen3_moe.Qwen3MoeConfig` maps to megatron-core's
``TransformerConfig`` plus the fields of :func:`moe_fields`, and to a ``GPTModel`` built from
megatron-core's local block spec (``get_gpt_decoder_block_spec(use_transformer_engine=False)``:
a MoE layer where :meth:`~braid.models.qwen3_moe.Qwen3MoeConfig.is_moe` says so, a dense one
elsewhere), attention core swapped for :class:`~braid.baselines.megatron_gpt.SdpaCoreAttention`
as in the dense rows (:func:`gpt_model`).

What maps to what:

- Qwen3's QK-norm: ``qk_layernorm=True`` (an RMSNorm over each head's ``head_dim``, before RoPE).
- Routing: Qwen3 takes the softmax over all experts, its top-k, and with ``norm_topk_prob``
  renormalises them to sum to one. Softmax is monotonic, so the top-k of the probabilities are
  the top-k of the logits, and ``p_i / sum_topk p_j = exp(l_i) / sum_topk exp(l_j)``: the
  softmax over the top-k logits, megatron-core's ``moe_router_pre_softmax=False``. Without
  ``norm_topk_prob``: softmax over all, then top-k, ``moe_router_pre_softmax=True``.
- Experts: megatron-core's ``SequentialMLP`` (one ``MLP`` per local expert, ``linear_fc1`` =
  ``[gate; up]`` of ``moe_ffn`` rows each, ``linear_fc2`` = down), because its local spec's
  grouped GEMM (``moe_grouped_gemm=True``) is the legacy ``GroupedMLP``, which needs the
  ``grouped_gemm`` package (not installed; Transformer Engine's ``TEGroupedMLP`` needs TE).
- Token dispatch: ``alltoall``, dropless (no capacity factor), ``expert_model_parallel_size=ep``;
  expert-parallel rank ``r`` holds experts ``[r E/ep, (r+1) E/ep)`` as braid's
  :func:`~braid.runtime.expert_parallel.shard_experts` does (:func:`ep_shard`).
- Load-balancing loss: off when braid's is off (``output_router_logits`` false, as every
  pipelined braid run: :func:`braid.models.qwen3_moe.check_chunkable`). When it is on, megatron-core's
  ``aux_loss`` with the same coefficient -- a different formula: per layer and per micro-batch
  with the routed fraction divided by top-k, where transformers' (braid's) couples all layers of
  the batch; its gradient is added by megatron-core, not its value to the reported loss.

megatron-core 0.16.1's MoE needs two shims here (:func:`allow_moe`): ``moe_utils`` imports
Transformer Engine's ``te_general_gemm`` in a ``try`` whose ``except`` leaves the name undefined,
and the router's gating tests ``te_general_gemm is not None`` -- a ``NameError`` on every MoE
forward without TE, on CUDA as on CPU; it is set to None (what that test expects). On a
CPU-only job the alltoall dispatcher's side stream for its host copies, and the
``torch.cuda.current_device()`` of the router and of the expert-parallel all-gather, are redirected to the CPU
(:func:`braid.baselines.megatron_gpt.cpu_torch_in`), and the dispatcher's host copy of its split sizes
(a no-op for host tensors, which would stay tensors) gives numpy as on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from braid.baselines import megatron_gpt as bm

_EXPERTS = "mlp.experts.local_experts."
_MOE_NAMES = {  # braid layer parameter -> megatron-core layer parameter (besides the expert stacks)
    "q_norm.weight": "self_attention.q_layernorm.weight",
    "k_norm.weight": "self_attention.k_layernorm.weight",
    "router.weight": "mlp.router.weight",
}
_STACKS = {"experts.gate_up.weight": "linear_fc1.weight", "experts.down.weight": "linear_fc2.weight"}


def is_moe(cfg: Any) -> bool:
    """Whether braid decoder config ``cfg`` has mixture-of-experts layers (a Qwen3-MoE config)."""
    return int(getattr(cfg, "experts", 0) or 0) > 0 and hasattr(cfg, "is_moe")


def check_layout(cfg: Any, *, tp: int, ep: int, dp: int) -> None:
    """``ValueError`` (one line) unless megatron-core's MoE baseline runs ``cfg`` at this layout."""
    if tp != 1:
        raise ValueError(f"megatron-core MoE rows run tp=1 (got tp={tp}): its MoE under TP needs sequence "
                         "parallelism, which these rows do not run")
    if ep < 1 or dp % ep:
        raise ValueError(f"ep={ep} must divide the data-parallel ranks (dp={dp})")
    if cfg.experts % ep:
        raise ValueError(f"ep={ep} must divide the model's {cfg.experts} experts per layer")


def aux_loss_on(cfg: Any) -> bool:
    return bool(cfg.output_router_logits and cfg.router_aux_loss_coef)


def moe_fields(cfg: Any, *, ep: int = 1, a2a_overlap: bool = False) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of a Qwen3-MoE model (see the module doc), ``ep`` expert-parallel ranks;
    ``a2a_overlap``: megatron-core's EP all-to-all overlap (``overlap_moe_expert_parallel_comm``)."""
    aux = aux_loss_on(cfg)
    return dict(
        qk_layernorm=True, num_moe_experts=cfg.experts, moe_ffn_hidden_size=cfg.moe_ffn,
        moe_layer_freq=[int(cfg.is_moe(i)) for i in range(cfg.layers)],
        moe_router_topk=cfg.experts_per_token, moe_router_score_function="softmax",
        moe_router_pre_softmax=not cfg.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if aux else "none",
        moe_aux_loss_coeff=float(cfg.router_aux_loss_coef) if aux else 0.0,
        moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=None, moe_grouped_gemm=False,
        expert_model_parallel_size=ep, overlap_moe_expert_parallel_comm=a2a_overlap,
    )


def allow_moe() -> None:
    """Let megatron-core 0.16.1's MoE layers run without Transformer Engine, and on a CPU-only job (module doc)."""
    bm.require()
    import megatron.core.tensor_parallel.mappings as mappings
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.router as router
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    if "te_general_gemm" not in vars(moe_utils):
        moe_utils.te_general_gemm = None
    if not torch.cuda.is_available():
        bm.allow_cpu()
        bm.cpu_torch_in(dispatcher, router, moe_utils, mappings)
        dispatcher.maybe_move_tensor_to_cpu = _host_splits


def _host_splits(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """The alltoall dispatcher's ``maybe_move_tensor_to_cpu`` on a CPU-only job: its tensors are on the host
    already, and the all-to-all's split sizes become numpy as on CUDA (``all_to_all_single`` takes no tensor)."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def block_spec(tconf: Any, *, vp_stage: int | None = None, pp_rank: int | None = None) -> Any:
    """megatron-core's local decoder block spec for ``tconf`` (MoE and dense layers by ``moe_layer_freq``),
    the layers of pipeline chunk (``pp_rank``, ``vp_stage``), with SDPA as the attention core."""
    bm.require()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(tconf, use_transformer_engine=False, normalization="RMSNorm",
                                      vp_stage=vp_stage, pp_rank=pp_rank)
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = bm.SdpaCoreAttention
    return spec


def gpt_model(cfg: Any, tconf: Any, *, seq_len: int, pre_process: bool = True, post_process: bool = True,
              vp_stage: int | None = None, pp_rank: int | None = None) -> nn.Module:
    """A megatron-core ``GPTModel`` with MoE layers (one pipeline chunk when ``pre_process``/``post_process`` say so)."""
    allow_moe()
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        tconf, block_spec(tconf, vp_stage=vp_stage, pp_rank=pp_rank), vocab_size=cfg.vocab_size,
        max_sequence_length=seq_len, position_embedding_type="rope", rotary_base=int(cfg.rope_theta),
        share_embeddings_and_output_weights=False, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
    )


# -- weights -------------------------------------------------------------------------------
def to_mcore(state: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """A braid Qwen3-MoE model's full state -> a single-device megatron-core MoE ``GPTModel``'s (every expert:
    ``mlp.experts.local_experts.{e}``, ``e`` global). Attention, norms and dense layers as
    :func:`braid.baselines.megatron_gpt.to_mcore`."""
    out: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        parts = name.split(".", 2)
        if parts[0] != "layers" or parts[2] not in (*_MOE_NAMES, *_STACKS):
            rest[name] = t
            continue
        pre = f"decoder.layers.{parts[1]}."
        if parts[2] in _MOE_NAMES:
            out[pre + _MOE_NAMES[parts[2]]] = t
        else:
            for e, w in enumerate(t):
                out[f"{pre}{_EXPERTS}{e}.{_STACKS[parts[2]]}"] = w
    out.update(bm.to_mcore(rest, cfg))
    return out


def from_mcore(state: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """A single-device megatron-core MoE ``GPTModel``'s state (every expert) -> braid names (inverse of :func:`to_mcore`)."""
    names = {v: k for k, v in _MOE_NAMES.items()}
    stacks = {v: k for k, v in _STACKS.items()}
    out: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        if not name.startswith("decoder.layers."):
            rest[name] = t
            continue
        i, sub = name.removeprefix("decoder.layers.").split(".", 1)
        if sub in names:
            out[f"layers.{i}.{names[sub]}"] = t
        elif sub.startswith(_EXPERTS):
            e, part = sub.removeprefix(_EXPERTS).split(".", 1)
            if part in stacks:
                experts.setdefault((i, stacks[part]), {})[int(e)] = t
            elif not part.endswith("._extra_state"):
                raise KeyError(f"no braid name for megatron-core parameter {name!r}")
        else:
            rest[name] = t
    for (i, part), by_e in experts.items():
        out[f"layers.{i}.{part}"] = torch.stack([by_e[e] for e in range(len(by_e))])
    out.update(bm.from_mcore(rest, cfg))
    return out


def ep_shard(state: dict[str, torch.Tensor], ep_rank: int, ep: int, experts: int) -> dict[str, torch.Tensor]:
    """The tensors expert-parallel rank ``ep_rank`` of ``ep`` holds, from a full megatron-core MoE state: its
    experts ``[ep_rank E/ep, (ep_rank+1) E/ep)``, renumbered from 0 (megatron-core's local experts); the rest whole."""
    per = experts // ep
    out = {}
    for name, t in state.items():
        head, sep, tail = name.partition(_EXPERTS)
        if not sep:
            out[name] = t
            continue
        e, part = tail.split(".", 1)
        if int(e) // per == ep_rank:
            out[f"{head}{_EXPERTS}{int(e) - ep_rank * per}.{part}"] = t
    return out


def is_expert_param(name: str) -> bool:
    """Whether megatron-core parameter ``name`` belongs to an expert (held by one expert-parallel rank)."""
    return _EXPERTS in name


def row_note(cfg: Any, ep: int) -> str:
    """The report's line on megatron-core's MoE rows of model ``cfg`` at ``ep``."""
    return (f"megatron-core MoE ('mcore:' rows): local spec, SequentialMLP experts (its GroupedMLP needs the grouped_gemm "
            f"package, TEGroupedMLP Transformer Engine), alltoall dispatcher, dropless, ep={ep}, top-{cfg.experts_per_token} "
            f"of {cfg.experts}, load-balancing loss {'on (megatron-core formula)' if aux_loss_on(cfg) else 'off'}")


# -- modes ---------------------------------------------------------------------------------
# megatron-core's own config checks say as much for its layer-scoped graphs ("moe cuda graph is only supported with
# drop-padding MoE"; "not supported when there are DtoH copies and synchronizations in the preprocess step").
GRAPH_REFUSAL = ("megatron-core's full-iteration CUDA graph cannot hold its dropless alltoall MoE dispatcher: every MoE "
                 "layer copies its per-expert token counts to the host and waits for them (the all-to-all's split sizes), "
                 "which a capture may not do and a replay would not redo (megatron-core graphs MoE only drop-and-pad)")


def mode_refusal(mode: Any, cfg: Any, *, ep: int, dtype: torch.dtype, pp: int) -> str | None:
    """Why megatron-core mode ``mode`` (:class:`braid.baselines.modes.McoreMode`) cannot run model ``cfg`` at this
    ``ep`` and ``dtype``, in one line, or None."""
    if not is_moe(cfg):
        if mode.a2a_overlap:
            return "a2a_overlap overlaps a mixture of experts' expert-parallel all-to-alls; this model has no experts"
        return None
    if mode.graphed:
        return GRAPH_REFUSAL
    if mode.spec == "te":
        return "te: the expert weights under megatron-core's Transformer Engine MoE spec are not mapped here; run local"
    if mode.a2a_overlap:
        if ep < 2:
            return "a2a_overlap needs expert parallelism (ep > 1): it hides the all-to-alls between ep ranks"
        if dtype not in (torch.bfloat16, torch.float16):
            return f"a2a_overlap runs a bf16 or fp16 model only (megatron-core's check); this job runs {dtype}"
    return None
