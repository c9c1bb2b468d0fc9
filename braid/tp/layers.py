"""Column- and row-parallel linear layers with a deferrable weight gradient.

Megatron-style TP (paper Sec. 3): a column-parallel linear holds a block of output rows
of the weight, a row-parallel linear a block of input columns. The all-reduces that join
them (operators f and g) are deliberately *not* inside these modules: the executor runs
them asynchronously at unit boundaries (see :mod:`braid.core.braiding`), so it can hide them
behind another micro-batch's compute.

Weight-gradient split (zero-bubble "B"/"W"): in split mode the backward computes only the
input gradient and stashes ``(input, grad_output)`` under the current key (the
micro-batch); a later :meth:`DeferredWeightGrad.weight_backward` computes and
*accumulates* ``weight.grad`` from the stash. In full mode both come out of one backward,
as with ``nn.Linear``.
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Iterator, Sequence

import torch
from torch import nn

from braid.tp.autograd_calls import fast_apply


class StashError(KeyError):
    """A weight-gradient pass asked for a stash that the backward never produced."""


@dataclass(slots=True)
class _SplitMode:
    """Whether backward stashes (and under which key): a plain object, so switching it per
    unit costs an attribute write instead of ``nn.Module.__setattr__``."""

    on: bool = False
    key: Hashable | None = None


# A joint linear runs as plain ``F.linear`` when its GEMMs are this small (tokens x in x out;
# about 0.1 ms of an H100's bf16 GEMM time for its forward and backward), else through its
# own function, which adds the weight gradient into ``.grad`` inside the GEMM.
JOINT_NATIVE_WORK = 2 ** 33


@dataclass(slots=True)
class NativeMode:
    """The joint mode of a micro-batch whose backward will not split the weight gradient off
    (a fused chunk's ``BW`` op, see :meth:`braid.models.chunk.ModelChunk.set_joint`). A
    chunk shares one such object among its modules, so switching costs an attribute write.

    ``on`` (forward): small linears and the embedding run as the plain module
    (``F.linear``/``F.embedding``), so autograd computes their weight gradients in the
    backward call and accumulates them itself, as for ``nn.Linear``: no Python function per
    call, which is what a host-bound size pays for. A large linear keeps its function: for
    it the Python is hidden behind its GEMMs, while autograd's accumulation would read and
    write the whole gradient once more per micro-batch (:data:`JOINT_NATIVE_WORK`).
    ``accumulate`` (during the joint backward call): those functions add the weight
    gradient into ``.grad`` right away (the GEMM accumulates, ``beta=1``) instead of
    stashing it for a W task.
    """

    on: bool = False
    accumulate: bool = False


class DeferredWeightGrad(nn.Module):
    """Mixin: a module whose weight gradient can be split off its backward.

    ``split_mode`` (on, key) is set by :func:`split_weight_grads` around a backward call;
    subclasses call :meth:`_stash_or_grad` from their autograd function and implement
    :meth:`_weight_grads` (``(input, grad_output) -> grads of the parameters``).
    """

    def _init_deferred(self) -> None:
        self.split_mode = _SplitMode()
        self.native = NativeMode()
        self._stash: dict[Hashable, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @abstractmethod
    def _weight_grads(self, inp: torch.Tensor, grad_out: torch.Tensor) -> list[torch.Tensor | None]:
        """Gradients of :meth:`_deferred_params` from one stashed (input, grad_output) pair."""

    @abstractmethod
    def _deferred_params(self) -> list[nn.Parameter | None]:
        """The parameters whose gradient this module defers (None for an absent bias)."""

    def _stash_or_grad(self, inp: torch.Tensor, grad_out: torch.Tensor) -> list[torch.Tensor | None]:
        """Called from backward: stash for a later W (split mode) or return the weight grads now."""
        mode = self.split_mode
        if mode.on:
            self._stash.setdefault(mode.key, []).append((inp, grad_out))
            return [None] * len(self._deferred_params())
        if self.native.accumulate:
            params = self._deferred_params()
            with torch.no_grad():
                self._accumulate_weight_grads(params, inp, grad_out)
            return [None] * len(params)
        return self._weight_grads(inp, grad_out)

    def has_stash(self, key: Hashable) -> bool:
        return key in self._stash

    def stashed_tensors(self, key: Hashable) -> list[torch.Tensor]:
        """The inputs and output gradients stashed under ``key`` (none if nothing is)."""
        return [t for item in self._stash.get(key, ()) for t in item]

    def map_stash(self, key: Hashable, inp: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  grad: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Replace each input stashed under ``key`` by ``inp(input)`` and each output gradient by
        ``grad(grad_output)`` (either left alone where None): a sequence-sharded chunk stashes the rank's
        tokens of a whole-sequence tensor and gathers them in W (:mod:`braid.models.seq_shard_ops`)."""
        items = self._stash.get(key)
        if items:
            self._stash[key] = [(inp(a) if inp else a, grad(b) if grad else b) for a, b in items]

    def stash_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for v in self._stash.values() for a, b in v)

    def weight_backward(self, key: Hashable) -> None:
        """Compute the deferred weight gradients of ``key`` and accumulate them into ``.grad``."""
        try:
            items = self._stash.pop(key)
        except KeyError:
            raise StashError(f"{type(self).__name__}: no stashed activations for {key!r} (was its B run?)") from None
        params = self._deferred_params()
        # The stash holds autograd leaves (the unit's inputs): without no_grad every W
        # matmul would record a graph nobody runs (host time and memory) and leave
        # ``.grad`` tensors that require grad.
        with torch.no_grad():
            for inp, grad_out in items:
                self._accumulate_weight_grads(params, inp, grad_out)

    def _accumulate_weight_grads(self, params: list[nn.Parameter | None], inp: torch.Tensor, grad_out: torch.Tensor) -> None:
        """:func:`accumulate_grad` of each deferred parameter's gradient."""
        for p, g in zip(params, self._weight_grads(inp, grad_out)):
            if p is not None and g is not None:
                accumulate_grad(p, g)


