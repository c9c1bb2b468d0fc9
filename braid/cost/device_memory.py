"""Device memory a rank holds: the caching allocator's reserve plus what lives outside it (issue 51). Torch-free.

What runs out on a GPU is ``total - free`` (nvidia-smi's view), not the allocator's peak the
simulator predicts. A rank holds, besides its live tensors:

* **outside the allocator** (:func:`outside_allocator_bytes`): the CUDA context (lazy module
  loading, the driver's default); the NCCL communicators of the layout the runtime creates --
  the default group (:meth:`braid.runtime.distributed.Dist.init` binds the device, so it is
  created at once), one group per dimension of :meth:`braid.runtime.distributed.ProcessGroups.create`
  that holds this rank (pp, tp, dp, cp and dp x cp; groups without it hold nothing here), the TP
  group under ``nccl-capped`` (its buffers in proportion to its thread blocks,
  :func:`braid.core.ctas.default_max_ctas` unless set), and one P2P connection per pipeline neighbour
  (:mod:`braid.runtime.p2p` sends on the default group); cuBLAS's handle and modules after the
  first GEMM (its workspaces, one per stream, come from the allocator); the kernel modules a step
  loads lazily;
* **the allocator's reserve** (:func:`reserve_bytes`): eager, the state held across steps plus the
  step's allocated peak above it times the schedule's fragmentation (the reserved over the allocated
  peak, both above the held state: the state is allocated once, in large blocks, and does not
  fragment; ``docs/costs.md`` has the measurement); a whole-step CUDA graph, the static
  state plus its private pool, the capture's allocated peak times the schedule's pool ratio
  (``torch.cuda.graph`` empties the cache before the capture and :class:`braid.runtime.graphs.GraphedStep`
  after it, so the eager warm-up's blocks go, those still held when the capture began included).
  Under the ``nccl-ce`` TP backend the static state includes its registered staging (:func:`ce_staging_bytes`);
* **the instantiated graph** of a whole-step CUDA graph (:func:`graph_exec_bytes`): the driver's copy of every
  captured node, outside the allocator and kept as long as the graph, in proportion to the unit instances the
  step captures (its kernels; under ``nccl-ce`` also the copy-engine collectives' copy nodes).

Every figure is one measurement of ``benchmarks/bench_memory_terms.py`` on 2 H100s (torch 2.11,
CUDA 13.0, NCCL 2.28.9, ``NCCL_NVLS_ENABLE=0``), rank 0 of
``benchmarks/results/memory_terms_h100x2_tp2.json`` (:data:`MEASURED`; ``tests/test_device_memory.py``
holds the constants to that file). Other cards and versions are assumed alike until measured.
Not modelled: sequence-parallel attention's extra groups (:mod:`braid.attention.attention2d`),
more than one node, other processes on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping

from braid.core.ctas import auto_tp_backend, max_ctas_for

MIB = 1 << 20
MEASURED = "benchmarks/results/memory_terms_h100x2_tp2.json"
MEASURED_CE = "benchmarks/results/memory_terms_h200x2_nccl_ce.json"
MEASURED_GRAPH = "benchmarks/results/graph_exec_h200x2.txt"
TpBackend = Literal["nccl-capped", "nccl", "nccl-ce", "gloo"]
# the dimensions ProcessGroups.create makes a group of, in its order
GROUP_DIMS = ("pp", "tp", "dp", "cp", "dp_cp")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceTerms:
    """Bytes (and ratios) of one software stack on one card; each field names the measured term it is.

    ``context``: ``context.this_process``; ``default_group``: ``nccl.default_group``; ``group``:
    ``nccl.new_group`` (two ranks, NCCL defaults); ``capped_group``: ``nccl.capped_group``, a group of
    ``capped_ctas`` thread blocks (NCCL's buffers are per channel: another cap scales it);
    ``single_group``: a group of one rank, ``(nccl.layout_groups - nccl.capped_group) / 4`` (at
    tp=2 x pp=1 the layout's groups are the capped TP group and four of one rank); ``p2p_pair``:
    ``nccl.p2p_pair``; ``blas``: ``blas.default_stream.mm`` less what it took from the allocator;
    ``step_modules``: ``step.<first schedule>.eager.uncompiled.nonallocator``; ``ce_init``: ``nccl.ce_staging`` of
    :data:`MEASURED_CE` (NCCL's copy-engine state, outside the allocator, once per communicator that runs them: the
    ``nccl-ce`` TP group's, on 2 H200s, the same stack); ``graph_unit``: an instantiated whole-step graph's bytes
    outside the allocator per unit instance and micro-batch it captures (its kernels), ``graph_collective`` and
    ``graph_ce_collective`` the more per unit at tp > 1, whose TP reduction is captured as NCCL's kernels or, under
    ``nccl-ce``, as copy nodes (:data:`MEASURED_GRAPH`: the examples' graphed steps on 2 H200s, GraphedStep's capture
    line, full recomputation, which captures a layer's forward kernels twice); ``fragmentation`` and
    ``pool_ratio`` per schedule: :func:`braid.measure.memory_terms.above_held` of ``step.<s>.eager``'s
    ``reserved_peak``, ``allocated_peak`` and held state (its allocated bytes after the steps; the stored file
    predates its own ``fragmentation_above_held`` term) and ``step.<s>.graphed.graph_pool``
    over ``step.<s>.graphed.capture_peak``; a schedule not measured takes the largest.
    """

    context: float
    default_group: float
    group: float
    capped_group: float
    capped_ctas: int
    single_group: float
    p2p_pair: float
    blas: float
    step_modules: float
    ce_init: float = 0.0
    graph_unit: float = 0.0
    graph_collective: float = 0.0
    graph_ce_collective: float = 0.0
    fragmentation: Mapping[str, float] = field(default_factory=dict)
    pool_ratio: Mapping[str, float] = field(default_factory=dict)

    def fragmentation_of(self, schedule: str) -> float:
        return self.fragmentation.get(schedule, max(self.fragmentation.values(), default=1.0))

    def pool_ratio_of(self, schedule: str) -> float:
        return self.pool_ratio.get(schedule, max(self.pool_ratio.values(), default=1.0))


# rank 0 of MEASURED, in bytes; fragmentation as (reserved - held) / (allocated - held) peak bytes, pool ratios as pool / capture peak bytes
H100_TORCH211 = DeviceTerms(
    context=645529600, default_group=887095296, group=509607936, capped_group=79691776, capped_ctas=4,
    single_group=(1713373184 - 79691776) / 4, p2p_pair=467664896, blas=102760448 - 33554432,
    step_modules=10485760, ce_init=39845888,
    # MEASURED_GRAPH: tp=1 x pp=2 rank 0, 16 micro-batches of 37 unit instances, 34 MiB; tp=2 x pp=1, 8 of 66, 106 MiB
    # under nccl-capped and 370 MiB under nccl-ce
    graph_unit=34 * MIB / 592, graph_collective=(106 * MIB - 528 * (34 * MIB / 592)) / 528,
    graph_ce_collective=(370 * MIB - 528 * (34 * MIB / 592)) / 528,
    fragmentation={"braided_v": (9820962816 - 3186454016) / (9182153216 - 3186454016),
                   "1f1b_i": (9418309632 - 3221057024) / (8438154240 - 3221057024),
                   "zb_v": (9453961216 - 3255660032) / (8472495104 - 3255660032)},
    pool_ratio={"braided_v": 8172601344 / 7551832576, "1f1b_i": 7751073792 / 6773229056,
                "zb_v": 7751073792 / 6772705792},
)
DEVICE_TERMS = H100_TORCH211  # the stack every estimate uses until another is measured
# The share of a card the planner keeps back (``braid.plan --memory-margin``): the median of how far the device
# memory in use measured above this model's prediction on the stored graphed sets, 6.4% over 36 rank-rows (worst
# 28.9%; benchmarks/results/measurements_h100x2_graphed_memory_2.json, tests/test_device_memory.py holds it to the
# file). Those are braid.bench's steps (braid.measure.device_prediction's terms, no optimizer step); a median, so a
# pick predicted at the planned limit still overran it on half of them.
MEMORY_MARGIN = 0.065


def group_sizes(tp: int, pp: int, dp: int = 1, cp: int = 1) -> dict[str, int]:
    """The size of this rank's group in each dimension :meth:`ProcessGroups.create` makes (every rank
    is in one group of each)."""
    return {"pp": pp, "tp": tp, "dp": dp, "cp": cp, "dp_cp": dp * cp}


def pipeline_peers(pp: int, pp_rank: int, placement: str = "v") -> int:
    """Distinct ranks a pipeline rank sends to or receives from: its neighbours; under the ``loop``
    placement the last rank also feeds the first (stage ``p - 1`` -> ``p``)."""
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pipeline rank {pp_rank} is not in 0..{pp - 1}")
    peers = {r for r in (pp_rank - 1, pp_rank + 1) if 0 <= r < pp}
    if placement == "loop" and pp > 2 and pp_rank in (0, pp - 1):
        peers.add(pp - 1 - pp_rank)
    return len(peers)


def nccl_bytes(terms: DeviceTerms, *, tp: int, pp: int, pp_rank: int, dp: int = 1, cp: int = 1,
               placement: str = "v", tp_backend: TpBackend = "nccl-capped", tp_max_ctas: int | None = None) -> float:
    """The communicators of one rank: the default group, one per dimension (:func:`group_sizes`) and one
    P2P connection per pipeline peer (:func:`pipeline_peers`). ``tp_max_ctas``: the capped TP group's
    thread blocks as a user sets them (:func:`braid.core.ctas.max_ctas_for`: None, by TP size; 0, NCCL's defaults)."""
    ctas = max_ctas_for(tp_max_ctas, tp)
    if tp_backend == "nccl-capped" and ctas is None:
        tp_backend = "nccl"
    total = terms.default_group + pipeline_peers(pp, pp_rank, placement) * terms.p2p_pair
    for dim, size in group_sizes(tp, pp, dp, cp).items():
        if size == 1:
            total += terms.single_group
        elif dim == "tp" and tp_backend == "nccl-capped":
            total += terms.capped_group * ctas / terms.capped_ctas
        elif not (dim == "tp" and tp_backend == "gloo"):
            total += terms.group + (terms.ce_init if dim == "tp" and tp_backend == "nccl-ce" else 0.0)
    return total


def outside_allocator_bytes(terms: DeviceTerms, *, tp: int, pp: int, pp_rank: int, dp: int = 1, cp: int = 1,
                            placement: str = "v", tp_backend: TpBackend = "nccl-capped",
                            tp_max_ctas: int | None = None) -> float:
    """Device bytes a rank holds that the caching allocator does not count (module doc)."""
    return (terms.context + nccl_bytes(terms, tp=tp, pp=pp, pp_rank=pp_rank, dp=dp, cp=cp, placement=placement,
                                       tp_backend=tp_backend, tp_max_ctas=tp_max_ctas) + terms.blas + terms.step_modules)


def graph_exec_bytes(terms: DeviceTerms, *, captured_units: float, tp: int = 1,
                     tp_backend: TpBackend = "nccl-capped") -> float:
    """The instantiated whole-step CUDA graph of a rank: ``captured_units``, the unit instances on the rank times
    the micro-batches the step runs (each captured as its tasks' kernels), at :attr:`DeviceTerms.graph_unit` each;
    at ``tp`` > 1 each unit's TP reduction (a layer unit reduces once, forward or backward) adds its captured
    collective: NCCL's kernels, or under ``nccl-ce`` copy nodes."""
    per = terms.graph_unit
    if tp > 1:
        per += terms.graph_ce_collective if tp_backend == "nccl-ce" else terms.graph_collective
    return captured_units * per


def ce_staging_bytes(tokens: int, hidden: int, itemsize: int, tp: int) -> float:
    """The ``nccl-ce`` TP backend's staging (:class:`braid.tp.ce_reduce.CEBuffers`): one registered set per size the
    TP group reduces or gathers, made in the first step and kept, inside the allocator beside any graph pool. Every
    unit's reduction (the partial (b, s, h) output, reduce-scattered under sequence sharding) and every sequence
    all-gather moves ``tokens * hidden`` elements: one set, two buffers of them padded to a multiple of ``tp`` in one
    allocation, the second at the next 4 KiB (:func:`braid.tp.ce_reduce.staging_pair`), rounded up to the 2 MiB
    the allocator gives a large block. Measured beside it (7b-layer, seq 4096, tp=2, 2 H200s,
    ``benchmarks/results/measurements_h200x2_tp2_sp_memory.txt``): what the allocator reserves outside a graphed
    step's pool rose by 86 MiB over the same layout without sequence parallelism (nccl-capped), of which this
    set is 56."""
    if tp <= 1:
        return 0.0
    n = (tokens * hidden + tp - 1) // tp * tp * itemsize
    x = -(-n // 4096) * 4096
    return float(-(-(x + n) // (2 * MIB)) * 2 * MIB)


def tp_comm_of(*, tp: int, seq_shard: bool, tokens: int, hidden: int, itemsize: int) -> tuple[TpBackend, float]:
    """The TP backend a run takes by default on CUDA (:func:`braid.core.ctas.auto_tp_backend`) and the staging it
    holds (:func:`ce_staging_bytes`); ``tokens``: one micro-batch's tokens per TP rank group."""
    if tp <= 1:
        return "nccl-capped", 0.0
    backend = auto_tp_backend(seq_shard)
    return backend, ce_staging_bytes(tokens, hidden, itemsize, tp) if backend == "nccl-ce" else 0.0


def reserve_bytes(terms: DeviceTerms, schedule: str, *, static_bytes: float, peak_bytes: float, graphed: bool) -> float:
    """The allocator's reserve: ``peak_bytes`` is the step's allocated peak above ``static_bytes`` (the
    state held across steps); the static state plus, eager, the peak times the fragmentation, graphed, the pool."""
    ratio = terms.pool_ratio_of(schedule) if graphed else terms.fragmentation_of(schedule)
    return static_bytes + ratio * peak_bytes


def device_bytes(reserve: float, outside: float) -> float:
    """In use on the device: the allocator's reserve and what lies outside it."""
    return reserve + outside


def planned_device_bytes(schedule: str, *, static_bytes: float, activation_bytes: float, step_bytes: float = 0.0,
                         graphed: bool, tp: int, pp: int, pp_rank: int, dp: int = 1, cp: int = 1, placement: str = "v",
                         tp_backend: TpBackend = "nccl-capped", ce_staging: float = 0.0, captured_units: float = 0.0,
                         terms: DeviceTerms = DEVICE_TERMS) -> float:
    """What the planner checks against the card's memory on pipeline rank ``pp_rank``: the allocator's reserve
    and the bytes outside it. ``tp_backend``: what runs the TP collectives (:func:`braid.core.ctas.auto_tp_backend`);
    ``ce_staging``: nccl-ce's staging (:func:`ce_staging_bytes`), held from the first step. ``static_bytes``: the
    state held across steps (weights, gradients, optimizer state); ``activation_bytes``: the step's activation
    peak above it; ``step_bytes``: the optimizer step's temporaries. Eager, the allocated peak is the static
    state and the larger of the activations and the temporaries (the update runs after the last backward),
    the part above the state times the schedule's fragmentation. ``graphed`` (a whole-step CUDA graph, what the examples run on CUDA by
    default: :func:`braid.core.capture.captured_by_default`): the graph's private pool keeps the activations'
    bytes between replays, and the optimizer step, run after the replay outside the graph, allocates its
    temporaries beside it, and the instantiated graph holds ``captured_units`` (:func:`graph_exec_bytes`). Its two
    eager warm-up steps are not priced apart."""
    static_bytes += ce_staging
    if graphed:
        reserve = reserve_bytes(terms, schedule, static_bytes=static_bytes + step_bytes, peak_bytes=activation_bytes,
                                graphed=True)
    else:
        reserve = reserve_bytes(terms, schedule, static_bytes=static_bytes, peak_bytes=max(activation_bytes, step_bytes),
                                graphed=False)
    return device_bytes(reserve, planned_outside_bytes(graphed=graphed, tp=tp, pp=pp, pp_rank=pp_rank, dp=dp, cp=cp,
                                                       placement=placement, tp_backend=tp_backend,
                                                       captured_units=captured_units, terms=terms))


def planned_outside_bytes(*, graphed: bool, tp: int, pp: int, pp_rank: int, dp: int = 1, cp: int = 1, placement: str = "v",
                          tp_backend: TpBackend = "nccl-capped", tp_max_ctas: int | None = None,
                          captured_units: float = 0.0, terms: DeviceTerms = DEVICE_TERMS) -> float:
    """The part of :func:`planned_device_bytes` outside the allocator: :func:`outside_allocator_bytes` and, for a
    whole-step CUDA graph, the instantiated graph (:func:`graph_exec_bytes`) -- what a ``--memory-cap`` leaves the
    allocator less (``examples/train_fit.py``)."""
    outside = outside_allocator_bytes(terms, tp=tp, pp=pp, pp_rank=pp_rank, dp=dp, cp=cp, placement=placement,
                                      tp_backend=tp_backend, tp_max_ctas=tp_max_ctas)
    if graphed:
        outside += graph_exec_bytes(terms, captured_units=captured_units, tp=tp, tp_backend=tp_backend)
    return outside
