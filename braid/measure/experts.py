"""Mixture-of-experts measurements of a profile or bench job at expert parallelism ``ep``: the job's groups,
the routed tokens per expert and per expert-parallel rank, and the all-to-all itself.

A job of ``pc.ep > 1`` runs ``dp = ep`` data-parallel replicas of the ``tp * pp`` layout; every MoE
layer's experts are sharded over the replicas of one (pp, tp) slot as the examples shard them
(:func:`braid.runtime.expert_parallel.shard_experts`), and each replica reads micro-batches of its own.

**Routing counts.** Each MoE layer's dispatcher is wrapped (:class:`CountingDispatch`) so that every
micro-batch's rows per expert -- the counts the dispatch plans the all-to-all from -- are summed on
the device, with no host read. :func:`expert_load` joins every rank's sums (the data-parallel
replicas' tokens; one TP rank of each, which all see the same tokens) per layer -- what a measured
trace carries (:class:`braid.io.trace.ExpertLoad`, ``meta.expert_load``) -- and :func:`routing_summary`
gives its figures (:meth:`~braid.io.trace.ExpertLoad.summary`): tokens per expert and rows
per device holding experts (TP slice x expert-parallel share, :class:`braid.models.moe_dispatch.ExpertSlice`),
and the imbalance factors: the busiest over the mean, per layer, then the mean over layers (what the
cost model's ``imbalance`` stands for: :mod:`braid.cost.moe_costs`) and the worst layer.

**The all-to-all.** :func:`a2a_figures` times, on the expert-parallel group, one exchange of a
balanced dispatch's rows at this shape (``tokens * k / tp`` rows of ``hidden`` elements per rank,
even splits) and the exchange of the per-expert counts that precedes it, the ranks started together
(a barrier) as the TP all-reduce is timed (:func:`braid.measure.units._comm_figures`).
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from braid.io.trace import ExpertLoad
from braid.measure.pair import collective_pair, pair_slowdown_of
from braid.models.moe_dispatch import Exchange, RowPlan


def graph_reason(pc: Any) -> str | None:
    """Why braid's runs of an MoE ``pc`` on CUDA run eager (:func:`braid.runtime.graphs.config_reason`: the
    routing counts are read on the host at tp > 1, or at ep > 1 with the splits dispatcher); None where
    nothing stops a graph for that."""
    from braid.runtime.graphs import config_reason

    if pc.device != "cuda" or not getattr(pc.model, "experts", 0):
        return None
    return config_reason(pc.device, tp=pc.tp, ep=pc.ep, moe=True, moe_dispatch=pc.moe_dispatch)


def job_groups(pc: Any, timeout_s: float = 120.0) -> tuple[Any, Any]:
    """This rank's :class:`braid.runtime.distributed.ProcessGroups` of ``pc``'s layout (dp = ``pc.dp``) and,
    at ``pc.ep > 1``, its :class:`braid.runtime.expert_parallel.ExpertGroups` (None otherwise). Collective."""
    from braid.core.topology import Topology
    from braid.runtime.distributed import ProcessGroups
    from braid.runtime.expert_parallel import ExpertGroups

    topo = Topology(pc.world_size, pp=pc.pp, tp=pc.tp, dp=pc.dp)
    groups = ProcessGroups.create(topo, tp_backend="auto" if pc.tp_backend == "all" else pc.tp_backend, timeout_s=timeout_s,
                                  tp_max_ctas=pc.tp_max_ctas, seq_shard=pc.seq_shard)
    experts = (ExpertGroups.create(topo, groups.rank, pc.ep, timeout_s=timeout_s, max_ctas=pc.ep_max_ctas or None,
                                   backend=pc.ep_backend, device=pc.device) if pc.ep > 1 else None)
    return groups, experts


class CountingDispatch:
    """A dispatcher that sums the rows per expert of every micro-batch it plans (on the device) and
    plans as ``inner`` does."""

    def __init__(self, inner: Any, num_experts: int) -> None:
        self.inner = inner
        self.total: torch.Tensor | None = None
        self.num_experts = num_experts

    @property
    def moves(self) -> bool:
        return self.inner.moves

    @property
    def host_free(self) -> bool:
        return getattr(self.inner, "host_free", False)

    def plan(self, counts: torch.Tensor, rows: int | None = None) -> RowPlan:
        if self.total is None or self.total.device != counts.device:
            self.total = torch.zeros(self.num_experts, dtype=torch.int64, device=counts.device)
        self.total += counts
        return self.inner.plan(counts, rows)


class RouteCounts:
    """The :class:`CountingDispatch` of every MoE layer of a rank's chunks, by global layer index."""

    def __init__(self, chunks: dict[int, Any]) -> None:
        from braid.models.moe import Experts

        self.layers: dict[int, CountingDispatch] = {}
        for ch in chunks.values():
            for name, mod in ch.named_modules():
                if not isinstance(getattr(mod, "experts", None), Experts) or not hasattr(mod, "dispatcher"):
                    continue
                label = ch.global_name(f"{name}.experts.gate_up.weight").split(".experts")[0]  # "layers.7" (a VLM: "lm.layers.7")
                num = int(getattr(mod, "num_experts", 0) or mod.experts.count)
                counter = mod.dispatcher if isinstance(mod.dispatcher, CountingDispatch) else CountingDispatch(mod.dispatcher, num)
                mod.dispatcher = counter
                self.layers[int(label.rsplit(".", 1)[1])] = counter

    def reset(self) -> None:
        for c in self.layers.values():
            if c.total is not None:
                c.total.zero_()

    def read(self) -> dict[int, list[int]]:
        """Rows per expert of every layer since the last :meth:`reset` (a host read)."""
        return {layer: (c.total.tolist() if c.total is not None else [0] * c.num_experts) for layer, c in sorted(self.layers.items())}