def accumulate_grad(p: nn.Parameter, g: torch.Tensor) -> None:
    """Add a gradient contribution to ``p``: into ``p.main_grad`` when it has one, else ``p.grad``.

    ``main_grad`` is the fp32 accumulation buffer of a mixed-precision optimizer
    (:class:`braid.training.optimizer.ShardedAdamW`): bf16 contributions of every
    micro-batch are added in fp32 there, never rounded to bf16 in between. Without it,
    this is autograd's ``AccumulateGrad`` (same values, same add).
    """
    main = getattr(p, "main_grad", None)
    if main is not None:
        main.add_(g)
    elif p.grad is None:
        p.grad = g
    else:
        p.grad.add_(g)


def gemm_accumulates(target: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``target += a @ b`` runs as one GEMM (beta=1): inputs of one dtype, and ``target`` of it or an fp32
    ``target`` (a ``main_grad`` buffer) of bf16/fp16 inputs on CUDA where torch's ``addmm`` takes ``out_dtype``
    (:func:`_fp32_out_gemm`); elsewhere the product is made in the inputs' dtype and added by :func:`accumulate_grad`."""
    if a.dtype != b.dtype:
        return False
    if target.dtype == a.dtype:
        return True
    return (target.is_cuda and target.dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16)
            and target.is_contiguous() and _fp32_out_gemm())


def _fp32_out_gemm() -> bool:
    """Whether this torch's CUDA ``addmm`` writes an fp32 result of bf16 inputs into an fp32 ``self`` (``out_dtype``:
    torch >= 2.8), tried once on a 1x1 product. Not first asked inside a CUDA graph's capture (the eager warm-up
    steps run every W task before it, :data:`braid.runtime.graphs.WARMUP_STEPS`); asked there, it says no, unprobed."""
    if not _FP32_OUT_GEMM:
        if torch.cuda.is_current_stream_capturing():
            return False
        c = torch.zeros(1, 1, device="cuda")
        x = torch.ones(1, 1, dtype=torch.bfloat16, device="cuda")
        try:
            torch.addmm(c, x, x, out_dtype=torch.float32, out=c)
            _FP32_OUT_GEMM.append(float(c) == 1.0)
        except (TypeError, RuntimeError, NotImplementedError):
            _FP32_OUT_GEMM.append(False)
    return _FP32_OUT_GEMM[0]


