"""megatron-core's interleaved 1F1B on the same model, weights, data and layout as braid's schedules.

Megatron-LM's interleaved 1F1B is the schedule the paper measures against. Each rank builds
its virtual stages as megatron-core ``GPTModel`` chunks (:func:`braid.baselines.megatron_gpt.gpt_model`:
the local layer spec, braid's decoder shapes) holding the single-device model's weights
(:func:`braid.baselines.megatron_gpt.to_mcore`), and runs ``get_forward_backward_func()`` over them.
Tensor parallelism is megatron-core's own (its all-reduces inside autograd, exposed); at
``pp == 1`` megatron-core runs its no-pipelining schedule (gradient accumulation over the
micro-batches), as Megatron-LM does. Losses are mean token cross-entropies per micro-batch,
gradients scaled by ``1/m`` (megatron-core divides each micro-batch loss by ``m``), as
braid's executor does.

Modes (:class:`braid.baselines.modes.McoreMode`): ``eager``; ``graphed`` -- the whole
forward-backward of an iteration captured once in a CUDA graph and replayed
(``megatron.core.full_cuda_graph.FullCudaGraphWrapper``, as Megatron-LM's
``--cuda-graph-impl local --cuda-graph-scope full_iteration``: one eager warm-up iteration,
the capture on the second, static input buffers per micro-batch, graph-safe RNG states);
``te`` -- megatron-core's Transformer Engine layer spec instead of the local one.

A mixture of experts (a Qwen3-MoE config, :mod:`braid.baselines.megatron_moe`) builds megatron-core's
MoE layers (local spec, ``SequentialMLP`` experts, alltoall dispatcher, dropless) with ``ep``
expert-parallel ranks carved from the data-parallel ones (dp a multiple of ep; tp = 1); each
rank steps its own data-parallel replica's micro-batches (its index: :attr:`McorePipeline.dp_rank`,
megatron-core's). Its modes: eager, or ``a2a_overlap`` (megatron-core's EP all-to-all overlap,
``overlap_moe_expert_parallel_comm``: the forward step hands megatron-core a schedule plan,
``GPTModel.build_schedule_plan``, instead of running the model); graphed is refused
(:data:`braid.baselines.megatron_moe.GRAPH_REFUSAL`). :meth:`McorePipeline.reduce_gradients`
averages gradients over the replicas as braid's :func:`~braid.runtime.expert_parallel.reduce_gradients_ep`
does (a training loop calls it; a timed step is the forward-backward alone, as braid's).

Name: ``mcore_1f1b_i`` (:data:`MCORE_SCHEDULES`), beside :data:`braid.baselines.torch_pp.TORCH_SCHEDULES`.
"""

from __future__ import annotations

import datetime
from typing import Any, Sequence

import torch
from torch import nn

from braid.baselines import megatron_gpt as bm
from braid.baselines import megatron_moe as mm
from braid.core.ir import stage_of
from braid.core.partition import layer_offset
from braid.baselines.modes import McoreMode, check_baseline_layout

MCORE_SCHEDULES: dict[str, str] = {"mcore_1f1b_i": "megatron-core interleaved 1F1B"}
IGNORE_INDEX = -100


