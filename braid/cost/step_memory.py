"""Memory the optimizer step adds on top of the static state, per rank. Torch-free.

The static bytes of a mode (:mod:`braid.cost.optimizer_modes`) are not the peak: the step
allocates temporaries, and they depend on the parameters' sizes and on which rank owns
which piece of the flat gradient buffer. What the step allocates, as the code does it:

* the global gradient norm (:meth:`braid.training.optimizer.ShardedAdamW.grad_norm`,
  :func:`braid.training.grads.global_grad_norm`) sums each counted gradient's (piece's) squares
  in fp64, :data:`NORM_CHUNK` elements at a time (:func:`braid.training.grads.square_sum`): one
  fp64 copy of at most that many elements, squared in place (whole, a 545M-element embedding's
  copy and its square took 8.1 GiB beside the activations' cache). Counted on every rank of the
  sharding group under ``zero1``, on the group's first rank under ``master`` and ``plain`` (the
  others hold copies);
* the update allocates nothing: every mode runs torch's fused AdamW kernel
  (``fused=True``: :class:`~braid.training.optimizer.ShardedAdamW` on the fp32 masters, ``plain``
  on the parameters), which reads and writes the moments in place (``docs/training.md`` tells what
  the per-tensor update it replaced had held);
* ``zero1`` at more than one rank also keeps the reduce-scatter's output, an fp32 shard of
  the gradients (``4 / n`` bytes per parameter), besides the full fp32 accumulation buffer.

Parameters are listed in the order the chunks hold them (decoder layers, then embedding,
final norm and head: :func:`param_sizes`); the flat buffer is cut into ``n`` equal shards
(padded) as :class:`~braid.training.optimizer.ShardedAdamW` cuts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

FP32, FP64 = 4, 8
NORM_CHUNK = 1 << 24  # elements of a gradient the norm squares at once (a 128 MiB fp64 copy)


@dataclass(frozen=True, slots=True)
class Param:
    """A parameter's elements on one TP rank; ``expert``: an MoE layer's expert stack (under expert parallelism
    it has an optimizer of its own)."""

    numel: int
    expert: bool = False


def param_sizes(hidden: int, kv: int, ffn: int, vocab: int, layers: int, embed: bool, head: bool,
                tp: int = 1, *, half_in: bool = False, half_out: bool = False,
                moe: tuple[int, int, int] | None = None) -> list[Param]:
    """A Qwen2/Llama decoder chunk's parameters in module order (``kv``: key/value width, heads x head dim);
    ``half_in``/``half_out``: the MLP half of a layer first, the attention half of one last
    (:class:`braid.core.braiding.ChunkSpec`). ``moe``: (experts, experts on this rank, expert width) of a
    mixture of experts in every layer: the MLP half is then the norm, the router (whole on every TP
    rank) and the two expert stacks (:class:`braid.models.qwen3_moe.Qwen3MoeLayer`)."""
    h = hidden
    layer = [Param(h), Param(h * h // tp), Param(h // tp), Param(kv * h // tp),
             Param(kv // tp), Param(kv * h // tp), Param(kv // tp), Param(h * h // tp),
             Param(h), Param(ffn * h // tp), Param(ffn * h // tp), Param(h * ffn // tp)]
    if moe is not None:
        experts, local, f = moe
        layer = layer[:9] + [Param(experts * h), Param(local * 2 * f * h, expert=True), Param(local * f * h, expert=True)]
    out = layer[8:] * half_in + layer * layers + layer[:8] * half_out  # the attention half: norm, q, k, v, o
    if embed:
        out.append(Param(vocab * h // tp))
    if head:
        out += [Param(h), Param(vocab * h // tp)]
    return out


def shard_pieces(params: Sequence[Param], ways: int, rank: int) -> list[Param]:
    """The pieces of ``params`` (flattened, concatenated, padded to ``ways`` equal shards) in shard ``rank``."""
    n = sum(p.numel for p in params)
    size = -(-n // ways)
    lo, hi, start, out = rank * size, (rank + 1) * size, 0, []
    for p in params:
        a, b = max(start, lo), min(start + p.numel, hi)
        if a < b:
            out.append(Param(b - a))
        start += p.numel
    return out


def _pieces(mode: str, params: Sequence[Param], ways: int, rank: int) -> list[Param]:
    return shard_pieces(params, ways, rank) if mode == "zero1" and ways > 1 else list(params)


def norm_bytes(mode: str, params: Sequence[Param], ways: int, rank: int) -> float:
    """The global norm's fp64 copy of the largest counted piece, at most :data:`NORM_CHUNK` elements of it
    (0 on a rank that counts none)."""
    if not (mode == "zero1" and ways > 1) and rank != 0:
        return 0.0
    return float(FP64 * min(NORM_CHUNK, max((p.numel for p in _pieces(mode, params, ways, rank)), default=0)))


def step_transient_bytes(mode: str, params: Sequence[Param], ways: int, rank: int) -> float:
    """Peak bytes the step allocates above the static state on sharding-group rank ``rank`` of ``ways``:
    the norm's (the fused update allocates none)."""
    return norm_bytes(mode, params, ways, rank)


def worst_step_transient_bytes(mode: str, params: Sequence[Param], ways: int) -> float:
    """:func:`step_transient_bytes` of the worst rank of the sharding group (one pass over the shards)."""
    if not (mode == "zero1" and ways > 1):
        return step_transient_bytes(mode, params, ways, 0)  # rank 0 counts the norm
    n = sum(p.numel for p in params)
    size = -(-n // ways)
    worst, shard, filled = 0.0, [], 0  # the shard being filled: its pieces and their elements
    for p in params:
        left = p.numel
        while left:
            if filled == 0 and left >= size:  # whole shards inside one parameter are alike: one stands for them
                worst = max(worst, step_transient_bytes(mode, [Param(size)], 1, 0))
                left %= size
                continue
            take = min(left, size - filled)
            shard.append(Param(take))
            filled += take
            left -= take
            if filled == size:
                worst = max(worst, step_transient_bytes(mode, shard, 1, 0))
                shard, filled = [], 0
    # shards past the last element hold nothing (0 bytes)
    return max(worst, step_transient_bytes(mode, shard, 1, 0)) if shard else worst


def extra_state_bytes(mode: str, params: Sequence[Param], ways: int) -> float:
    """State the mode table leaves out: ``zero1``'s fp32 reduce-scatter output shard (0 otherwise)."""
    if mode != "zero1" or ways <= 1:
        return 0.0
    return float(FP32 * -(-sum(p.numel for p in params) // ways))