def count_routes(chunks: dict[int, Any]) -> RouteCounts | None:
    """Wrap the MoE layers of ``chunks`` (:class:`RouteCounts`); None for a dense model."""
    rc = RouteCounts(chunks)
    return rc if rc.layers else None


def expert_load(per_rank: Sequence[dict | None], ep: int, tp: int, scope: str = "") -> ExpertLoad | None:
    """The ranks' :meth:`RouteCounts.read` results (one entry per rank that counted: one TP rank per
    replica; None entries are skipped) summed per layer: what a measured trace carries
    (``meta.expert_load``). None where nothing was counted."""
    layers: dict[int, list[int]] = {}
    for got in per_rank:
        for layer, counts in (got or {}).items():
            acc = layers.setdefault(int(layer), [0] * len(counts))
            layers[int(layer)] = [a + b for a, b in zip(acc, counts)]
    if not layers or not any(sum(c) for c in layers.values()):
        return None
    return ExpertLoad({k: tuple(v) for k, v in sorted(layers.items())}, ep, tp, scope)


def routing_summary(per_rank: Sequence[dict | None], ep: int, tp: int) -> dict[str, Any] | None:
    """Tokens per expert and rows per expert-holding device of the ranks' counts (:func:`expert_load`),
    and the imbalance factors (module doc; :meth:`braid.io.trace.ExpertLoad.summary`). None where nothing
    was counted."""
    load = expert_load(per_rank, ep, tp)
    return load.summary() if load is not None else None


def format_routing(r: dict[str, Any], where: str) -> str:
    """One line: the imbalance factors, tokens per expert and rows per expert-parallel rank."""
    tok = r["tokens_per_expert"]
    show = " ".join(map(str, tok)) if len(tok) <= 16 else f"min {min(tok)} mean {sum(tok) / len(tok):.0f} max {max(tok)}"
    return (f"expert load ({where}): busiest/mean per expert {r['expert_imbalance']:.3f} (worst layer "
            f"{r['expert_imbalance_max']:.3f}), per EP rank {r['ep_imbalance']:.3f} (worst layer {r['ep_imbalance_max']:.3f}); "
            f"tokens per expert {show}; rows per EP rank {' '.join(map(str, r['rows_per_ep_rank']))}")


