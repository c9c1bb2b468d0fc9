"""The chunk runner under sequence parallelism inside TP (:mod:`braid.tp.seq_shard`): a mixin of
:class:`braid.models.chunk.ModelChunk`, as :class:`braid.models.fused.FusedOps` is for fused mode.

Where the unit cuts are (Korthikanti et al. Sec. 4.2.2, operators g and g-bar):

* A unit that ends with the TP reduction (embed, attn, mlp forward; pre_attn, pre_mlp, head
  backward) asks the executor for a reduce-scatter over the sequence (:meth:`_reduction`,
  :meth:`_pend`): its result is the rank's ``s/t`` tokens, on which the next norm (forward)
  or norm backward and residual gradient (backward) run.
* The next unit (pre_attn, pre_mlp, head forward; attn, mlp, embed backward) reads the whole
  sequence: its *head* -- the norm, or the norm backward and residual -- runs on the local
  tokens, then an all-gather. The executor runs that head as soon as the reduce-scatter has
  ended and leaves the all-gather in flight (:meth:`follow`), so both collectives run beside
  the braided partner's compute, as the all-reduce did. Where no reduce-scatter of the same op
  precedes it (the op's first unit), the executor runs the head with :meth:`lead` as the
  instruction starts when the op follows its block's leader
  (:func:`braid.core.braiding.early_heads`); otherwise the unit runs it itself, the gather blocking.
* A column-parallel linear's input is the gathered sequence; its saved copy is the rank's
  tokens (:meth:`braid.models.chunk.ModelChunk._saving`). Only its weight gradient reads it
  (the input gradient is the output gradient times the weight), so the activation backward
  stashes the rank's tokens for W (:meth:`_unpack_gathered`) and the W task gathers them
  again (:meth:`gather_stashed`): started as the W of the row-parallel unit before it begins
  (:meth:`prefetch_stashed`), so it runs beside that unit's compute. A split B's stash then
  holds ``s/t`` tokens until W, not the whole sequence (Megatron-LM gathers in its weight
  gradient too). The LM head's input is saved so too: its W is its op's first, with no W before
  it to gather beside, so it gathers its input as it starts (one ``s*h`` all-gather; a joint
  backward's W comes right after its B).
* A row-parallel linear's output gradient (out-proj, down-proj) is the gathered gradient of its
  unit's output, the same on every TP rank. Where the W is split off (a ``B`` op, not a ``BW``:
  :attr:`joint`), the stash keeps the rank's tokens of it (:meth:`_shard_grad_stash`) and W gathers
  it as it gathers an input, started as the W before it begins (:meth:`prefetch_stashed`). A full
  backward keeps it whole: its W comes right after the B, with nothing to gather beside.
* RMSNorm weights see only the rank's tokens: their gradients are shares, summed over TP at
  the end of the step (:meth:`sum_seq_grads`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from braid.core.braiding import Phase, Unit, UnitTask, gather_head, unit_tasks
from braid.core.ir import OpKind
from braid.models.chunk_parts import ChunkStateError, _Backward, _Box, _Piece
from braid.tp.layers import accumulate_grad
from braid.tp.seq_shard import Scatter, gather_buffer, gather_start, gathered_view, scatter_request

_PRE_OF = {Unit.ATTN: Unit.PRE_ATTN, Unit.MLP: Unit.PRE_MLP}  # the backward unit that follows (same layer)
_ROW_END = (Unit.ATTN, Unit.MLP)  # the units that end with a row-parallel linear (its output: the unit's)


def gather_through(chunks: Any, comm: Any) -> None:
    """Sequence-sharded chunks of ``chunks`` (a dict) start their all-gathers through ``comm``
    (:class:`braid.tp.comm.TPComm`: the communicator of their reduce-scatters, the copy engines under nccl-ce)."""
    if comm.group is None:
        return
    for ch in chunks.values():
        if getattr(ch, "seq_shard", False):
            ch.seq_gather_start = comm.gather_start


class SeqShardOps:
    """Sequence sharding of :class:`braid.models.chunk.ModelChunk` (module doc); inert unless ``seq_shard``."""

    seq_shard: bool
    tp_group: Any
    joint: frozenset[int]  # micro-batches whose backward is a BW op (each unit's W right after its B)

    def _init_seq_shard(self, on: bool) -> None:
        self.seq_shard = on and self.tp_group is not None and dist.get_world_size(self.tp_group) > 1
        self._seq_grads: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}  # this step's norm-weight shares
        # How the all-gathers start (local -> (buffer, work)): the executor sets its TP backend's
        # (TPComm.gather_start: the communicator of the reduce-scatters, the copy engines under nccl-ce);
        # unset, the TP group's collective
        self.seq_gather_start: Callable[..., tuple[torch.Tensor, Any]] | None = None
        self._gather: tuple[torch.Tensor, torch.Tensor] | None = None  # (gathered, local) of the unit running
        # micro-batch -> the head :meth:`follow` ran of its next forward / backward unit (apart: a
        # backward under full recomputation re-runs forward units between a follow and its unit)
        self._ahead_f: dict[int, tuple] = {}
        self._ahead_b: dict[int, tuple] = {}
        # While an activation backward stashes for W (set around a pre_attn / pre_mlp B): a gathered slot
        # unpacks to the rank's tokens, recorded here by address (autograd unpacks a new tensor object of
        # the same memory) -> [tokens, None | (buffer, work) | gathered]
        self._defer_gathers = False
        self._stashed_local: dict[int, list] = {}
        # (mb, unit, layer) of a pre unit -> the CUDA stream its norm ran on in :meth:`follow` (its backward runs there too)
        self._norm_streams: dict[tuple, Any] = {}
        self._w_next: dict[tuple[Unit, int], tuple[Unit, int]] | None = None  # a W unit -> the W unit after it

    # -- reductions and gathers -----------------------------------------------------------
    def _reduction(self, mb: int, out: torch.Tensor) -> torch.Tensor | Scatter:
        """What the executor reduces over TP after a unit whose output ``out`` is partial. The
        unit's result (``_fwd[mb]``) is the reduced tensor, filled in place: ``out`` itself (the
        all-reduce), or under ``seq_shard`` the reduce-scatter's output (b, s/t, h)."""
        out = out.detach()
        if not self.seq_shard:
            self._fwd[mb] = (out,)
            return out
        req = scatter_request(out, dist.get_world_size(self.tp_group))
        self._fwd[mb] = (req.out,)
        return req

    def _pend(self, st: _Backward, piece: _Piece, dh: torch.Tensor, residual: torch.Tensor | None,
              key: tuple) -> torch.Tensor | Scatter:
        """Leave ``piece``'s norm backward until ``dh`` (partial over TP) is reduced; returns the reduction to start."""
        req = scatter_request(dh, dist.get_world_size(self.tp_group)) if self.seq_shard else dh
        st.pending = (piece, req.out if self.seq_shard else dh, residual, key)
        return req

    def _gather_start(self, local: torch.Tensor, buf: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """Start the all-gather of ``local`` (b, s/t, h): its buffer (``buf`` if given) and work (:attr:`seq_gather_start`)."""
        if self.seq_gather_start is not None:
            return self.seq_gather_start(local, buf)
        return gather_start(local, self.tp_group, buf)

    def _norm_ran_here(self, key: tuple) -> bool:
        """Whether the norm of pre unit ``key`` ran (in :meth:`follow`) on the current CUDA stream, where autograd
        then runs its backward too: a tensor that backward makes is freed on the stream it was made on, safely."""
        ran = self._norm_streams.pop(key, None)
        return ran is not None and ran == torch.cuda.current_stream(ran.device)

    def _finish_gathering(self, mb: int, st: _Backward, keep: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """:meth:`_finish`, then the all-gather of its result started: (the rank's tokens, the buffer, the work).
        At one sample per micro-batch (the gathered view is the buffer itself) the result is written into the
        rank's own slot of the buffer and gathered in place (:meth:`_finish` says when), so the rank's tokens are
        no second tensor beside the whole sequence while the unit's backward runs; a split B's stash copies them
        out after it (:meth:`_shard_grad_stash`)."""
        dh = st.pending[1]
        buf = gather_buffer(dh, self.tp_group) if dh.shape[0] == 1 else None
        slot = None if buf is None else buf[dist.get_rank(self.tp_group)]
        g = self._finish(mb, st, keep, into=slot)
        if slot is not None and g.data_ptr() != slot.data_ptr():  # (not written there: a dtype or shape apart)
            buf = None
        buf, work = self._gather_start(g, buf)
        return g, buf, work

    def _all_gather(self, local: torch.Tensor) -> torch.Tensor:
        """The whole sequence (b, s, h) of every rank's ``local``, blocking (inside a unit)."""
        buf, work = self._gather_start(local)
        work.wait()
        return gathered_view(buf)

    def _gathered(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (b, s/t, h) with the whole sequence all-gathered under ``seq_shard`` (blocking); else ``t``."""
        return self._all_gather(t.detach()) if self.seq_shard else t

    def _normed(self, mb: int, unit: Unit, layer: int) -> tuple[torch.Tensor, torch.Tensor, nn.Module, torch.Tensor]:
        """The head of a forward ``pre_*``/``head`` unit (inside its saved-tensor box): its entered
        input ``x``, the norm ``h = norm(x)``, the norm, and the norm's output over the whole
        sequence -- gathered by :meth:`follow` already, or here (blocking)."""
        ahead = self._ahead_f.pop(mb, None)
        if ahead is not None:
            x, h, norm, buf = ahead
            full = gathered_view(buf)
        else:
            x = self._enter(self._fwd[mb][0])
            norm = self.norm if unit is Unit.HEAD else self._layer_seq[layer].unit_norm(unit)
            h = norm(x)  # (b, s/t, h) under seq_shard
            full = self._gathered(h)  # (b, s, h)
        # A linear that saves this tensor keeps the local tokens instead (_saving), the LM head's too
        if self.seq_shard:
            self._gather = (full, h.detach())
        return x, h, norm, full

    def _grad_whole(self, mb: int, st: _Backward) -> tuple[torch.Tensor, torch.Tensor]:
        """The head of a backward ``attn``/``mlp``/``embed`` unit: the gradient of its output on the
        rank's tokens (the previous unit's norm backward and residual, or the received gradient)
        and over the whole sequence -- gathered by :meth:`follow` already, or here (blocking)."""
        ahead = self._ahead_b.pop(mb, None)
        if ahead is not None:
            g, buf = ahead
            return g, gathered_view(buf)
        if st.pending is None:
            g = self._grad_out.pop(mb)
            return g, self._gathered(g)
        if not self.seq_shard:
            g = self._finish(mb, st)
            return g, g
        g, buf, work = self._finish_gathering(mb, st)
        work.wait()
        return g, gathered_view(buf)

    # -- the executor's side: a unit's head run as the reduction before it ends --------------
    def follows(self, task: UnitTask) -> bool:
        """Whether the executor runs ``task``'s head (:meth:`follow`) as its op's previous
        reduction ends: under ``seq_shard``, for a unit that starts by gathering (not a forward
        under full recomputation, which runs without autograd)."""
        if not self.seq_shard or not gather_head(task):
            return False
        return task.phase is not Phase.F or not self.full_recompute

    def follow(self, mb: int, task: UnitTask) -> tuple[Any, list[torch.Tensor]]:
        """Run the head of ``task`` (the op's next unit, :meth:`follows`) once the reduce-scatter
        before it has ended, and start its all-gather; returns the gather's work and the tensors
        the head read or made (the executor orders them between streams on CUDA)."""
        if task.phase is Phase.F:
            state = self._fwd[mb]
            x = self._enter(state[0])
            norm = self.norm if task.unit is Unit.HEAD else self._layer_seq[task.layer].unit_norm(task.unit)
            with self._saving(mb, task.unit, task.layer):
                h = norm(x)
            if h.is_cuda:
                self._norm_streams[(mb, task.unit, task.layer)] = torch.cuda.current_stream(h.device)
            buf, work = self._gather_start(h.detach())
            self._ahead_f[mb] = (x, h, norm, buf)
            return work, [state[0], h, buf]
        st = self._bwd[mb]
        read = [t for t in st.pending[1:3] if t is not None]
        box = self._boxes.get(st.pending[3])  # the norm's saved tensors, freed by _finish: maybe made on the caller's stream
        read += [t for t in box.tensors if isinstance(t, torch.Tensor)] if box is not None else []
        g, buf, work = self._finish_gathering(mb, st, read)
        self._ahead_b[mb] = (g, buf)
        shares = [t for _, t in self._seq_grads.values()]  # the norm backward's weight-gradient shares (sum_seq_grads)
        return work, [*read, g, buf, *shares]

    def lead(self, mb: int, task: UnitTask) -> Any:
        """Run the head of ``task``, the *first* unit task of its op (:meth:`follows`; no reduction
        of the op precedes it), now, and start its all-gather: the instruction runs it before its
        first step (:func:`braid.core.braiding.early_heads`); returns the gather's work. On the
        caller's stream: the head reads the op's input, already in hand."""
        if task.phase is Phase.F:
            if mb not in self._fwd:
                if mb not in self._inputs:
                    raise ChunkStateError(f"F{mb}: input activation missing (not received)")
                self._fwd[mb] = (self._inputs.pop(mb),)
            return self.follow(mb, task)[0]
        if mb in self._bwd or mb not in self._grad_out:
            raise ChunkStateError(f"B{mb}: {task.label} is not its op's first unit with its output gradient in hand")
        self._bwd[mb] = _Backward()
        g = self._grad_out.pop(mb)
        buf, work = self._gather_start(g)
        self._ahead_b[mb] = (g, buf)
        return work

    # -- saved linear inputs: the rank's tokens, gathered again in W ------------------------
    def _unpack_gathered(self, box: _Box, i: int) -> torch.Tensor:
        """A saved linear input (slot ``i`` of ``box``, the rank's tokens): in an activation backward
        that stashes it for W (``_defer_gathers``), the tokens themselves -- the linears' input
        gradients do not read it, W gathers it (:meth:`gather_stashed`); otherwise the whole sequence."""
        held = box.gathered.get(i)
        if isinstance(held, torch.Tensor):
            return held
        local = box.tensors[i]
        if self._defer_gathers:
            self._stashed_local.setdefault(local.data_ptr(), [local, None])
            return local
        full = self._all_gather(local)
        box.gathered[i] = full
        return full

    @contextmanager
    def _stashing_for_w(self, key: tuple) -> Iterator[None]:
        """Around the activation backward of ``key`` (a pre unit's or the LM head's): under ``seq_shard`` its linears'
        saved inputs unpack to the rank's tokens, stashed for W (:meth:`_unpack_gathered`); after it the box lets them
        go. The box stays until the norm's backward (the next unit's head), which does not read them; a W that came
        first (a full backward's) would otherwise gather the whole sequence beside a second hold of its tokens."""
        self._defer_gathers = self.seq_shard
        try:
            yield
        finally:
            self._defer_gathers = False
        box = self._boxes.get(key)
        for i in box.gathered if box is not None else ():
            box.tensors[i] = None

    def _stashed_of(self, mb: int, unit: Unit, layer: int) -> list[list]:
        """The records of the rank's tokens stashed for the W of (``mb``, ``unit``, ``layer``), once each."""
        seen: dict[int, list] = {}
        for mod in self._deferred(unit, layer):
            for x in mod.stashed_tensors(mb):
                rec = self._stashed_local.get(x.data_ptr())
                if rec is not None:
                    seen[x.data_ptr()] = rec
        return list(seen.values())

    def _next_w(self, unit: Unit, layer: int) -> tuple[Unit, int] | None:
        """The W unit task that follows (``unit``, ``layer``) in a W op (:func:`braid.core.braiding.unit_tasks`)."""
        if self._w_next is None:
            order = [(t.unit, t.layer) for t in unit_tasks(OpKind.W, self.spec)]
            self._w_next = dict(zip(order, order[1:]))
        return self._w_next.get((unit, layer))

    def prefetch_stashed(self, mb: int, unit: Unit, layer: int) -> None:
        """As the W of ``unit`` starts, start gathering the stashed tokens of the W after it, so the gather
        runs beside this W's compute: a pre-unit's input (from its saved tokens where its B is still to come:
        then they are stashed with the gather in flight) or a row-parallel linear's output gradient."""
        nxt = self._next_w(unit, layer)
        if nxt is None:
            return
        box = self._boxes.get((mb, *nxt)) if _PRE_OF.get(unit) is nxt[0] else None
        if box is not None:  # its B has not run yet (a full backward: each unit's W follows its B): the saved tokens
            for i, held in box.gathered.items():
                local = box.tensors[i]
                if held is None and isinstance(local, torch.Tensor):  # (not on the host)
                    rec = self._stashed_local.setdefault(local.data_ptr(), [local, None])
                    if rec[1] is None:
                        rec[1] = self._gather_start(local)
            return
        for rec in self._stashed_of(mb, *nxt):
            if rec[1] is None:
                rec[1] = self._gather_start(rec[0])

    def _shard_grad_stash(self, mb: int, unit: Unit, layer: int, whole: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
        """After the split-off activation backward of an ``attn``/``mlp`` unit (``mb`` not :attr:`joint`):
        its row-parallel linears' stashed output gradients, ``whole`` over the sequence and the same on every
        TP rank (the unit's output gradient through the fused residual), kept as the rank's tokens -- ``mine``,
        the tensor ``whole`` was gathered from, which is the residual's gradient too and which nothing writes
        into: ``s/t`` of the bytes until W -- and gathered again by their W (:meth:`gather_stashed`). Returns
        the rank's tokens to keep (the residual's gradient): ``mine``, or where ``mine`` is a slot of the
        gather's buffer (:meth:`_finish_gathering`) a copy, so the whole sequence goes now rather than at W."""
        if unit not in _ROW_END or mb in self.joint:
            return mine
        if mine._base is not None:
            mine = mine.clone()
        self._stashed_local.setdefault(mine.data_ptr(), [mine, None])

        def local(g: torch.Tensor) -> torch.Tensor:
            return g if g.shape != whole.shape else mine  # (already the rank's tokens: as it is)

        for mod in self._deferred(unit, layer):
            mod.map_stash(mb, grad=local)
        return mine

    def gather_stashed(self, mb: int, unit: Unit, layer: int) -> None:
        """Before the W of (``mb``, ``unit``, ``layer``): its modules' stashed tokens replaced by the whole
        sequence (one gather per input: Q, K and V share theirs, as gate and up do)."""
        if not self._stashed_local:
            return
        recs = self._stashed_of(mb, unit, layer)
        if not recs:
            return
        for rec in recs:
            if not isinstance(rec[1], torch.Tensor):
                buf, work = rec[1] if rec[1] is not None else self._gather_start(rec[0])
                work.wait()
                rec[1] = gathered_view(buf)

        def whole(x: torch.Tensor) -> torch.Tensor:
            rec = self._stashed_local.get(x.data_ptr())
            return x if rec is None else rec[1]

        for mod in self._deferred(unit, layer):
            mod.map_stash(mb, inp=whole, grad=whole)
        for rec in recs:
            del self._stashed_local[rec[0].data_ptr()]

    # -- norm weights --------------------------------------------------------------------
    def _norm_grad(self, p: nn.Parameter, g: torch.Tensor) -> None:
        """A norm weight's gradient from one backward: into ``.grad``, or under ``seq_shard`` (a share:
        this rank's tokens) into this step's shares, summed over TP by :meth:`sum_seq_grads`."""
        if not self.seq_shard:
            accumulate_grad(p, g)
            return
        held = self._seq_grads.get(id(p))
        if held is None:
            self._seq_grads[id(p)] = (p, g)  # a fresh tensor of the backward call: the step's accumulator
        else:
            held[1].add_(g)

    def sum_seq_grads(self, wait: Any) -> None:
        """Sum this step's norm-weight gradient shares over TP (one all-reduce, ``wait`` waits for
        it) and add them to the parameters' gradients. Kept apart from ``.grad`` until then, so
        gradients accumulated before the step are not summed again."""
        if not self._seq_grads:
            return
        held = list(self._seq_grads.values())
        self._seq_grads.clear()
        flat = torch.cat([g.reshape(-1) for _, g in held])
        wait(dist.all_reduce(flat, group=self.tp_group, async_op=True))
        for (p, _), g in zip(held, flat.split([g.numel() for _, g in held])):
            accumulate_grad(p, g.view_as(p))
