"""External baselines: ``torch.distributed.pipelining``'s schedules on the same model split.

The comparison the benchmarks and the examples make is braid's schedules against what a
user runs today: ``ScheduleInterleaved1F1B``, ``ScheduleZBVZeroBubble`` and
``ScheduleDualPipeV``, on the same decoder layers per virtual stage, the same weights and
the same data. Each rank wraps its virtual stages as plain modules (:class:`StageModule`:
optional vision tower and embedding, a slice of decoder layers, optional norm + LM head)
and hands them to ``PipelineStage``.

Tensor parallelism for the baselines is torch's own (DTensor). In the ``eager`` mode
(:class:`braid.baselines.modes.TorchMode`): Q/K/V and gate/up column-parallel, out- and
down-projections row-parallel, the embedding row-parallel over the vocabulary, the LM head
column-parallel with a vocabulary-parallel cross-entropy (``loss_parallel``); the
all-reduces run where DTensor puts them, exposed -- which is what braided execution hides;
norms and the ViT's patch embedding/merger are replicated. The ``titan`` mode shards as
torchtitan does (sequence parallelism, :mod:`braid.baselines.titan`), ``compile`` compiles
every decoder layer and ``async_tp`` adds Inductor's micro-pipelined TP. Gradients are scaled by ``1/m`` (``scale_grads``), as braid's executor does, so
losses and gradients are comparable with the single-device model.

Names: ``torch_1f1b_i``, ``torch_zb_v``, ``torch_dualpipe_v`` (:data:`TORCH_SCHEDULES`), and
megatron-core's interleaved 1F1B, ``mcore_1f1b_i`` (:mod:`braid.baselines.mcore`, optional
extra ``megatron``); :func:`baseline_pipeline` builds either.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from braid.baselines.mcore import MCORE_SCHEDULES
from braid.core.ir import stage_of
from braid.core.partition import layer_offset
from braid.baselines import titan
from braid.baselines.modes import McoreMode, PeerMode, TorchMode, check_baseline_layout

TORCH_SCHEDULES: dict[str, str] = {
    "torch_1f1b_i": "ScheduleInterleaved1F1B",
    "torch_zb_v": "ScheduleZBVZeroBubble",
    "torch_dualpipe_v": "ScheduleDualPipeV",
}
BASELINES: dict[str, str] = {**TORCH_SCHEDULES, **MCORE_SCHEDULES}  # every external schedule name -> what it is
IGNORE_INDEX = -100


def baseline_label(name: str) -> str:
    """How reports name a baseline: ``torch:ScheduleInterleaved1F1B``, ``mcore:interleaved 1F1B``."""
    return f"torch:{TORCH_SCHEDULES[name]}" if name in TORCH_SCHEDULES else f"mcore:{BASELINES[name].removeprefix('megatron-core ')}"


def available_baselines() -> list[str]:
    """The baseline names that can run here: torch's, and megatron-core's when it is installed."""
    from braid.baselines import megatron_gpt as megatron

    return list(TORCH_SCHEDULES) + (list(MCORE_SCHEDULES) if megatron.available() else [])


def baseline_pipeline(name: str, lm: nn.Module, layers_per_stage: Sequence[int], m: int, *, groups: Any,
                      device: torch.device, dtype: torch.dtype, vision: nn.Module | None = None,
                      seq_len: int | None = None, timeout_s: float = 120.0, mode: PeerMode | None = None,
                      comm: BaselineGroups | None = None, ep: int | None = None) -> Any:
    """The baseline ``name`` over this rank's stages (:class:`TorchPipeline` or
    :class:`braid.baselines.mcore.McorePipeline`; both have ``modules``, ``parameters()``,
    ``optimizer(lr)``, ``step(inputs, labels)`` and ``close()``), in ``mode``
    (:mod:`braid.baselines.modes`; default eager); ``comm``: the torch baselines' groups, shared
    by the baselines of a job (:class:`BaselineGroups`); ``ep``: a mixture of experts' expert-parallel ranks
    (megatron-core's; default every data-parallel rank). Collective."""
    if name in MCORE_SCHEDULES:
        from braid.baselines.mcore import McorePipeline

        if vision is not None:
            raise ValueError(f"{name} runs decoder LMs only (megatron-core's GPT model); use a torch_* baseline for a VLM")
        if mode is not None and not isinstance(mode, McoreMode):
            raise ValueError(f"{name} takes a megatron-core mode, got {mode}")
        return McorePipeline(name, lm, layers_per_stage, m, groups=groups, device=device, dtype=dtype, seq_len=seq_len,
                             timeout_s=timeout_s, mode=mode or McoreMode(), ep=ep)
    if mode is not None and not isinstance(mode, TorchMode):
        raise ValueError(f"{name} takes a torch mode, got {mode}")
    return TorchPipeline(name, lm, layers_per_stage, m, groups=groups, device=device, dtype=dtype, vision=vision,
                         timeout_s=timeout_s, mode=mode or TorchMode(), comm=comm)


def placement_of(cls_name: str) -> str:
    """Stage placement of a torch schedule: looped for interleaved 1F1B, V for ZB-V and DualPipeV."""
    return "loop" if cls_name == "ScheduleInterleaved1F1B" else "v"


class StageModule(nn.Module):
    """One virtual stage of a Qwen2(-VL) model as a plain module, copied from the single-device model.

    ``lm``: the :class:`~braid.models.qwen2.Qwen2Model`; ``first``/``n``: its decoder layers;
    ``embed``/``head``: whether the stage starts with the token embedding / ends with norm +
    LM head; ``vision``: the VLM's vision tower for the first stage (inputs are then
    ``(images, input_ids)``, the visual tokens written over the image-pad tokens). A VLM's
    LM layers rotate by ``positions`` (M-RoPE, ``(3, 1, s)``: the same for every sample),
    which :class:`TorchPipeline` sets before each step.
    """

    def __init__(self, lm: nn.Module, first: int, n: int, embed: bool, head: bool, vision: nn.Module | None = None) -> None:
        super().__init__()
        self.visual = copy.deepcopy(vision) if vision is not None else None
        self.embed = copy.deepcopy(lm.embed_tokens) if embed else None
        self.layers = nn.ModuleList(copy.deepcopy(lm.layers[i]) for i in range(first, first + n))
        self.norm = copy.deepcopy(lm.norm) if head else None
        self.head = copy.deepcopy(lm.lm_head) if head else None
        self.positions: torch.Tensor | None = None

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self.visual is not None:
            from braid.models.qwen2_vl import scatter_visual, split_item

            cfg = self.visual.vl_cfg
            images, tokens = inputs
            pixel_values, _, grid = split_item(cfg, (images, tokens))
            x = self.embed(tokens)
            x = scatter_visual(x, tokens, self.visual(pixel_values, grid).to(x.dtype), cfg.image_token_id)
        elif self.embed is not None:
            x = self.embed(inputs[0])
        else:
            x = inputs[0]
        for layer in self.layers:
            if self.positions is None:
                x = layer(x)
            else:
                x = layer.attn_core(*layer.qkv(layer.norm1(x), self.positions)) + x
                x = layer.mlp_core(*layer.gate_up(layer.norm2(x))) + x
        if self.head is not None:
            x = self.head(self.norm(x))
            x = x.to(torch.promote_types(x.dtype, torch.float32))
        return x


def tensor_parallel(stage: StageModule, mesh: Any) -> StageModule:
    """Shard ``stage`` in place over the 1-D device ``mesh`` with DTensor (see the module doc)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    t = mesh.size()
    col, row = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1"), ("o_proj", "down_proj", "fc2")
    blocks = list(stage.layers) + (list(stage.visual.blocks) if stage.visual is not None else [])
    for layer in blocks:
        titan.check_shards(layer, t)
        layer.heads, layer.kv_heads = layer.heads // t, layer.kv_heads // t  # the views use the local head counts
        plan = {n: ColwiseParallel() for n in col if hasattr(layer, n)}
        plan.update({n: RowwiseParallel() for n in row if hasattr(layer, n)})
        parallelize_module(layer, mesh, plan)
    if stage.embed is not None:
        parallelize_module(stage.embed, mesh, RowwiseParallel(input_layouts=Replicate()))
    if stage.head is not None:
        parallelize_module(stage.head, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    return stage


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of a micro-batch (ignoring ``IGNORE_INDEX``), as the executor's head computes it."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX)


@dataclass(frozen=True, slots=True)
class BaselineGroups:
    """The torch baselines' own process groups on this rank: its pipeline group, its TP group and
    the TP device mesh (None at tp=1).

    Their own (collective: every rank creates every group, same order): the schedule's P2P
    must not share a communicator with the executor's, and the TP collectives get NCCL's
    default channels (braid caps its own TP group's, see ``ProcessGroups.create``). One set
    serves every baseline of a job: a compiled layer's guards hold its DTensors' mesh, so
    pipelines built on the same mesh reuse one compilation.
    """

    pp: Any
    tp: Any
    mesh: Any

    @classmethod
    def create(cls, groups: Any, device: torch.device, timeout_s: float = 120.0) -> "BaselineGroups":
        topo = groups.topo
        timeout = datetime.timedelta(seconds=timeout_s)
        mine = {}
        for dim in ("pp", "tp") if topo.tp > 1 else ("pp",):
            for ranks in topo.groups(dim):
                g = dist.new_group(ranks, timeout=timeout)
                if groups.rank in ranks:
                    mine[dim] = g
        mesh = None
        if topo.tp > 1:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(mine["tp"], device.type)
        return cls(mine["pp"], mine.get("tp"), mesh)


class TorchPipeline:
    """A ``torch.distributed.pipelining`` schedule over this rank's stages of ``lm``.

    ``layers_per_stage``: LM decoder layers of each of the ``2 * pp`` virtual stages (the
    VLM's stage 0 holds the vision tower and no LM layers); ``groups``: this rank's
    :class:`~braid.runtime.distributed.ProcessGroups` (the layout; tp > 1 runs DTensor
    tensor parallelism). ``mode``: eager DTensor TP, or torchtitan's TP, per-layer compile and
    async TP (:class:`braid.baselines.modes.TorchMode`, :mod:`braid.baselines.titan`); ``comm``: the
    baselines' process groups (:class:`BaselineGroups`; made here when not given). Collective:
    every rank of the job constructs it.
    """

    def __init__(self, name: str, lm: nn.Module, layers_per_stage: Sequence[int], m: int, *, groups: Any,
                 device: torch.device, dtype: torch.dtype, vision: nn.Module | None = None, timeout_s: float = 120.0,
                 mode: TorchMode | None = None, comm: BaselineGroups | None = None) -> None:
        import torch.distributed.pipelining as pipe

        mode = mode or TorchMode()
        if name not in TORCH_SCHEDULES:
            raise ValueError(f"unknown baseline {name!r}; valid: {', '.join(TORCH_SCHEDULES)}")
        cls_name = TORCH_SCHEDULES[name]
        cls = getattr(pipe, cls_name, None)
        if cls is None:
            raise RuntimeError(f"torch {torch.__version__} has no torch.distributed.pipelining.{cls_name}; use torch >= 2.8")
        if getattr(getattr(lm, "cfg", None), "tie_embeddings", False):
            raise ValueError(f"{name}: the torch baselines do not sum a tied embedding's gradients across stages; "
                             "use an untied model or braid's schedules")
        topo = groups.topo
        pp, n_stages = check_baseline_layout(name, topo, layers_per_stage)
        if cls_name == "ScheduleDualPipeV" and m < n_stages:
            raise ValueError(f"{name} needs at least as many micro-batches as stages: m={m} < {n_stages}; use m >= {n_stages}")
        why = mode.unavailable(device.type, topo.tp)
        if why:
            raise RuntimeError(why)
        if mode.tp == "titan" and vision is not None:
            raise ValueError(f"{name} [{mode.label}]: titan TP runs decoder LMs; use the eager mode for a VLM")
        self.name, self.n_stages, self.m, self.tp, self.mode = name, n_stages, m, topo.tp, mode
        self.vl_cfg = getattr(vision, "vl_cfg", None)  # a VLM: M-RoPE positions come from its input_ids
        comm = comm or BaselineGroups.create(groups, device, timeout_s)
        self.group, mesh = comm.pp, comm.mesh
        if mode.async_tp:
            titan.enable_symmetric_memory(comm.tp)
        pp_rank = groups.coords.pp
        placement = placement_of(cls_name)
        self.stages, self.modules = [], []
        for c in range(2):
            s = stage_of(placement, pp, pp_rank, c)
            mod = StageModule(lm, layer_offset(layers_per_stage, s), layers_per_stage[s], s == 0, s == n_stages - 1,
                              vision if s == 0 else None).to(device=device, dtype=dtype)
            if mesh is not None:
                (titan.titan_tensor_parallel if mode.tp == "titan" else tensor_parallel)(mod, mesh)
            if mode.compile:
                titan.compile_layers(mod, mode.backend)
            self.modules.append(mod)
            self.stages.append(pipe.PipelineStage(mod, s, n_stages, device, group=self.group))
        self.has_first = any(st.stage_index == 0 for st in self.stages)
        self.has_last = any(st.stage_index == n_stages - 1 for st in self.stages)
        self.schedule = cls(self.stages, n_microbatches=m, loss_fn=cross_entropy)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for mod in self.modules for p in mod.parameters()]

    def close(self) -> None:
        """Nothing to release (the interface :class:`braid.baselines.mcore.McorePipeline` shares)."""

    def optimizer(self, lr: float, **kwargs: Any) -> torch.optim.AdamW:
        """AdamW over this rank's parameters, with the multi-tensor (``foreach``) kernels.

        With tp > 1 the sharded weights are DTensors and the norms plain tensors; the
        ``foreach`` kernels refuse a list mixing the two ("got mixed torch.Tensor and
        DTensor"), and ``foreach`` is the default on CUDA. Each kind gets its own parameter
        group (same hyper-parameters), so one step runs one kernel list per kind.
        """
        from torch.distributed.tensor import DTensor

        params = self.parameters()
        groups = [{"params": g} for g in ([p for p in params if isinstance(p, DTensor)],
                                          [p for p in params if not isinstance(p, DTensor)]) if g]
        return torch.optim.AdamW(groups, lr=lr, foreach=True, **kwargs)

    def step(self, inputs: Sequence[torch.Tensor], labels: torch.Tensor) -> float | None:
        """One forward + backward of all ``m`` micro-batches (``inputs``/``labels`` batched along dim 0).

        Returns the mean micro-batch loss on the rank holding the last stage (TP rank 0 of it
        reports it; the other TP ranks compute the same value), None elsewhere.
        """
        from torch.distributed.tensor.parallel import loss_parallel

        losses: list[torch.Tensor] = []
        if self.vl_cfg is not None:
            self._set_positions(inputs)
        if self.mode.tp == "titan":
            titan.check_sequence(inputs[0].shape[1], self.tp)
        args = tuple(inputs) if self.has_first else ()
        settings = titan.compile_settings(self.mode.async_tp, self.mode.compile)
        with loss_parallel() if self.tp > 1 else contextlib.nullcontext(), settings:
            if self.has_last:
                self.schedule.step(*args, target=labels, losses=losses)
            else:
                self.schedule.step(*args)
        if not self.has_last:
            return None
        total = sum(float((x.full_tensor() if hasattr(x, "full_tensor") else x).detach()) for x in losses)
        return total / len(losses)

    def _set_positions(self, inputs: Sequence[torch.Tensor]) -> None:
        """M-RoPE positions of a VLM batch, handed to every stage; only hidden states travel between
        torch's stages, so every sample must have the same token layout."""
        from braid.models.qwen2_vl import rope_index, split_item

        _, ids, grid = split_item(self.vl_cfg, tuple(inputs), pixels=False)
        pos = rope_index(self.vl_cfg, ids, grid)
        if not bool((pos == pos[:, :1]).all()):
            raise ValueError("the torch baselines need the same image and text layout in every sample of a VLM batch "
                             "(their stages pass hidden states only, not M-RoPE positions)")
        for mod in self.modules:
            mod.positions = pos[:, :1]