_FP32_OUT_GEMM: list[bool] = []  # _fp32_out_gemm's answer, once probed


def gemm_accumulate(target: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``target += a @ b`` in one GEMM where :func:`gemm_accumulates` says it can: an fp32 target of bf16/fp16
    inputs takes the product in fp32, never rounded to the inputs' dtype."""
    if target.dtype == a.dtype:
        target.addmm_(a, b)
    else:
        torch.addmm(target, a, b, out_dtype=target.dtype, out=target)


def add_column_sums(out: torch.Tensor, g2: torch.Tensor) -> None:
    """``out += g2.sum(0)`` for ``g2`` (tokens, n): one GEMV that adds itself (beta=1), instead
    of a reduction and an add (a bias gradient of an output gradient ``g2``)."""
    out.addmv_(g2.t(), g2.new_ones(g2.shape[0]))


def accumulate_bias_grad(p: nn.Parameter, g2: torch.Tensor) -> None:
    """:func:`accumulate_grad` of a bias: the column sums of the output gradient ``g2``
    (tokens, out), into an existing ``.grad`` of its dtype by :func:`add_column_sums`."""
    if p.grad is None or p.grad.dtype != g2.dtype or getattr(p, "main_grad", None) is not None:
        accumulate_grad(p, g2.sum(0))
    else:
        add_column_sums(p.grad, g2)


@contextlib.contextmanager
def split_weight_grads(modules: Iterable[DeferredWeightGrad], key: Hashable) -> Iterator[None]:
    """Within the block, backward passes through ``modules`` stash under ``key`` instead of computing dW."""
    modes = [m.split_mode for m in modules]
    saved = [(x.on, x.key) for x in modes]
    for x in modes:
        x.on, x.key = True, key
    try:
        yield
    finally:
        for x, (on, k) in zip(modes, saved):
            x.on, x.key = on, k


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mod: "_ParallelLinear") -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.mod = mod
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        grads = ctx.mod._stash_or_grad(x, grad_out)
        dw = grads[0]
        db = grads[1] if len(grads) > 1 else None
        return grad_x, dw, db, None


_linear = fast_apply(_LinearFn)  # the C++ apply: a linear is called once per unit task and more


class _ParallelLinear(DeferredWeightGrad):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone().contiguous())
        self._init_deferred()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native.on and x.numel() * self.weight.shape[0] <= JOINT_NATIVE_WORK:
            return nn.functional.linear(x, self.weight, self.bias)
        return _linear(x, self.weight, self.bias, self)

    def _deferred_params(self) -> list[nn.Parameter | None]:
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    def _weight_grads(self, inp: torch.Tensor, grad_out: torch.Tensor) -> list[torch.Tensor | None]:
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # (tokens, out)
        dw = g2.t().matmul(inp.reshape(-1, inp.shape[-1]))  # (out, in)
        return [dw] if self.bias is None else [dw, g2.sum(0)]

    def _accumulate_weight_grads(self, params: list[nn.Parameter | None], inp: torch.Tensor, grad_out: torch.Tensor) -> None:
        # Into an existing gradient the GEMM accumulates itself (beta=1): no temporary dW of the
        # weight's size and no separate add over it (a W task of a 7B-sized MLP moves ~0.5 GB less);
        # into an fp32 main_grad buffer too, where the GEMM can write fp32 from its inputs' dtype
        # (:func:`gemm_accumulates`; megatron-core's gradient-accumulation fusion).
        main = getattr(self.weight, "main_grad", None)
        target = main if main is not None else self.weight.grad
        if target is None or not gemm_accumulates(target, grad_out, inp):
            super()._accumulate_weight_grads(params, inp, grad_out)
            return
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # (tokens, out)
        gemm_accumulate(target, g2.t(), inp.reshape(-1, inp.shape[-1]))
        if self.bias is not None:
            accumulate_bias_grad(self.bias, g2)

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, bias={self.bias is not None}"


