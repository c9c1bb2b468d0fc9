"""A model chunk's fused mode (:meth:`FusedOps.choose_fused`; the executor picks it at tp=1 without
sequence parallelism or offload): none of the cuts above is needed, and each costs an
autograd engine call per unit. The forward unit tasks then run on the attached graph (the
residual included; only a received chunk input is entered), filling the per-unit boxes
when the step is recorded (:attr:`braid.models.chunk.ModelChunk.track_saved`), and the op's first backward
unit task runs the whole chunk's backward in one engine call, the weight gradients stashed
for the W tasks as above. A micro-batch whose backward op is a ``BW``
(:meth:`FusedOps.set_joint`) runs *joint*: small linears and the embedding as plain
modules, one ``backward()`` that accumulates every gradient, nothing stashed. The executor
calls :meth:`FusedOps.run_op` once per op instead of once per unit task when it does not
time single units.

:class:`FusedOps` is a part of :class:`braid.models.chunk.ModelChunk` (its fused and joint paths),
not a class of its own: its methods use the chunk's state.
"""

from __future__ import annotations

import torch

from braid.core.braiding import Phase, Unit, unit_tasks
from braid.core.ir import OpKind
from braid.models.chunk_parts import ChunkStateError, _FusedOp
from braid.tp.autograd_calls import edge, grad
from braid.tp.layers import (
    DeferredWeightGrad,
    accumulate_grad,
    split_weight_grads,
)