class McorePipeline:
    """megatron-core's interleaved 1F1B over this rank's virtual stages of ``lm`` (same interface as
    :class:`braid.baselines.torch_pp.TorchPipeline`: ``modules``, :meth:`parameters`, :meth:`optimizer`, :meth:`step`).

    ``layers_per_stage``: decoder layers of each virtual stage (``2 * pp`` stages, equal
    counts: megatron-core splits layers evenly); ``groups``: this rank's
    :class:`~braid.runtime.distributed.ProcessGroups` (only its topology is read; megatron-core
    creates its own groups); ``mode``: eager or graphed, local or Transformer Engine layers, EP
    overlap (:class:`braid.baselines.modes.McoreMode`); ``ep``: a mixture of experts' expert-parallel
    ranks (default: every data-parallel rank). Collective: every rank of the job constructs it.
    """

    def __init__(self, name: str, lm: nn.Module, layers_per_stage: Sequence[int], m: int, *, groups: Any,
                 device: torch.device, dtype: torch.dtype, seq_len: int | None = None, timeout_s: float = 120.0,
                 mode: McoreMode | None = None, ep: int | None = None) -> None:
        mode = mode or McoreMode()
        if name not in MCORE_SCHEDULES:
            raise ValueError(f"unknown megatron-core baseline {name!r}; valid: {', '.join(MCORE_SCHEDULES)}")
        cfg = lm.cfg
        topo = groups.topo
        moe = mm.is_moe(cfg)
        ep = (ep or topo.dp) if moe else 1
        why = mode.unavailable(device.type) or mm.mode_refusal(mode, cfg, ep=ep, dtype=dtype, pp=topo.pp)
        if why:
            raise RuntimeError(why)
        bm.require()
        bm.allow_cpu()
        bm.check_config(cfg)
        pp, n_stages = check_baseline_layout(name, topo, layers_per_stage, ep=ep)
        if moe:
            mm.check_layout(cfg, tp=topo.tp, ep=ep, dp=topo.dp)
        if len(set(layers_per_stage)) != 1:
            raise ValueError(f"{name}: megatron-core splits layers evenly over stages; got {list(layers_per_stage)}")
        if sum(layers_per_stage) != cfg.layers:
            raise ValueError(f"{name}: {sum(layers_per_stage)} layers in the stages, the model has {cfg.layers}")
        vp = 2 if pp > 1 else None
        bm.ensure_parallel_state(topo.tp, pp, vp, timeout_s, ep=ep)
        from megatron.core import parallel_state as ps

        if device.type == "cuda":
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

            # A graph replays the RNG states it registered: they must be graph-safe generators.
            model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=mode.graphed, force_reset_rng=True)
        self.name, self.m, self.tp, self.pp, self.ep, self.mode = name, m, topo.tp, pp, ep, mode
        self.seq_len = seq_len
        extra = mm.moe_fields(cfg, ep=ep, a2a_overlap=mode.a2a_overlap) if moe else None
        tconf = bm.transformer_config(cfg, tp=topo.tp, pp=pp, vp=vp, dtype=dtype, device=device, graphed=mode.graphed,
                                      extra=extra)
        full = {k: v.detach() for k, v in lm.state_dict().items()}
        if moe:
            state = mm.ep_shard(mm.to_mcore(full, cfg), ps.get_expert_model_parallel_rank(), ep, cfg.experts)
        else:
            state = bm.tp_shard(bm.to_mcore(full, cfg), groups.coords.tp, topo.tp)
        if mode.spec == "te":
            state = bm.te_state(state)
        pp_rank = ps.get_pipeline_model_parallel_rank()  # braid's when dp = 1; megatron-core's grid otherwise
        self.dp_rank, self.dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.modules: list[nn.Module] = []
        # pp == 1: one model of all layers (megatron-core's no-pipelining schedule); else 2 chunks, looped placement.
        chunks = [(0, cfg.layers, True, True, None)] if pp == 1 else [
            (layer_offset(layers_per_stage, s), layers_per_stage[s], s == 0, s == n_stages - 1, c)
            for c, s in ((c, stage_of("loop", pp, pp_rank, c)) for c in range(2))
        ]
        for first, n, embed, head, vp_stage in chunks:
            if moe:
                mod = mm.gpt_model(cfg, tconf, seq_len=seq_len or 4096, pre_process=embed, post_process=head,
                                   vp_stage=vp_stage, pp_rank=pp_rank if pp > 1 else None)
            else:
                mod = bm.gpt_model(cfg, tconf, seq_len=seq_len or 4096, pre_process=embed, post_process=head,
                                   vp_stage=vp_stage, spec=mode.spec)
            own = bm.chunk_state(state, first, n, embed=embed, head=head)
            missing, unexpected = mod.load_state_dict({k: v.to(dtype) for k, v in own.items()}, strict=False)
            missing = [k for k in missing if not k.endswith("._extra_state")]  # TE modules' FP8 metadata, none here
            if missing or unexpected:
                raise RuntimeError(f"{name} [{mode.label}]: weights do not fit the model: missing {missing[:3]}, "
                                   f"unexpected {unexpected[:3]}")
            self.modules.append(mod.to(device=device, dtype=dtype))
        self.is_last = pp == 1 or ps.is_pipeline_last_stage(ignore_virtual=True)
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._pos: torch.Tensor | None = None  # the position ids every micro-batch uses (static: a graph reads them)
        self._forward_backward = self._graphed_forward_backward() if mode.graphed else None

    def _graphed_forward_backward(self) -> Any:
        """megatron-core's forward-backward function wrapped in its full-iteration CUDA graph.

        ``FullCudaGraphWrapper`` keeps its graph, iteration count and static input buffers in
        class attributes (one graphed model per process, as in Megatron-LM); a fresh pipeline
        starts them afresh (:func:`reset_full_cuda_graph`).
        """
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper
        from megatron.core.pipeline_parallel import get_forward_backward_func

        reset_full_cuda_graph()
        return FullCudaGraphWrapper(get_forward_backward_func(), cuda_graph_warmup_steps=1)

    def close(self) -> None:
        """Release the captured graph and its memory pool (graphed mode)."""
        if self._forward_backward is not None:
            reset_full_cuda_graph()
            self._forward_backward = None

    def parameters(self) -> list[nn.Parameter]:
        return [p for mod in self.modules for p in mod.parameters()]

    def optimizer(self, lr: float, **kwargs: Any) -> torch.optim.AdamW:
        """AdamW over this rank's parameters (megatron-core's TP shards are plain tensors)."""
        return torch.optim.AdamW(self.parameters(), lr=lr, foreach=self.device.type == "cuda", **kwargs)

    def step(self, inputs: Sequence[torch.Tensor], labels: torch.Tensor) -> float | None:
        """One forward + backward of all ``m`` micro-batches (``inputs[0]``: token ids, batched along dim 0).

        Returns the mean micro-batch loss on the ranks holding the last stage, None elsewhere.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if len(inputs) != 1:
            raise ValueError(f"{self.name} runs decoder LMs on token ids only (got {len(inputs)} inputs)")
        tokens, labels = inputs[0].to(self.device), labels.to(self.device)
        if tokens.shape[0] % self.m:
            raise ValueError(f"batch of {tokens.shape[0]} samples is not {self.m} equal micro-batches")
        micro = [{"tokens": t, "labels": y} for t, y in zip(tokens.chunk(self.m), labels.chunk(self.m))]
        b, s = micro[0]["tokens"].shape
        if self._pos is None or self._pos.shape != (b, s):
            self._pos = torch.arange(s, device=self.device).expand(b, s)
        pos = self._pos

        def forward_step(data_iterator: Any, model: nn.Module, return_schedule_plan: bool = False) -> tuple[Any, Any]:
            batch = next(data_iterator)  # a dict: the graphed mode copies it into its static buffers
            tok, lab = batch["tokens"], batch["labels"]
            keep = lab != IGNORE_INDEX
            # EP overlap (combined 1F1B): megatron-core runs the model from its schedule plan, layer by layer
            run = model.build_schedule_plan if return_schedule_plan else model
            out = run(tok, pos, None, labels=torch.where(keep, lab, torch.zeros_like(lab)))

            def loss_fn(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
                mask = keep.to(per_token.dtype)
                loss = (per_token.float() * mask).sum() / mask.sum().clamp(min=1)
                return loss, {"loss": loss.detach().clone()}  # the schedule divides ``loss`` by m in place

            return out, loss_fn

        iters: Any = [iter(micro) for _ in self.modules] if len(self.modules) > 1 else iter(micro)
        model: Any = self.modules if len(self.modules) > 1 else self.modules[0]
        forward_backward = self._forward_backward or get_forward_backward_func()
        losses = forward_backward(
            forward_step_func=forward_step, data_iterator=iters, model=model, num_microbatches=self.m,
            seq_length=s, micro_batch_size=b, forward_only=False,
        )
        if not self.is_last:
            return None
        return sum(float(x["loss"]) for x in losses) / len(losses)

    def reduce_gradients(self) -> None:
        """Average the gradients over the ``dp`` data-parallel replicas (collective; nothing at dp = 1):
        a dense parameter's over its data-parallel group; an expert's -- already summed over its
        expert-parallel group by the all-to-all's backward -- summed over its expert-data-parallel
        group and divided by ``dp`` (as :func:`braid.runtime.expert_parallel.reduce_gradients_ep`)."""
        if self.dp == 1:
            return
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        edp = ps.get_expert_data_parallel_group() if self.ep > 1 else None
        for mod in self.modules:
            for name, p in mod.named_parameters():
                if p.grad is None:
                    continue
                p.grad.div_(self.dp)
                if not mm.is_expert_param(name):
                    dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
                elif edp is not None and dist.get_world_size(edp) > 1:
                    dist.all_reduce(p.grad, group=edp)


def reset_full_cuda_graph() -> None:
    """Drop megatron-core's full-iteration CUDA graph state (class attributes of ``FullCudaGraphWrapper``
    and its ``StaticBufferLoader``): the next wrapper warms up, captures and allocates afresh."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader

    FullCudaGraphWrapper.curr_iteration = {"training": 0, "validation": 0}
    FullCudaGraphWrapper.cuda_graph = {"training": None, "validation": None}
    FullCudaGraphWrapper.result = {"training": None, "validation": None}
    StaticBufferLoader.static_buffers = {"training": [], "validation": []}