def _joined(ts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One tensor over ``ts`` (contiguous, same dtype and storage, back to back along dim 0),
    sharing their memory; None when they do not lie that way."""
    first = ts[0]
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr()
    for t in ts:
        if (t.data_ptr() != end or not t.is_contiguous() or t.dtype != first.dtype
                or t.untyped_storage().data_ptr() != storage):
            return None
        end += t.numel() * t.element_size()
    shape = (sum(t.shape[0] for t in ts), *first.shape[1:])
    return first.detach().new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape)


# Column-parallel linears are grouped into one GEMM when the joined weight has at most this
# many elements. Measured on 2 H200s (tp=1 x pp=2, CUDA graphs): the small preset's Q/K/V and
# gate/up (1.6M and 5.8M elements) took its best step 7.6% shorter; 7B-shaped layers' (16.5M
# and 136M) made it 1.7-2.8% longer -- their GEMMs already run near peak apart, and the joined
# ones got slower kernels. Between the two is not measured.
GROUP_MAX_WEIGHT = 6 * 2 ** 20


def group_pays(parts: Sequence[nn.Module]) -> bool:
    """Whether ``parts`` (column-parallel linears of one input) run faster as one GEMM (:data:`GROUP_MAX_WEIGHT`)."""
    return sum(p.weight.shape[0] for p in parts) * parts[0].weight.shape[1] <= GROUP_MAX_WEIGHT


class _GroupFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, mod: "ColumnParallelGroup", *params: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)  # the parameters are arguments only so that autograd reaches them
        ctx.mod = mod
        weight, bias = mod.joined()
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, = ctx.saved_tensors
        weight, _ = ctx.mod.joined()
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        return (grad_x, None, *ctx.mod._stash_or_grad(x, grad_out))


_group_linear = fast_apply(_GroupFn)


class ColumnParallelGroup(DeferredWeightGrad):
    """Column-parallel linears that read the same input, run as one GEMM (Megatron's fused
    ``linear_qkv`` and ``linear_fc1``): Q/K/V, gate/up.

    The parts stay the layer's modules, with their parameters and names (checkpoints, TP
    blocks and the single-device reference are unchanged); the group only lays their weights
    (and biases) out back to back in one buffer (:meth:`pack`), so a single GEMM reads them
    as one ``(sum of outputs, in)`` matrix. Its output is the parts' outputs side by side
    along the last dimension; the consumer splits them (in one compiled kernel, whose
    backward writes the joined output gradient at once). Backward is then one input-gradient
    GEMM instead of one per part plus the adds of their sums, and the weight gradient one
    GEMM, added into the parts' ``.grad`` in the GEMM where those lie back to back too (they
    do when the group made them). Where something re-allocated the parts since
    (``module.to``), :meth:`joined` copies them together again; correct either way.
    """

    def __init__(self, parts: Sequence[ColumnParallelLinear]) -> None:
        super().__init__()
        if len(parts) < 2:
            raise ValueError(f"a group joins at least two linears, got {len(parts)}")
        if len({p.weight.shape[1] for p in parts}) != 1 or len({p.bias is None for p in parts}) != 1:
            raise ValueError("grouped linears need one input width and all or none with a bias")
        self._parts = tuple(parts)  # a plain tuple: not submodules, so their parameters keep their names
        self.sizes = [p.weight.shape[0] for p in parts]
        self._init_deferred()
        self.pack()

    def _lists(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        return [p.weight for p in self._parts], [p.bias for p in self._parts if p.bias is not None]

    def pack(self) -> None:
        """Put the parts' weights (and biases) back to back in one new buffer each, unless they already are."""
        for ps in self._lists():
            if not ps or ps[0].is_meta or _joined(ps) is not None:
                continue
            buf = torch.cat([p.detach() for p in ps])
            start = 0
            for p in ps:
                p.data = buf[start:start + p.shape[0]]
                start += p.shape[0]

    def joined(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The joined weight and bias (views of the parts' memory; packed again first if they moved apart)."""
        ws, bs = self._lists()
        w = _joined(ws)
        b = _joined(bs) if bs else None
        if w is None or (bs and b is None):
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("grouped linears moved apart during CUDA-graph capture; pack() them before capturing")
            self.pack()
            return self.joined()
        return w, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ws, bs = self._lists()
        return _group_linear(x, self, *ws, *bs)

    def _deferred_params(self) -> list[nn.Parameter | None]:
        ws, bs = self._lists()
        return [*ws, *bs]

    def _weight_grads(self, inp: torch.Tensor, grad_out: torch.Tensor) -> list[torch.Tensor | None]:
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # (tokens, sum of outputs)
        dw = g2.t().matmul(inp.reshape(-1, inp.shape[-1])).split(self.sizes)  # row blocks: back to back
        return [*dw, *g2.sum(0).split(self.sizes)] if self._parts[0].bias is not None else list(dw)

    def _joined_grads(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The parts' ``.grad`` as one weight (and bias) gradient, where they lie back to back
        (the group's first accumulation makes them so); None where they do not, or where a
        part adds into an fp32 ``main_grad`` instead."""
        ws, bs = self._lists()
        if any(getattr(p, "main_grad", None) is not None or p.grad is None for p in ws + bs):
            return None
        dw = _joined([p.grad for p in ws])
        db = _joined([p.grad for p in bs]) if bs else None
        return None if dw is None or (bs and db is None) else (dw, db)

    def _accumulate_weight_grads(self, params: list[nn.Parameter | None], inp: torch.Tensor, grad_out: torch.Tensor) -> None:
        ws, bs = self._lists()
        mains = [getattr(p, "main_grad", None) for p in ws]
        if all(m is not None and gemm_accumulates(m, grad_out, inp) for m in mains):  # each part's GEMM into its fp32 buffer
            g2 = grad_out.reshape(-1, grad_out.shape[-1])
            x2 = inp.reshape(-1, inp.shape[-1])
            for main, g in zip(mains, g2.split(self.sizes, dim=1)):
                gemm_accumulate(main, g.t(), x2)
            for p, g in zip(bs, g2.split(self.sizes, dim=1)):
                accumulate_bias_grad(p, g)
            return
        joined = self._joined_grads()
        if joined is None:  # per part (the first time: the parts' grads become views of one product)
            super()._accumulate_weight_grads(params, inp, grad_out)
            return
        dw, db = joined
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        dw.addmm_(g2.t(), inp.reshape(-1, inp.shape[-1]))
        if db is not None:
            add_column_sums(db, g2)

    def extra_repr(self) -> str:
        return f"in={self._parts[0].weight.shape[1]}, out={'+'.join(map(str, self.sizes))}, bias={self._parts[0].bias is not None}"


def _check_split(n: int, tp: int, rank: int, what: str) -> int:
    if tp < 1 or not 0 <= rank < tp:
        raise ValueError(f"tp rank {rank} outside 0..{tp - 1}")
    if n % tp:
        raise ValueError(f"{what} ({n}) not divisible by tp={tp}")
    return n // tp


class ColumnParallelLinear(_ParallelLinear):
    """``y_local = x @ W[rows]^T``: holds output rows ``rank*out/tp .. (rank+1)*out/tp`` of the full weight.

    Its input must be replicated over TP ranks; its input gradient is a partial sum that
    the caller all-reduces (operator f).
    """

    @classmethod
    def from_full(cls, linear: nn.Module, tp_rank: int, tp_size: int, rows: torch.Tensor | None = None) -> "ColumnParallelLinear":
        """Shard a single-device linear; ``rows`` overrides the contiguous block (index tensor)."""
        out = _check_split(linear.weight.shape[0], tp_size, tp_rank, "output features")
        idx = rows if rows is not None else torch.arange(tp_rank * out, (tp_rank + 1) * out)
        bias = getattr(linear, "bias", None)
        return cls(linear.weight.detach()[idx], None if bias is None else bias.detach()[idx])


class RowParallelLinear(_ParallelLinear):
    """``y_partial = x_local @ W[:, cols]^T``: holds input columns of the full weight.

    The output is a partial sum; the caller all-reduces it (operator g). A bias, if any,
    is added on TP rank 0 only so the sum stays exact.
    """

    @classmethod
    def from_full(cls, linear: nn.Module, tp_rank: int, tp_size: int) -> "RowParallelLinear":
        n = _check_split(linear.weight.shape[1], tp_size, tp_rank, "input features")
        bias = getattr(linear, "bias", None)
        keep_bias = bias is not None and tp_rank == 0
        return cls(linear.weight.detach()[:, tp_rank * n : (tp_rank + 1) * n], bias.detach() if keep_bias else None)
