"""A model chunk (one virtual stage) run unit by unit: forward, activation-backward, weight-backward.

The executor drives a chunk through the unit tasks of :mod:`braid.core.braiding`. Each unit's
forward runs on detached inputs under autograd and keeps its *pieces* (inputs, outputs)
until the unit's backward; TP all-reduces are not part of the graph -- a unit returns
the tensor to reduce and the executor reduces it in place, asynchronously.

Backward cuts (paper Sec. 3, Fig. 3): Pre-Attn / Pre-MLP / head end with the all-reduce
of the column-parallel input gradient (operator f). The RMSNorm backward and the +1
residual gradient then run at the *start* of the next backward unit (``_finish``), so
the all-reduce is the last thing its unit does. Weight gradients of the TP linears are
always split off (:func:`braid.tp.split_weight_grads`); a ``W`` task (or the W half of a
``BW``) computes and accumulates them. RMSNorm weights get their gradient during B.

Saved activations are captured with ``saved_tensors_hooks`` into one box per
(micro-batch, unit), so they can be counted (the memory series of the trace) and moved
to host memory by ``Offload``/``Reload`` instructions (paper Sec. 4.4). The boxes are the
*only* holders of a finished forward's activations: a piece keeps its inputs and outputs
as autograd :class:`~torch.autograd.graph.GradientEdge` handles, not tensors, and a
piece's input enters the graph through :class:`_Entry` (an identity whose backward node
holds no tensor) instead of a leaf (whose ``AccumulateGrad`` node would hold the leaf's
data until backward). So moving a box's tensors to the host really frees their device
memory, for any fraction of a micro-batch's saved bytes.

Fused mode and joint micro-batches: :class:`braid.models.fused.FusedOps`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from braid.core.braiding import ChunkSpec, Phase, Unit, UnitTask
from braid.core.ir import OpKind
from braid.models.chunk_parts import (
    IGNORE_INDEX,
    ChunkStateError,
    _Backward,
    _Box,
    _Entry,
    _FusedOp,
    _masked_mean,
    _Piece,
)
from braid.models import full_recompute
from braid.models.fused import FusedOps
from braid.models.moe_dispatch import Exchange
from braid.models.moe_ops import MoeOps
from braid.models.qwen2 import EAGER, RopeCache, UnitFns
from braid.models.seam import UnitLayer
from braid.models.sequence_parallel import SequenceParallel, target_count
from braid.runtime.offload import ActivationOffloader, Parked
from braid.tp.autograd_calls import edge, fast_apply, grad
from braid.tp.embedding import VocabParallelEmbedding
from braid.models.seq_shard_ops import SeqShardOps
from braid.tp.seq_shard import Scatter
from braid.tp.layers import (
    ColumnParallelGroup,
    ColumnParallelLinear,
    DeferredWeightGrad,
    NativeMode,
    split_weight_grads,
)

_enter_apply = fast_apply(_Entry)


class ModelChunk(FusedOps, SeqShardOps, MoeOps, nn.Module):
    """Layers ``[first, first+len(layers))`` of a model, plus the embedding and/or head.

    ``tp_group`` is used only inside the loss (vocab-parallel max/sum-exp); the unit
    boundary all-reduces belong to the executor. ``num_microbatches`` scales each
    micro-batch's loss by ``1/m`` so gradients equal a full-batch mean. With a
    sequence-parallel context ``sp`` the chunk holds the rank's zigzag share of every
    sequence (:mod:`braid.models.sequence_parallel`), and a micro-batch's loss is its
    local tokens' loss sum over the micro-batch's *global* number of target tokens.

    ``seq_shard`` (tp > 1): Megatron's sequence parallelism inside TP (:mod:`braid.tp.seq_shard`,
    :mod:`braid.models.seq_shard_ops`): reduce-scatters where the all-reduces were, norms and
    residual on the rank's ``s/t`` tokens, the column-parallel linears fed by all-gathers.
    """

    fns: UnitFns = EAGER  # the head's loss function (eager or compiled, see braid.runtime.compiled)

    def __init__(
        self,
        spec: ChunkSpec,
        layers: Sequence[UnitLayer],
        embed: VocabParallelEmbedding | None,
        norm: nn.Module | None,
        lm_head: ColumnParallelLinear | None,
        *,
        num_microbatches: int,
        tp_group: dist.ProcessGroup | None = None,
        vocab_start: int = 0,
        sp: SequenceParallel | None = None,
        fuse: bool | None = None,
        seq_shard: bool = False,
    ) -> None:
        super().__init__()
        if len(layers) != spec.modules or (embed is not None) != spec.embed or (lm_head is not None) != spec.head:
            raise ValueError(f"chunk modules do not match {spec}")
        self.spec = spec
        self.layers = nn.ModuleList(layers)
        self._layer_seq = tuple(self.layers)  # indexed per unit task (ModuleList indexing builds a string key)
        self.embed, self.norm, self.lm_head = embed, norm, lm_head
        self.m = num_microbatches
        self.tp_group = tp_group
        self.vocab_start = vocab_start
        self.sp = sp
        self._init_seq_shard(seq_shard)
        self._init_moe()
        self.tokens: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []  # SP: target tokens of each full micro-batch (loss normaliser)
        self.positions: torch.Tensor | None = None  # SP: RoPE positions of the local tokens (None: 0..s-1)
        self.losses: dict[int, torch.Tensor] = {}
        self._inputs: dict[int, torch.Tensor] = {}
        self._fwd: dict[int, tuple[torch.Tensor, ...]] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._grad_out: dict[int, torch.Tensor] = {}
        self._grad_in: dict[int, torch.Tensor] = {}
        self._bwd: dict[int, _Backward] = {}
        self._saved: dict[tuple, list[_Piece]] = {}
        self._boxes: dict[tuple, _Box] = {}
        self._offloader: ActivationOffloader | None = None
        # Per-unit lookups, computed once: parameter data pointers (reset when the
        # parameters may have moved: .to(), set_batch), weight-gradient modules per unit.
        self._ptrs: frozenset[int] | None = None
        # the layers' RoPE tables: persistent as parameters are, so never counted as saved activations
        self._rope_caches = [m.rope_cache for m in self.modules() if isinstance(getattr(m, "rope_cache", None), RopeCache)]
        self._unit_mods: dict[tuple[Unit, int], tuple[DeferredWeightGrad, ...]] = {}
        self._all_mods: list[DeferredWeightGrad] | None = None
        self._anchors: dict[torch.device, torch.Tensor] = {}
        # Fused mode (see choose_fused): ``fuse`` None lets the executor choose, False forces
        # the unit cuts, True asks for fused mode (an error where it cannot run).
        self.fuse = fuse
        self.fused = False
        self._ops: dict[int, _FusedOp] = {}
        # Fused mode: micro-batches whose backward op also computes the weight gradients
        # (set_joint), the shared native switch of the deferred modules, those whose joint
        # backward ran (their W tasks have nothing left to do), and whether the fused forward
        # fills the saved-tensor boxes (memory accounting of a recorded step).
        self.joint: frozenset[int] = frozenset()
        self._native = NativeMode()
        self._joint_done: set[int] = set()
        self.track_saved = True
        self._op_tasks: dict[OpKind, tuple[tuple[Unit, int], ...]] = {}
        self._op_mods: tuple[DeferredWeightGrad, ...] | None = None
        self.full_recompute = False  # set_recompute("full"): braid.models.full_recompute
        self._rerunning = False

    def global_name(self, local: str, *, vlm: bool = False) -> str:
        """The single-device model's name of parameter ``local`` of this chunk: ``layers.{first_layer + i}.*``,
        ``embed_tokens``, ``norm``, ``lm_head``; under ``lm.`` in a vision-language model
        (:mod:`braid.models.global_names`)."""
        head, _, rest = local.partition(".")
        prefix = "lm." if vlm else ""
        if head == "layers":
            i, _, rest = rest.partition(".")
            return f"{prefix}layers.{self.first_layer + int(i)}.{rest}"
        return prefix + {"embed": "embed_tokens"}.get(head, head) + "." + rest

    def cut_reason(self) -> str | None:
        """Why this chunk needs its unit cuts (None: it can run fused).

        The cuts exist for the TP all-reduce at the end of each unit's backward (tp > 1),
        for expert parallelism's all-to-alls (:mod:`braid.models.moe_ops`), for sequence
        parallelism's attention, and for offload (boxes reloaded per unit).
        """
        if self.sp is not None or any(getattr(lay, "sp", None) is not None for lay in self.layers):
            return "sequence parallelism"
        if self.full_recompute:
            return "full recomputation (the layer re-run before its backward)"
        if (self.tp_group is not None and dist.get_world_size(self.tp_group) > 1) or any(
                getattr(lay, "tp", 1) != 1 for lay in self.layers):
            return "tensor parallelism (tp > 1)"
        if self.moe_moves():
            return "expert parallelism (its all-to-alls end units)"
        return None

    def set_recompute(self, mode: str) -> None:
        """Activation recomputation of every layer: ``"none"``, ``"selective"`` (:mod:`braid.models.recompute`)
        or ``"full"`` (:mod:`braid.models.full_recompute`). Call between steps."""
        from braid.models.recompute import check_mode

        check_mode(mode)
        if mode == "full" and (self.spec.half_in or self.spec.half_out):
            raise ValueError("full recomputation re-runs whole layers; this chunk holds half a layer "
                             "(use whole layers per stage, or --recompute selective)")
        if mode == "full" and self.spec.moe:
            raise ValueError("full recomputation does not re-run mixture-of-experts layers (their all-to-alls end units); "
                             "use --recompute selective or none")
        if mode != "none" and self.sp is not None:
            raise ValueError(f"{mode} recomputation does not cover 2D-Attention's sequence-parallel core (--cp > 1); "
                             "use --recompute none there")
        if self._fwd or self._saved or self._ops or self._bwd:
            raise ChunkStateError("recomputation changed with a micro-batch in flight")
        self.full_recompute = mode == "full"
        for lay in self.layers:
            lay.recompute = "none" if mode == "full" else mode
        if self.fused and self.full_recompute:
            self.choose_fused()

    # -- data in and out -----------------------------------------------------------------
    # A chunk class that overrides set_batch says ``graph_safe_batch = True`` where its set_batch reads
    # nothing on the host while a CUDA graph captures the step (host-side facts go in prepare_batch,
    # which the graph runner calls before a capture); braid.runtime.graphs.not_capturable reads it.

    def batch_key(self, tokens: Sequence[Any]) -> Any:
        """The host-side facts of these micro-batches that the step depends on beyond their tensors' values
        (None: nothing; a captured step then replays for any micro-batches of the captured shapes)."""
        return None

    def prepare_batch(self, tokens: Sequence[Any]) -> Any:
        """Do the host-side work for these micro-batches now (outside any capture); returns :meth:`batch_key`."""
        return self.batch_key(tokens)

    def set_batch(self, tokens: Sequence[torch.Tensor], labels: Sequence[torch.Tensor]) -> None:
        """Micro-batches (b, s) of token ids (for the embedding) and labels (for the loss).

        Under sequence parallelism both are cut to this rank's zigzag share here, and the
        loss normaliser is counted on the full labels first.
        """
        if self.sp is not None and tokens:
            self.targets = [target_count(lab) for lab in labels]
            self.positions = self.sp.positions(tokens[0].shape[1], tokens[0].device)
            tokens = [self.sp.shard(t) for t in tokens]
            labels = [self.sp.shard(lab) for lab in labels]
        self.tokens, self.labels = list(tokens), list(labels)
        self.losses.clear()
        self._ptrs = None  # once per step: parameters may have been replaced since the last step

    def set_input(self, mb: int, x: torch.Tensor) -> None:
        self._inputs[mb] = x

    def has_input(self, mb: int) -> bool:
        return self.spec.embed or mb in self._inputs

    def pop_output(self, mb: int) -> torch.Tensor:
        if mb not in self._outputs:
            raise ChunkStateError(f"no forward output of micro-batch {mb} (was its F run, or already sent?)")
        return self._outputs.pop(mb)

    def set_output_grad(self, mb: int, g: torch.Tensor) -> None:
        self._grad_out[mb] = g

    def has_output_grad(self, mb: int) -> bool:
        return self.spec.head or mb in self._grad_out

    def pop_input_grad(self, mb: int) -> torch.Tensor:
        if mb not in self._grad_in:
            raise ChunkStateError(f"no input gradient of micro-batch {mb} (was its B run, or already sent?)")
        return self._grad_in.pop(mb)

    def live_bytes(self) -> int:
        """Bytes of saved activations on the device plus stashed weight-gradient inputs and
        output gradients, each storage once (q/k/v projections stash one shared input)."""
        held: dict[int, int] = {}
        for b in self._boxes.values():
            held.update(b.storages())
        for m in self._deferred_all():
            for items in m._stash.values():
                for t in (t for pair in items for t in pair):
                    st = t.untyped_storage()
                    held[st.data_ptr()] = st.nbytes()
        return sum(held.values())

    def pending_work(self) -> list[str]:
        """What is still held (for end-of-step checks)."""
        out = [f"saved {k}" for k in self._saved] + [f"output mb{k}" for k in self._outputs]
        out += [f"stash {type(m).__name__}" for m in self._deferred_all() if m.stash_bytes()]
        out += [f"fused graph mb{k}" for k in self._ops]
        out += [f"unit head run ahead mb{k}" for k in (*self._ahead_f, *self._ahead_b)]  # seq_shard (follow)
        out += [f"stashed tokens {tuple(rec[0].shape)} not gathered for W" for rec in self._stashed_local.values()]
        out += [f"routing of MoE layer {layer} mb{mb}" for mb, layer in self._routings]
        return out

    # -- unit tasks ------------------------------------------------------------------------
    def run(self, mb: int, task: UnitTask) -> torch.Tensor | Scatter | Exchange | None:
        """Run one unit task; returns what to start as it ends (``task.comm``): the tensor to
        all-reduce over TP (under ``seq_shard`` the reduce-scatter), or the all-to-all
        (:class:`braid.models.moe_dispatch.Exchange`); None where nothing is to be started."""
        if task.phase is Phase.F:
            return self._forward(mb, task.unit, task.layer)
        if task.phase is Phase.B:
            return self._backward(mb, task.unit, task.layer)
        if mb in self._joint_done:  # its weight gradients came with its fused backward
            return None
        if self.seq_shard:  # the stashed tokens of gathered linear inputs: whole again for this W, the next W's started
            self.gather_stashed(mb, task.unit, task.layer)
            self.prefetch_stashed(mb, task.unit, task.layer)
        for mod in self._deferred(task.unit, task.layer):
            mod.weight_backward(mb)
        return None

    def end_forward(self, mb: int) -> None:
        """Called when all of F(mb)'s all-reduces are done: its output becomes available."""
        state = self._fwd.pop(mb, None)
        if not self.spec.head:
            if state is None:
                raise ChunkStateError(f"end of F{mb} without forward state")
            op = self._ops.get(mb)
            if op is None:
                self._outputs[mb] = state[0]
            else:  # fused: the graph stays attached here; the next stage gets the detached output
                op.output = edge(state[0])
                self._outputs[mb] = state[0].detach()

    def end_backward(self, mb: int) -> None:
        """Called when all of B(mb)'s all-reduces are done: finish the last norm backward -> input gradient."""
        st = self._bwd.pop(mb, None)
        if st is None:
            raise ChunkStateError(f"end of B{mb} without backward state")
        self._joint_done.discard(mb)
        if st.pending is not None:
            self._grad_in[mb] = self._finish(mb, st)
        elif not self.spec.embed and mb not in self._grad_in:  # fused mode: set by the op's first B
            raise ChunkStateError(f"B{mb} ended without an input gradient")

    # -- forward -------------------------------------------------------------------------
    def _enter(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (detached) as the start of a piece's graph; see :class:`_Entry`."""
        anchor = self._anchors.get(t.device)
        if anchor is None:
            anchor = self._anchors[t.device] = torch.zeros((), device=t.device, requires_grad=True)
        return _enter_apply(t.detach(), anchor)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> "ModelChunk":
        self._ptrs = None  # .to()/.cuda()/.half() may move the parameters
        out = super()._apply(fn, *args, **kwargs)
        for m in self.modules():  # .to() re-allocates a group's parts one by one: lay them back to back again
            if isinstance(m, ColumnParallelGroup):
                m.pack()
        return out

    def _param_ptrs(self) -> frozenset[int]:
        if self._ptrs is None:
            self._ptrs = frozenset(p.data_ptr() for p in self.parameters())
        return self._ptrs

    def _saving(self, mb: int, unit: Unit, layer: int):
        box = self._boxes.setdefault((mb, unit, layer), _Box())
        ptrs, caches = self._param_ptrs(), self._rope_caches

        def pack(t: torch.Tensor) -> Any:
            p = t.data_ptr()
            if p in ptrs or any(p in c.ptrs for c in caches):  # (a cache holds a table or two)
                return t
            g = self._gather
            if g is not None and p == g[0].data_ptr() and t.shape == g[0].shape:
                # A linear's input all-gathered over the sequence: keep the rank's tokens, gather again when unpacked
                # (Korthikanti et al. Sec. 4.2.2: the saved input of a column-parallel linear is s/t too). One slot
                # for every linear that reads it (Q, K and V; gate and up): one gather, one whole copy held.
                i = next((j for j in box.gathered if box.tensors[j] is g[1]), None)
                if i is None:
                    box.tensors.append(g[1])
                    i = len(box.tensors) - 1
                    box.gathered[i] = None  # gathered again for W (SeqShardOps._unpack_gathered)
                return (box, i, True)
            box.tensors.append(t)
            return (box, len(box.tensors) - 1, False)

        def unpack(h: Any) -> torch.Tensor:
            if isinstance(h, torch.Tensor):
                return h
            b, i, gathered = h
            t = b.tensors[i]
            if isinstance(t, Parked):
                raise ChunkStateError(f"micro-batch {mb}: a saved activation of {unit.value} is on the host (no RELOAD before its use)")
            return self._unpack_gathered(b, i) if gathered else t

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _loss(self, mb: int, logits: torch.Tensor) -> torch.Tensor:
        """The head's loss of micro-batch ``mb`` (scaled by 1/m); recorded in :attr:`losses`."""
        labels = self.labels[mb]
        ce = self.fns.cross_entropy(logits, labels, self.vocab_start, self.tp_group)
        if self.sp is None:
            loss = _masked_mean(ce, labels) / self.m
        else:  # this rank's share of the micro-batch's mean: SP ranks' losses add up to it
            loss = (ce * (labels != IGNORE_INDEX)).sum() / self.targets[mb] / self.m
        self.losses[mb] = loss.detach()
        return loss

    def _forward(self, mb: int, unit: Unit, layer: int) -> torch.Tensor | None:
        if self.fused:
            return self._fused_forward(mb, unit, layer)
        if unit is Unit.EMBED:
            with self._saving(mb, unit, layer):
                out = self.embed(self.tokens[mb])
            self._saved[(mb, unit, layer)] = [_Piece((), (edge(out),))]
            return self._reduction(mb, out)
        if mb not in self._fwd:
            if mb not in self._inputs:
                raise ChunkStateError(f"F{mb}: input activation missing (not received)")
            self._fwd[mb] = (self._inputs.pop(mb),)
        if self.full_recompute and not self._rerunning and unit in full_recompute.LAYER_UNITS:
            return full_recompute.forward_unit(self, mb, unit, layer, _Box)
        if self._moe_unit(unit, layer):
            return self._moe_forward(mb, unit, layer)
        state = self._fwd[mb]
        key = (mb, unit, layer)
        with self._saving(*key):
            if unit in (Unit.PRE_ATTN, Unit.PRE_MLP, Unit.HEAD):
                x, h, norm, full = self._normed(mb, unit, layer)  # h: (b, s/t, h) under seq_shard
                hl = self._enter(full)  # (b, s, h)
                if unit is Unit.HEAD:
                    outs: tuple[torch.Tensor, ...] = (self._loss(mb, self.lm_head(hl)),)  # logits (b, s, V/t)
                else:
                    outs = tuple(self._layer_seq[layer].unit_forward(unit, hl, positions=self.positions))
                ends = outs if unit is Unit.HEAD else tuple(edge(o) for o in outs)  # the loss: a 0-dim tensor
                self._gather = None
                self._saved[key] = [_Piece((edge(x),), (edge(h),), (norm.weight,)), _Piece((edge(hl),), ends)]
                self._fwd[mb] = tuple(o.detach() for o in outs) + (x.detach(),)
                return None
            *acts, residual = state
            leaves = tuple(self._enter(a) for a in acts)
            out = self._layer_seq[layer].unit_forward(unit, *leaves, residual=residual)  # partial over TP
        self._saved[key] = [_Piece(tuple(edge(t) for t in leaves), (edge(out),))]
        return self._reduction(mb, out)

    def _finish(self, mb: int, st: _Backward, keep: list[torch.Tensor] | None = None,
                into: torch.Tensor | None = None) -> torch.Tensor:
        """Norm backward of the reduced gradient left by the previous unit, plus the +1 residual. ``keep``
        (run ahead on a side stream, :meth:`follow`) gets what it made: autograd runs the norm's backward
        on its forward's stream, maybe the caller's, so they are held until the caller's stream waits for
        the side stream (held rather than marked with record_stream, which a CUDA-graph capture does not reuse).
        ``into`` (an all-gather's slot, :meth:`_finish_gathering`): where to write the result, of the norm's input
        gradient's shape and dtype. The sum with the residual is written there at no cost; without a residual
        (the LM head's norm) the gradient is copied there only where it then goes (``keep`` None, or the norm
        ran on this stream: :meth:`_norm_ran_here`), so the copy always frees a tensor."""
        piece, dh, residual, box_key = st.pending
        st.pending = None
        here = self._norm_ran_here(box_key)  # (always asked: it forgets the stream it was told)
        free = keep is None or here
        dx, *dps = grad(piece.outputs, piece.inputs + piece.params, (dh,))
        if keep is not None:
            keep += dps
        for p, g in zip(piece.params, dps):
            self._norm_grad(p, g)
        self._boxes.pop(box_key, None)
        fits = into is not None and into.dtype == dx.dtype and into.shape == dx.shape
        if residual is None:
            if fits and free:
                return into.copy_(dx)
            out = dx
        elif dx.dtype != residual.dtype or dx.shape != residual.shape:
            out = dx + residual
        elif fits:
            out = torch.add(dx, residual, out=into)
            if free:
                return out
        else:
            out = dx.add_(residual)  # the norm's input gradient is ours: no second tensor beside it
        if keep is not None:
            keep.append(dx)
        return out

    def _take(self, mb: int, unit: Unit, layer: int) -> list[_Piece]:
        try:
            return self._saved.pop((mb, unit, layer))
        except KeyError:
            raise ChunkStateError(f"B{mb}: no saved activations of {unit.value} layer {layer} (forward not run?)") from None

    def _backward(self, mb: int, unit: Unit, layer: int) -> torch.Tensor | None:
        if self.fused:
            if mb not in self._bwd:
                op = self._ops.get(mb)
                if op is not None:
                    if not self.spec.head and mb not in self._grad_out:
                        raise ChunkStateError(f"B{mb}: output gradient missing (not received)")
                    del self._ops[mb]
                    self._fused_backward(mb, op)
                    self._bwd[mb] = _Backward()
            self._take(mb, unit, layer)  # its backward ran in the op's first B task
            return None
        if mb not in self._bwd:
            if not self.spec.head and mb not in self._grad_out:
                raise ChunkStateError(f"B{mb}: output gradient missing (not received)")
            self._bwd[mb] = _Backward()
        st = self._bwd[mb]
        key = (mb, unit, layer)
        if full_recompute.needs_rerun(self, mb, unit, layer):
            why = full_recompute.problem(self, mb, layer)
            if why:
                raise ChunkStateError(why)
            full_recompute.rerun(self, mb, layer)
        if unit is not Unit.PRE_MLP and self._moe_unit(unit, layer):
            return self._moe_backward(mb, unit, layer, st)
        pieces = self._take(mb, unit, layer)
        with split_weight_grads(self._deferred(unit, layer), mb):
            if unit is Unit.HEAD:
                (hl,) = pieces[1].inputs
                with self._stashing_for_w(key):  # the head's saved input: stashed as the rank's tokens
                    (dh,) = torch.autograd.grad(pieces[1].outputs, (hl,))  # the loss: implicit ones
                return self._pend(st, pieces[0], dh, None, key)  # partial over TP: reduced (operator f)
            if unit in (Unit.PRE_ATTN, Unit.PRE_MLP):
                (hl,) = pieces[1].inputs
                with self._stashing_for_w(key):  # the linears' saved input: stashed as the rank's tokens
                    (dh,) = grad(pieces[1].outputs, (hl,), st.grads)
                req = self._pend(st, pieces[0], dh, st.residual, key)
                st.grads, st.residual = (), None
                return req
            g, gf = self._grad_whole(mb, st)  # gf: the whole sequence's gradient under seq_shard
            if unit is Unit.EMBED:
                torch.autograd.backward(pieces[0].outputs, (gf,), inputs=[self.embed.weight])
                self._boxes.pop(key, None)
                return None
            st.grads = grad(pieces[0].outputs, pieces[0].inputs, (gf,))
            if self.seq_shard:
                g = self._shard_grad_stash(mb, unit, layer, gf, g)
            st.residual = g  # d out / d x through the fused residual: the explicit +1
            self._boxes.pop(key, None)
            return None

    # -- modules per unit ----------------------------------------------------------------
    def _deferred(self, unit: Unit, layer: int) -> Sequence[DeferredWeightGrad]:
        got = self._unit_mods.get((unit, layer))
        if got is not None:
            return got
        if unit is Unit.EMBED:
            mods: tuple[DeferredWeightGrad, ...] = (self.embed,)
        elif unit is Unit.HEAD:
            mods = (self.lm_head,)
        else:
            mods = tuple(self.layers[layer].unit_weights(unit))  # type: ignore[arg-type]
        self._unit_mods[(unit, layer)] = mods
        return mods

    def _deferred_all(self) -> list[DeferredWeightGrad]:
        if self._all_mods is None:
            self._all_mods = [m for m in self.modules() if isinstance(m, DeferredWeightGrad)]
        return self._all_mods

    # -- offload -------------------------------------------------------------------------
    def saved_for(self, mb: int) -> tuple[list[list[Any]], set[int]]:
        """The saved-tensor slots of ``mb`` and the storages that must stay on the device.

        Kept: storages also held outside the boxes (stage inputs/outputs and forward state
        not yet consumed, tokens, parameters, piece handles that are tensors -- the loss,
        a vision merge unit's leaves) -- moving their saved copy would free nothing. The
        LM units' pieces hold edges, so after a forward nearly every saved byte can move.
        Used by :class:`braid.runtime.offload.ActivationOffloader`.
        """
        if self.fused:
            raise ChunkStateError("offload needs the unit cuts: this chunk runs fused (choose_fused with a reason, or fuse=False)")
        slots = [box.tensors for (kmb, _, _), box in self._boxes.items() if kmb == mb]
        tokens = [t for item in self.tokens for t in (item if isinstance(item, tuple) else (item,))]  # VLM: (pixels, text)
        held: list[torch.Tensor] = list(self.parameters()) + tokens + self.labels + self.targets
        held += [] if self.positions is None else [self.positions]
        for (kmb, _, _), pieces in self._saved.items():
            if kmb == mb:
                held += [t for piece in pieces for t in piece.inputs + piece.outputs if isinstance(t, torch.Tensor)]
        for d in (self._inputs, self._outputs, self._grad_out, self._grad_in):
            held += list(d.values())
        held += [t for state in self._fwd.values() for t in state]
        return slots, {t.untyped_storage().data_ptr() for t in held}

    def _own_offloader(self) -> "ActivationOffloader":
        from braid.runtime.offload import (
            ActivationOffloader,  # the executor passes its own; this is for direct use
        )

        if self._offloader is None:
            dev = next((t.device for box in self._boxes.values() for t in box.tensors if isinstance(t, torch.Tensor)), "cpu")
            self._offloader = ActivationOffloader(dev)
        return self._offloader

    def offload(self, mb: int, frac: float = 1.0, offloader: "ActivationOffloader | None" = None) -> int:
        """Move ``frac`` of the saved activation bytes of ``mb`` to host memory; returns bytes moved."""
        off = offloader or self._own_offloader()
        return off.offload((id(self), mb), *self.saved_for(mb), frac).nbytes

    def reload(self, mb: int, offloader: "ActivationOffloader | None" = None) -> int:
        """Bring the offloaded activations of ``mb`` back to their device; returns bytes moved."""
        off = offloader or self._own_offloader()
        n = off.reload((id(self), mb)).nbytes
        off.wait((id(self), mb))
        return n
