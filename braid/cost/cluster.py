"""Costs of a whole job: nodes, data and sequence parallelism, on top of the per-chunk cost model.

:func:`braid.cost.costs.analytic_costs` prices one pipeline (tp x pp) on one NVLink island. A
job of ``tp * cp * pp * dp`` GPUs adds (all priced by the links they cross):

* **Nodes** (:class:`Cluster`): ranks are laid out as :class:`braid.core.topology.Topology`'s
  grid ``(dp, pp, cp, tp)``, tensor parallel fastest, ``gpus_per_node`` consecutive ranks per
  node. A group of ``size`` ranks ``stride`` apart stays inside a node when
  ``stride * size <= gpus_per_node``; otherwise its ring runs at the NIC rate
  (``Hardware.inter_node_bytes_per_s``, ``inter_node_latency_s``). Pipeline P2P between two
  stages on different nodes goes over the NIC too. Ring collectives: all-reduce moves
  ``2(n-1)/n`` of the bytes, reduce-scatter, all-gather and all-to-all ``(n-1)/n``.
* **Sequence parallelism** ``cp = hp x (cp / hp)`` (LoongTrain 2D-Attention,
  :mod:`braid.attention`): every rank holds ``seq / cp`` tokens; per layer the Attn unit adds
  four all-to-alls over the HP group in forward (q, k, v in; output back) and four in
  backward, and a (double) ring over the CP ranks whose K/V hops hide behind the attention
  blocks: only ``max(0, hop - block)`` per hop is exposed; the inner rings of ``w`` ranks
  and the outer ring are priced by their own links. ``head_first`` places the HP ranks
  next to each other (stride ``tp``), ``context_first`` the CP ranks.
* **Recomputation** (``recompute=True``, full per layer, ``--recompute full`` of the examples):
  :func:`braid.cost.recompute_costs.full_recompute` -- the layer's first backward unit re-runs its
  forward (Attn's all-reduce included); only each layer's input stays saved.

The data-parallel gradient reduction and the optimizer step are priced by :func:`dp_costs`
and scheduled by the simulator (:func:`simulator.dp.dp_tail`: per rank, the gradient of each
chunk is reduced over the dp x cp group as soon as its last weight gradient is done, one chunk
after another on its own lane beside the cool-down; then the optimizer step, sharded with ZeRO-1).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Mapping, Sequence

from braid.core.braiding import Unit
from braid.cost.costs import ChunkCosts, CostModel, Layout, UnitCost, analytic_costs
from braid.cost.hardware import Hardware, ring_s
from braid.core.ir import rank_chunk_of
from braid.cost.catalog import ModelConfig
from braid.cost.moe_costs import MoeLayout
from braid.cost.recompute_costs import full_recompute
from braid.cost.optimizer_modes import DEFAULT_OPTIMIZER, OptimizerMode, mode_bytes
from braid.cost.step_memory import Param, extra_state_bytes, param_sizes, worst_step_transient_bytes

SpPlacement = Literal["head_first", "context_first"]


@dataclass(frozen=True, slots=True)
class Cluster:
    """Nodes of ``gpus_per_node`` GPUs of one hardware preset."""

    hw: Hardware
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")

    def crosses(self, stride: int, size: int) -> bool:
        """Whether a group of ``size`` ranks ``stride`` apart spans more than one node."""
        return size > 1 and stride * size > self.gpus_per_node

    def _link(self, stride: int, size: int) -> tuple[float, float]:
        if self.crosses(stride, size):
            return self.hw.inter_node_bytes_per_s, self.hw.inter_node_latency_s
        return self.hw.ar_bus_bytes_per_s, self.hw.ar_latency_s

    def all_reduce(self, nbytes: float, size: int, stride: int) -> float:
        return ring_s(nbytes, size, *self._link(stride, size), passes=2)

    def reduce_scatter(self, nbytes: float, size: int, stride: int) -> float:
        """Also the time of an all-gather of ``nbytes`` per rank."""
        return ring_s(nbytes, size, *self._link(stride, size))

    def all_to_all(self, nbytes: float, size: int, stride: int) -> float:
        """An all-to-all of ``nbytes`` per rank: ``(size - 1) / size`` of them leave it (ring model)."""
        return ring_s(nbytes, size, *self._link(stride, size))

    def p2p(self, nbytes: float, cross_node: bool) -> float:
        if cross_node:
            return self.hw.inter_node_latency_s + nbytes / self.hw.inter_node_bytes_per_s
        return self.hw.p2p_latency_s + nbytes / self.hw.p2p_bytes_per_s


@dataclass(frozen=True, slots=True)
class Parallel:
    """Degrees and options of one job layout (world = tp * cp * pp * dp).

    ``cp``: sequence-parallel degree d_sp = hp x (cp / hp); ``ring``: inner ring size w of
    the double ring (dividing cp / hp; None = one ring); ``sp_placement``: which SP group is
    on adjacent ranks; ``micro_batch_size``: samples per micro-batch. ``ep``: expert-parallel
    degree of an MoE model (carved from the dp ranks: ``ep`` consecutive DP ranks share the
    experts; cp must be 1, as in the runtime); ``moe_imbalance``: the busiest expert rank's routed
    tokens over the mean (:mod:`braid.cost.moe_costs`); ``moe_dispatch``: how the rows cross expert-parallel
    ranks ("splits", or "padded": fixed blocks).
    """

    tp: int
    pp: int
    dp: int
    cp: int = 1
    hp: int = 1
    ring: int | None = None
    sp_placement: SpPlacement = "head_first"
    micro_batch_size: int = 1
    recompute: bool = False
    optimizer: OptimizerMode = DEFAULT_OPTIMIZER
    seq_shard: bool = False  # sequence parallelism inside TP (braid.tp.seq_shard; the examples' --sequence-parallel)
    ep: int = 1
    moe_imbalance: float = 1.0
    moe_dispatch: str = "splits"  # "padded": the row all-to-alls in fixed blocks (braid.cost.moe_costs)

    def __post_init__(self) -> None:
        mode_bytes(self.optimizer, 2)  # an unknown mode: ValueError naming the valid ones
        if self.cp % self.hp or (self.ring is not None and (self.cp // self.hp) % self.ring):
            raise ValueError(f"hp={self.hp} must divide cp={self.cp} and ring={self.ring} must divide cp/hp")
        MoeLayout(ep=self.ep, imbalance=self.moe_imbalance)  # a bad degree or imbalance: ValueError
        if self.dp % self.ep:
            raise ValueError(f"--ep {self.ep} must divide the data-parallel ranks (dp={self.dp}): expert-parallel ranks are carved from them")
        if self.ep > 1 and self.cp > 1:
            raise ValueError(f"--ep {self.ep} runs with cp=1 only (got cp={self.cp})")

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def ep_link(self) -> tuple[int, int]:
        """(size, stride) of an expert-parallel group: ``ep`` consecutive DP ranks of the grid (dp, pp, cp, tp)."""
        return self.ep, self.tp * self.cp * self.pp

    def edp_link(self) -> tuple[int, int]:
        """(size, stride) of an expert-data-parallel group (the ranks holding the same experts: every
        ``ep``-th DP rank); at ``ep`` 1 the dp x cp group of the other parameters."""
        if self.ep == 1:
            return _dp_link(self)
        return self.dp // self.ep, self.ep * self.tp * self.cp * self.pp

    def sp_strides(self) -> tuple[int, int]:
        """Rank strides of the HP group and of the CP (ring) group."""
        ring_ranks = self.cp // self.hp
        if self.sp_placement == "head_first":
            return self.tp, self.tp * self.hp
        return self.tp * ring_ranks, self.tp


def moe_layout(cluster: Cluster, par: Parallel) -> MoeLayout:
    """The MoE layers' expert parallelism under ``par``: the expert-parallel group's link (the NIC
    once the group spans nodes: :meth:`Cluster.crosses`)."""
    size, stride = par.ep_link()
    bw, lat = cluster._link(stride, size)
    return MoeLayout(ep=par.ep, imbalance=par.moe_imbalance, a2a_bytes_per_s=bw, a2a_latency_s=lat,
                     padded=par.moe_dispatch == "padded")


def job_costs(model: ModelConfig, cluster: Cluster, par: Parallel, layout: Layout,
              last_stage_lighter: float | None = None) -> CostModel:
    """The cost model of one pipeline of the job (see the module doc); ``model.seq`` is the full sequence.
    ``last_stage_lighter``: the layer split's (:func:`braid.cost.costs.model_stage_layers`; None: the paper's)."""
    hw, t, d = cluster.hw, par.tp, model.dtype_bytes
    if par.recompute and last_stage_lighter is not None and last_stage_lighter != int(last_stage_lighter):
        raise ValueError(f"full recomputation re-runs whole layers; last_stage_lighter {last_stage_lighter} cuts one in half")
    if model.seq % par.cp:
        raise ValueError(f"cp={par.cp} must divide the sequence length {model.seq}")
    local = model.with_(seq=model.seq // par.cp, micro_batch_size=par.micro_batch_size)
    tp_bw, tp_lat = cluster._link(1, t)
    base = analytic_costs(local, replace(hw, ar_bus_bytes_per_s=tp_bw, ar_latency_s=tp_lat), layout,
                          last_stage_lighter=last_stage_lighter, seq_shard=par.seq_shard, moe=moe_layout(cluster, par))
    lm = _lm_units(base, local, model.seq, cluster, par)
    boundary = local.tokens * model.hidden * d / (t if par.seq_shard else 1)
    chunks = {}
    for (r, c), cc in base.chunks.items():
        units = dict(cc.units)
        if lm is not None and not (model.vit is not None and cc.spec.embed):
            units.update(lm)
        stage = _stage_of(layout, r, c)
        nxt = stage + 1 if stage + 1 < layout.num_stages else stage - 1
        rn = rank_chunk_of(layout.placement, layout.p, nxt)[0] if layout.num_stages > 1 else r
        stride = t * par.cp
        cross = (r * stride) // cluster.gpus_per_node != (rn * stride) // cluster.gpus_per_node
        chunks[(r, c)] = ChunkCosts(cc.spec, units, cluster.p2p(boundary, cross))
    return replace(base, chunks=chunks, model_flops_per_sample=base.model_flops_per_sample,
                   meta={**base.meta, "cp": par.cp, "hp": par.hp, "gpus_per_node": cluster.gpus_per_node})


def _stage_of(layout: Layout, rank: int, chunk: int) -> int:
    for s in range(layout.num_stages):
        if rank_chunk_of(layout.placement, layout.p, s) == (rank, chunk):
            return s
    raise ValueError(f"no stage on rank {rank} chunk {chunk}")


def _lm_units(base: CostModel, local: ModelConfig, seq: int, cluster: Cluster, par: Parallel) -> dict[Unit, UnitCost] | None:
    """The LM layer units with sequence-parallel attention and recomputation folded in (None: unchanged)."""
    if par.cp == 1 and not par.recompute:
        return None
    hw, t, d = cluster.hw, par.tp, local.dtype_bytes
    some = next(cc for cc in base.chunks.values() if cc.spec.layers and not (local.vit is not None and cc.spec.embed))
    units = {u: some.units[u] for u in (Unit.PRE_ATTN, Unit.ATTN, Unit.PRE_MLP, Unit.MLP)}
    if par.cp > 1:
        hd, tok = local.head_dim, local.tokens
        heads_t = local.heads // t
        kv_t = max(local.kv_heads // t, 1)
        core_local = 4 * tok * local.seq * hd * heads_t * 0.5 / hw.attn_flops
        core_full = core_local * par.cp  # local queries against the whole sequence's keys
        hp_stride, cp_stride = par.sp_strides()
        a2a_in = cluster.all_to_all(tok * (heads_t + 2 * kv_t) * hd * d, par.hp, hp_stride)
        a2a_out = cluster.all_to_all(tok * heads_t * hd * d, par.hp, hp_stride)
        ring = _ring_exposed(cluster, par, cp_stride, tok * par.hp * 2 * max(kv_t // par.hp, 1) * hd * d,
                             core_full / (par.cp // par.hp))
        att = units[Unit.ATTN]
        units[Unit.ATTN] = replace(att, f=att.f + core_full - core_local + a2a_in + a2a_out + ring,
                                   b=att.b + 2 * (core_full - core_local) + a2a_in + a2a_out + 2 * ring)
    if par.recompute:
        units = full_recompute(units, local.tokens * local.hidden * d)
    return units


def _ring_exposed(cluster: Cluster, par: Parallel, stride: int, kv_bytes: float, block_s: float) -> float:
    """Exposed time of a (double) ring over the CP ranks: each K/V hop beyond its attention block."""
    n = par.cp // par.hp
    if n == 1:
        return 0.0
    w = par.ring or n
    inner = cluster.p2p(kv_bytes, cluster.crosses(stride, w))
    outer = cluster.p2p(kv_bytes, cluster.crosses(stride, n)) if n > w else 0.0
    hops_inner = (w - 1) * (n // w)
    hops_outer = n // w - 1
    return hops_inner * max(0.0, inner - block_s) + hops_outer * max(0.0, outer - block_s)


# ----------------------------------------------------------------------------------------
# Parameters, static memory, data-parallel reduction and optimizer step
# ----------------------------------------------------------------------------------------
def chunk_param_parts(model: ModelConfig, costs: CostModel, rank: int, chunk: int, ep: int = 1) -> tuple[float, float]:
    """(other, expert) parameters of one (rank, chunk) on one TP rank (embedding and head vocabulary-split).
    An MoE layer's experts: ``E / (t * ep)`` whole experts (TP ranks split the experts, expert-parallel
    ranks that share: :mod:`braid.runtime.expert_parallel`), its router whole on every TP rank. At
    ``ep`` 1 every parameter is reduced and stepped together: the experts are counted in the first."""
    spec, t = costs.chunks[(rank, chunk)].spec, costs.layout.tp
    n, experts = 0.0, 0.0
    if model.vit is not None and spec.embed:
        v = model.vit
        n += spec.layers * (4 * v.hidden * v.hidden + 2 * v.hidden * v.ffn) / t + v.patch_pixels * v.hidden
        n += (16 * v.hidden * v.hidden + 4 * v.hidden * model.hidden) / t  # patch merger
    elif model.experts:
        attn_half, _ = model.lm_layer_halves()
        mlp_layers = spec.layers + spec.half_in
        n += (spec.layers + spec.half_out) * attn_half / t + mlp_layers * model.experts * model.hidden
        experts = mlp_layers * model.expert_params() / (t * ep)
    else:
        attn_half, mlp_half = model.lm_layer_halves()
        n += (spec.layers * model.lm_layer_params() + spec.half_out * attn_half + spec.half_in * mlp_half) / t
    n += (spec.embed + spec.head) * model.vocab * model.hidden / t
    return (n + experts, 0.0) if ep == 1 else (n, experts)


def chunk_params(model: ModelConfig, costs: CostModel, rank: int, chunk: int, ep: int = 1) -> float:
    """Parameters of one (rank, chunk) on one TP rank (:func:`chunk_param_parts`, summed)."""
    return sum(chunk_param_parts(model, costs, rank, chunk, ep))


def rank_param_list(model: ModelConfig, costs: CostModel, rank: int, ep: int = 1) -> list[Param]:
    """One TP rank's parameters of pipeline rank ``rank``, chunk by chunk in module order (what the
    optimizer step's temporaries depend on: :mod:`braid.cost.step_memory`)."""
    t, out = costs.layout.tp, []
    moe = (model.experts, model.experts // (t * ep), model.moe_ffn) if model.experts else None
    for c in range(costs.layout.v):
        spec = costs.chunks[(rank, c)].spec
        if model.vit is not None and spec.embed:
            v = model.vit
            vit = [Param(v.hidden * v.hidden // t)] * 4 + [Param(v.hidden * v.ffn // t)] * 2
            out += vit * spec.layers + [Param(v.patch_pixels * v.hidden), Param(16 * v.hidden * v.hidden // t),
                                        Param(4 * v.hidden * model.hidden // t)]
            out += param_sizes(model.hidden, model.kv_heads * model.head_dim, model.ffn, model.vocab, 0, True, False, t)
        else:
            out += param_sizes(model.hidden, model.kv_heads * model.head_dim, model.ffn, model.vocab, spec.layers,
                               bool(spec.embed), bool(spec.head), t, half_in=spec.half_in, half_out=spec.half_out, moe=moe)
    return out


def rank_param_parts(model: ModelConfig, costs: CostModel, rank: int, ep: int = 1) -> tuple[float, float]:
    """(other, expert) parameters of one TP rank of pipeline rank ``rank`` (:func:`chunk_param_parts`)."""
    parts = [chunk_param_parts(model, costs, rank, c, ep) for c in range(costs.layout.v)]
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def rank_params(model: ModelConfig, costs: CostModel, rank: int, ep: int = 1) -> float:
    return sum(chunk_params(model, costs, rank, c, ep) for c in range(costs.layout.v))


def static_bytes(model: ModelConfig, costs: CostModel, par: Parallel, rank: int) -> float:
    """Weights, gradients and optimizer states of one rank: the optimizer mode's bytes per
    parameter (:mod:`braid.cost.optimizer_modes`), sharded over the dp x cp group under ``zero1``
    (an expert-parallel run's experts over their expert-data-parallel group)."""
    dense, experts = rank_param_parts(model, costs, rank, par.ep)
    d, ways = model.dtype_bytes, par.dp * par.cp
    return dense * mode_bytes(par.optimizer, d, ways).state + experts * mode_bytes(par.optimizer, d, ways // par.ep).state


def _dp_link(par: Parallel) -> tuple[int, int]:
    """(size, stride) of the gradient-reduction group (dp x cp), by its widest part."""
    if par.dp > 1:
        return par.dp * par.cp, par.tp * par.cp * par.pp
    return par.cp, par.tp


def reduce_time(model: ModelConfig, costs: CostModel, cluster: Cluster, par: Parallel, rank: int, chunk: int) -> float:
    """Time to reduce one chunk's gradients over the dp x cp group: the mode's gradient bytes
    (fp32 with masters, else the model dtype), all-reduced or (``zero1``) reduce-scattered; an
    expert-parallel run's expert gradients then over the expert-data-parallel group (:meth:`Parallel.edp_link`)."""
    dense, experts = chunk_param_parts(model, costs, rank, chunk, par.ep)
    t = _collective(cluster, model, par, par.dp * par.cp, dense, "reduce", *_dp_link(par))
    return t + (_collective(cluster, model, par, par.dp * par.cp // par.ep, experts, "reduce", *par.edp_link()) if experts else 0.0)


def _collective(cluster: Cluster, model: ModelConfig, par: Parallel, ways: int, params: float, kind: str, size: int,
                stride: int) -> float:
    """The mode's gradient reduction (``kind`` "reduce") or weight all-gather ("gather") of ``params`` over a group."""
    mb = mode_bytes(par.optimizer, model.dtype_bytes, ways)
    if kind == "gather":
        return cluster.reduce_scatter(mb.gather * params, size, stride) if mb.gather else 0.0
    return (cluster.reduce_scatter if mb.reduce_scatter else cluster.all_reduce)(mb.reduce * params, size, stride)


@dataclass(frozen=True, slots=True)
class DpCosts:
    """Per rank of one pipeline (every data-parallel replica does the same).

    ``reduce_s[(rank, chunk)]``: reducing the chunk's gradients (all-reduce, or a
    reduce-scatter when ``reduce_kind`` is ``"RS"``); ``step_s[rank]``: the update at HBM
    speed; ``gather_s[rank]``: the all-gather of the updated weights (0 without sharding);
    ``static_bytes[rank]``: weights, gradients and optimizer state; ``mode``: the optimizer mode;
    ``extra_bytes[rank]``: state the mode's table leaves out (``zero1``'s reduce-scatter shard);
    ``step_bytes[rank]``: the optimizer step's temporaries, worst over the data-parallel ranks
    (:mod:`braid.cost.step_memory`). The peak of a rank: :meth:`peak_bytes`.
    """

    reduce_s: Mapping[tuple[int, int], float]
    step_s: Sequence[float]
    gather_s: Sequence[float]
    static_bytes: Sequence[float]
    mode: str
    reduce_kind: str = "AR"
    extra_bytes: Sequence[float] = ()
    step_bytes: Sequence[float] = ()

    def held_bytes(self, rank: int) -> float:
        """The state held across steps: static state and what the mode's table leaves out."""
        return self.static_bytes[rank] + (self.extra_bytes[rank] if self.extra_bytes else 0.0)

    def step_temp_bytes(self, rank: int) -> float:
        """The optimizer step's temporaries."""
        return self.step_bytes[rank] if self.step_bytes else 0.0

    def peak_bytes(self, rank: int, activation_bytes: float) -> float:
        """Static state + the larger of the activation peak and the step's temporaries (never at once in an
        eager step: the update runs after the last backward; a captured step's pool keeps the activations'
        bytes, :func:`braid.cost.device_memory.planned_device_bytes`)."""
        return self.held_bytes(rank) + max(activation_bytes, self.step_temp_bytes(rank))



def dp_costs(model: ModelConfig, costs: CostModel, cluster: Cluster, par: Parallel) -> DpCosts:
    """The data-parallel tail's costs per rank of one pipeline (scheduled by :func:`simulator.dp.dp_tail`).

    Gradients of each chunk are all-reduced (``plain``, ``master``) or reduce-scattered
    (``zero1``) over the dp x cp group; the step updates the rank's (shard of the) parameters
    at HBM speed, and ``zero1`` all-gathers the updated weights (bytes per parameter:
    :mod:`braid.cost.optimizer_modes`). Under expert parallelism (``par.ep`` > 1) the experts
    have an optimizer of their own over the expert-data-parallel group (``dp / ep`` ranks,
    :meth:`Parallel.edp_link`), stepped after the other's.
    """
    lay = costs.layout
    ways = par.dp * par.cp
    eways = ways // par.ep
    mb, me = mode_bytes(par.optimizer, model.dtype_bytes, ways), mode_bytes(par.optimizer, model.dtype_bytes, eways)
    reduce = {(r, c): reduce_time(model, costs, cluster, par, r, c) for r in range(lay.p) for c in range(lay.v)}
    parts = [rank_param_parts(model, costs, r, par.ep) for r in range(lay.p)]
    gather = [_collective(cluster, model, par, ways, n, "gather", *_dp_link(par))
              + (_collective(cluster, model, par, eways, e, "gather", *par.edp_link()) if e else 0.0) for n, e in parts]
    plist = [rank_param_list(model, costs, r, par.ep) for r in range(lay.p)]
    if par.ep > 1:  # two optimizers, one after the other: the worse step, both reduce-scatter shards
        split = [([p for p in ps if not p.expert], [p for p in ps if p.expert]) for ps in plist]
        step = [max(worst_step_transient_bytes(par.optimizer, d, ways),
                    worst_step_transient_bytes(par.optimizer, e, eways)) for d, e in split]
        extra = [extra_state_bytes(par.optimizer, d, ways) + extra_state_bytes(par.optimizer, e, eways) for d, e in split]
    else:
        step = [worst_step_transient_bytes(par.optimizer, ps, ways) for ps in plist]
        extra = [extra_state_bytes(par.optimizer, ps, ways) for ps in plist]
    return DpCosts(reduce, [(mb.step * n + me.step * e) / cluster.hw.hbm_bytes_per_s for n, e in parts], gather,
                   [static_bytes(model, costs, par, r) for r in range(lay.p)], par.optimizer,
                   "RS" if mb.reduce_scatter else "AR", extra, step)