def a2a_figures(pc: Any, experts: Any, time_fn: Callable[[Callable[[], Any]], tuple[float, Any]], dev: torch.device,
                n: int) -> dict[str, float]:
    """The all-to-all at this shape on the expert-parallel group (module doc): ``a2a_s`` (one balanced row
    exchange; padded, ``pc.moe_dispatch``: the ep blocks it always moves),
    ``a2a_counts_s`` (the per-expert counts' exchange), ``a2a_bytes`` (a rank's rows, bytes) and
    ``a2a_rows``; ``time_fn`` times a callable (a sync before and after). On CUDA also the exchange beside
    GEMMs (:func:`braid.measure.pair.collective_pair`: ``a2a_beside_s``, ``a2a_stretch``, ``a2a_gemm_alone_s``,
    ``a2a_gemm_beside_s``, ``a2a_together_s``) and from them ``a2a_slowdown``, compute's slowdown beside an
    in-flight all-to-all (:func:`braid.measure.pair.pair_slowdown_of`). Collective over the group."""
    from braid.measure.config import DTYPES

    if experts is None:
        return {}
    m = pc.model
    ep, group = experts.ep, experts.ep_group
    tokens = pc.micro_batch_size * pc.seq
    rows = -(-tokens * m.experts_per_token // pc.tp // ep) * ep  # a whole number per peer
    if getattr(pc, "moe_dispatch", "splits") == "padded":  # ep blocks of the most one peer can get (tp=1)
        rows = ep * tokens * min(m.experts_per_token, m.experts // ep)
    x = torch.randn(rows, m.hidden, dtype=DTYPES[pc.dtype], device=dev)  # (rows, h)
    out = torch.empty_like(x)
    counts = torch.ones(m.experts // pc.tp, dtype=torch.int64, device=dev)
    got = torch.empty_like(counts)

    def timed(fn: Callable[[], Any]) -> float:
        vals = []
        for _ in range(n + 1):
            dist.barrier(group=group)  # started together: the exchange, not a peer's lag
            vals.append(time_fn(fn)[0])
        return statistics.median(vals[1:])

    blocks = [rows // ep] * ep

    def rows_a2a(t: torch.Tensor, async_op: bool = False) -> Any:
        """The row exchange as the run makes it (:class:`braid.models.moe_dispatch.Exchange`: NCCL's kernels,
        or the copy-engine staging under --ep-backend nccl-ce)."""
        return Exchange(out, t, blocks, blocks, group, experts.ce).start(async_op)

    figures = {"a2a_s": timed(lambda: rows_a2a(x)),
               "a2a_counts_s": timed(lambda: dist.all_to_all_single(got, counts, group=group)),
               "a2a_bytes": float(x.numel() * x.element_size()), "a2a_rows": float(rows)}
    if dev.type == "cuda":  # the row exchange beside GEMMs of the LM's width on another stream, as a braided block runs it
        a = torch.randn(tokens, m.hidden, dtype=x.dtype, device=dev)
        b = torch.randn(m.hidden, m.hidden, dtype=x.dtype, device=dev)
        one = statistics.median(time_fn(lambda: a @ b)[0] for _ in range(n))
        pair = collective_pair(x, group, a, b, figures["a2a_s"], one, dev, n,
                               lambda t: rows_a2a(t, async_op=True))
        figures.update(a2a_beside_s=pair["ar_beside_s"], a2a_stretch=pair["ar_stretch"],
                       a2a_gemm_alone_s=pair["gemm_alone_s"], a2a_gemm_beside_s=pair["gemm_beside_s"],
                       a2a_together_s=pair["together_s"],
                       a2a_slowdown=pair_slowdown_of(pair["ar_beside_s"], pair["gemm_alone_s"], pair["together_s"]))
    return figures


def unit_a2a(unit: Any, rows_s: float, counts_s: float) -> tuple[float, float]:
    """(forward, backward) all-to-all seconds that end ``unit`` of an MoE layer, as the cost model prices
    them (:func:`braid.cost.moe_costs.moe_units`): the dispatch (after the counts' exchange) ends Pre-MLP's
    forward, the combine Experts' forward, their backwards Experts' and MLP's backward."""
    from braid.core.braiding import A2A_BACKWARD, A2A_FORWARD, Unit

    f = (rows_s + (counts_s if unit is Unit.PRE_MLP else 0.0)) if unit in A2A_FORWARD else 0.0
    return f, rows_s if unit in A2A_BACKWARD else 0.0


def exposed_a2a(recorded: Iterable[dict[str, float]]) -> dict[str, float] | None:
    """The measured all-to-all of recorded steps (``exposed_a2a_s``, ``a2a_span_s`` per step): medians."""
    rec = [r for r in recorded if "a2a_span_s" in r]
    if not rec:
        return None
    return {k: statistics.median(r[k] for r in rec) for k in ("exposed_a2a_s", "a2a_span_s")}


def moe_meta(pc: Any, results: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """An MoE profile at expert parallelism: ``ep``, the routing it measured (:func:`braid.measure.experts.routing_summary`),
    ``imbalance`` (the busiest expert-parallel rank's rows over the mean, the mean over layers: what the
    all-to-all times are scaled by, and what ``braid.simulate --moe-imbalance`` rescales from) and the
    exchanges as timed after their units (``a2a_inline``, per phase and unit: seconds and bytes a rank
    sent, means over the ranks and layers). None otherwise."""
    if pc.ep == 1:
        return None
    routing = routing_summary([r.get("routes") for r in results], pc.ep, pc.tp)
    inline: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        for st in r["stages"].values():
            for ph, u, _layer, sec, nbytes in st.get("a2a", ()):
                inline.setdefault(f"{ph}:{u}", []).append((sec, nbytes))
    return {"ep": pc.ep, "imbalance": routing["ep_imbalance"] if routing else 1.0, "routing": routing,
            "a2a_inline": {k: {"s": statistics.fmean(x for x, _ in v), "bytes": statistics.fmean(b for _, b in v)}
                           for k, v in sorted(inline.items())}}


def moe_run_fields(pc: Any, ranks: Sequence[dict[str, Any]], sim: Any, m: int, profile: dict[str, Any]) -> dict[str, Any]:
    """A bench row's MoE figures (none for a dense model): its routing (:func:`routing_summary` of the
    recorded step), and per step on the worst pipeline rank the all-to-all time and what of it the compute
    stream waits for, predicted (the simulator's a2a lane, ``sim``) and measured (the executor's recorded
    step, its units timed one by one: the exposed waits and the exchanges' spans; None where the run
    recorded none, e.g. ep = 1)."""
    if not getattr(pc.model, "experts", 0):
        return {}
    per_rank: dict[int, float] = {}
    for e in sim.trace.events:
        if e.kind == "A2A":
            per_rank[e.rank] = per_rank.get(e.rank, 0.0) + e.dur
    rec = [rk["recorded"][0] for rk in ranks if rk.get("busy") is not None and rk.get("recorded")]
    measured = {k: max((r[k] for r in rec if k in r), default=None) for k in ("exposed_a2a_s", "a2a_span_s")}
    return {"routing": routing_summary([rk.get("routes") for rk in ranks], pc.ep, pc.tp),
            "a2a_predicted_s": max(per_rank.values(), default=0.0),
            "a2a_exposed_predicted_s": sim.report.max_a2a_exposed_s,
            "a2a_measured_s": measured["a2a_span_s"], "a2a_exposed_measured_s": measured["exposed_a2a_s"],
            "moe_imbalance_profiled": ((profile.get("meta") or {}).get("moe") or {}).get("imbalance")}


def format_moe_runs(summary: dict[str, Any]) -> list[str]:
    """The report's MoE lines: per row the all-to-all per step, exposed of all, predicted and measured; per
    m the expert load of the runs' micro-batches (the same for every schedule)."""
    rows = [r for r in summary["runs"] if "a2a_predicted_s" in r]
    if not rows:
        return []
    ms = lambda s: "-" if s is None else f"{s * 1e3:.2f}"  # noqa: E731
    out = []
    if any(r["a2a_predicted_s"] or r["a2a_measured_s"] for r in rows):  # expert parallelism: all-to-alls (none at ep=1)
        out.append("all-to-all per step, worst rank (ms): exposed of all, predicted (simulator's a2a lane) / measured (the "
                   "recorded step, units timed one by one)")
    for r in rows if out else ():
        out.append(f"  {r['schedule']} m={r['m']}: predicted {ms(r['a2a_exposed_predicted_s'])} of {ms(r['a2a_predicted_s'])}"
                   f", measured {ms(r['a2a_exposed_measured_s'])} of {ms(r['a2a_measured_s'])}")
    seen = set()
    for r in rows:
        if r.get("routing") and r["m"] not in seen:
            seen.add(r["m"])
            out.append(format_routing(r["routing"], f"m={r['m']}, one step, all replicas"))
    prof = rows[0].get("moe_imbalance_profiled")
    if prof is not None:
        out.append(f"predictions price the busiest EP rank's all-to-all at the profile's imbalance {prof:.3f}; its experts' "
                   "time is the busiest rank's as profiled")
    return out