class FusedOps:
    """The fused/joint half of :class:`braid.models.chunk.ModelChunk` (see the module doc)."""

    def choose_fused(self, reason: str | None = None) -> bool:
        """Fused mode (one autograd graph per micro-batch) where nothing needs the unit cuts.

        ``reason``: the caller's reason to keep the cuts (the executor's: its program
        offloads activations, its TP or SP group). With ``fuse=None`` the chunk then runs
        fused exactly when neither that nor :meth:`cut_reason` holds; ``fuse=False`` always
        cuts; ``fuse=True`` where it cannot run fused is an error. Call between steps.

        In fused mode the forward unit tasks still run one at a time (and fill the
        per-unit saved-tensor boxes), but the graph is not cut between units: the op's
        first backward unit task runs the whole chunk's backward in one engine call, with
        the weight gradients of every unit stashed for its W task as in cut mode; the
        other backward unit tasks have nothing left to do.
        """
        why = reason or self.cut_reason()
        if self.fuse and why:
            raise ValueError(f"fused chunk requested (fuse=True), but {why} needs the unit cuts; build it with fuse=None")
        fused = self.fuse is not False and why is None
        if fused != self.fused and (self._fwd or self._saved or self._ops or self._bwd):
            raise ChunkStateError("fused/cut mode changed with a micro-batch in flight")
        self.fused = fused
        for m in self._deferred_all():
            m.native = self._native
        return fused

    def set_joint(self, mbs: "set[int] | frozenset[int]") -> None:
        """Micro-batches whose backward op computes the weight gradients with the activation
        gradients (a ``BW`` op; the executor reads them off its program).

        In fused mode their forward runs the embedding and the small linears as plain
        modules (``F.linear``/``F.embedding``; :class:`braid.tp.layers.NativeMode`) and
        their backward is one ``backward`` call that accumulates every gradient, as a
        training loop's ``loss.backward()`` (larger linears add theirs into ``.grad`` inside
        the GEMM during that call): no weight gradient is stashed and the op's W tasks have
        nothing to do. Call between steps. A micro-batch marked joint whose backward is
        split after all (a B, then a W) gets the right gradients, but its W then finds no
        stash: mark exactly the ``BW`` ops. Under sequence sharding (not fused) they keep their
        row-parallel output gradients whole (:meth:`~braid.models.seq_shard_ops.SeqShardOps._shard_grad_stash`).
        """
        if self._ops or self._bwd:
            raise ChunkStateError("joint micro-batches changed with a micro-batch in flight")
        self.joint = frozenset(mbs)

    def run_op(self, mb: int, kind: OpKind) -> None:
        """A whole op of a fused chunk in one call: what its unit tasks do, in their order.

        The executor's path for fused chunks when it does not time single units: the F op's
        units run one after another, a B or BW op is the one backward call (plus, for a BW
        whose micro-batch is not joint, its weight gradients), a W op the weight gradients
        stashed for it. Fused mode has no TP all-reduce, so nothing is returned.
        """
        if not self.fused:
            raise ChunkStateError(f"run_op needs a fused chunk ({self.cut_reason() or 'fuse=False'})")
        if kind is not OpKind.W:
            tasks = self._op_tasks.get(kind)
            if tasks is None:  # an F's units, a B's or a BW's backward units
                tasks = self._op_tasks[kind] = tuple((t.unit, t.layer) for t in unit_tasks(kind, self.spec)
                                                     if t.phase is not Phase.W)
            if kind is OpKind.F:
                for unit, layer in tasks:
                    self._forward(mb, unit, layer)
                return
            self._backward(mb, *tasks[0])  # the op's first B task runs the whole backward
            for unit, layer in tasks[1:]:
                self._take(mb, unit, layer)
            if kind is OpKind.B:
                return
        if mb not in self._joint_done:
            for mod in self._op_deferred():
                mod.weight_backward(mb)

    def _op_deferred(self) -> tuple[DeferredWeightGrad, ...]:
        """The deferred modules of every backward unit, in W-task order."""
        if self._op_mods is None:
            self._op_mods = tuple(m for t in unit_tasks(OpKind.W, self.spec) for m in self._deferred(t.unit, t.layer))
        return self._op_mods

    def _fused_forward(self, mb: int, unit: Unit, layer: int) -> None:
        """A unit's forward in fused mode: on the attached state, nothing cut (only a received input is entered)."""
        op = self._ops.get(mb)
        key = (mb, unit, layer)
        if op is None:
            joint = mb in self.joint
            if unit is Unit.EMBED:
                op = self._ops[mb] = _FusedOp(None, joint=joint)
            else:
                if mb not in self._inputs:
                    raise ChunkStateError(f"F{mb}: input activation missing (not received)")
                x = self._inputs.pop(mb)
                # joint: a leaf, whose .grad the one backward call fills (its AccumulateGrad
                # node holds x, which the first norm saves anyway).
                x = x.detach().requires_grad_() if joint else self._enter(x)
                op = self._ops[mb] = _FusedOp(x if joint else edge(x), joint=joint)
                self._fwd[mb] = (x,)
        self._saved[key] = []
        self._native.on = op.joint
        try:
            if self.track_saved:
                op.boxes.append(key)
                with self._saving(*key):
                    self._fused_unit(mb, op, unit, layer)
            else:
                self._fused_unit(mb, op, unit, layer)
        finally:
            self._native.on = False
        return None

    def _fused_unit(self, mb: int, op: _FusedOp, unit: Unit, layer: int) -> None:
        if unit is Unit.EMBED:
            self._fwd[mb] = (self.embed(self.tokens[mb]),)
        elif unit in (Unit.PRE_ATTN, Unit.PRE_MLP, Unit.HEAD):
            x = self._fwd[mb][0]
            norm = self.norm if unit is Unit.HEAD else self._layer_seq[layer].unit_norm(unit)
            h = norm(x)
            if not op.joint:  # a joint backward accumulates every parameter's gradient itself
                op.params.append(norm.weight)
            if unit is Unit.HEAD:
                op.output = self._loss(mb, self.lm_head(h))
                self._fwd[mb] = ()
            else:
                self._fwd[mb] = tuple(self._layer_seq[layer].unit_forward(unit, h, positions=self.positions)) + (x,)
        elif unit is Unit.EXPERTS:  # a mixture's experts in one piece (nothing moves: a fused chunk has no EP)
            *acts, residual = self._fwd[mb]
            self._fwd[mb] = (self._layer_seq[layer].unit_forward(unit, *acts), residual)
        else:
            *acts, residual = self._fwd[mb]
            self._fwd[mb] = (self._layer_seq[layer].unit_forward(unit, *acts, residual=residual),)

    def _fused_backward(self, mb: int, op: _FusedOp) -> torch.Tensor | None:
        """The whole chunk's backward of ``mb`` in one engine call (the op's first B task).

        From the loss or the received output gradient to the chunk input (or the
        embedding) and the norm weights, every deferred module's weight gradient stashed
        under ``mb`` for the W tasks; the input gradient is left for :meth:`pop_input_grad`.
        The embedding's weight is listed so that its (stashing) backward runs; its
        gradient comes back None (it is the W task's).
        """
        if op.joint:  # every gradient accumulated by the engine, as loss.backward() does
            grads = None if self.spec.head else (self._grad_out.pop(mb),)
            self._native.accumulate = True
            try:
                torch.autograd.backward((op.output,), grads)
            finally:
                self._native.accumulate = False
            for key in op.boxes:
                self._boxes.pop(key, None)
            if op.input is not None:
                self._grad_in[mb] = op.input.grad
            self._joint_done.add(mb)
            return None
        params = op.params
        ends = params + [self.embed.weight] if op.input is None else [op.input, *params]
        grads = () if self.spec.head else (self._grad_out.pop(mb),)  # the loss: ones
        with split_weight_grads(self._deferred_all(), mb):
            if op.input is None:
                got = torch.autograd.grad((op.output,), ends, grads or None, allow_unused=True)
            elif self.spec.head:
                got = torch.autograd.grad((op.output,), ends)
            else:
                got = grad((op.output,), ends, grads)
        for key in op.boxes:
            self._boxes.pop(key, None)
        if op.input is not None:
            self._grad_in[mb], *got = got
        for p, g in zip(params, got):
            if g is None:
                raise ChunkStateError(f"B{mb}: no gradient of a norm weight {tuple(p.shape)} (not in the fused graph)")
            accumulate_grad(p, g)
