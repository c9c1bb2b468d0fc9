"""A bench row's predicted device memory in use per rank (:mod:`braid.cost.device_memory`), from the
bench document's ``config`` and the row's predicted allocator peaks. Torch-free, so the stored bench
files are re-predicted on CPU (``tests/test_device_memory.py``).

The state held across steps is the weights and their gradients in the model's dtype (the bench keeps
gradients, runs no optimizer step); under a whole-step CUDA graph the gradients are allocated by the
capture, in the graph's pool, so only the weights are held outside it, and the pool holds the capture's
peak with them (a graphed row's measured and predicted peak leave them out; the pool ratio of
:mod:`braid.cost.device_memory` is over the capture's whole peak, gradients included).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from braid.core.partition import chunk_specs
from braid.cost.device_memory import (DEVICE_TERMS, DeviceTerms, ce_staging_bytes, device_bytes, planned_outside_bytes,
                                      reserve_bytes)
from braid.cost.step_memory import param_sizes
from braid.io.trace import Trace

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
DENSE_KEYS = frozenset({"hidden", "heads", "kv_heads", "ffn", "vocab_size"})


def is_dense_decoder(model: Mapping[str, Any]) -> bool:
    """Whether a model config is a dense decoder LM, the one family :func:`rank_params` counts (no experts, no vision)."""
    return DENSE_KEYS <= model.keys() and not any(model.get(k) for k in ("experts", "num_experts", "vision"))


def chunk_param_bytes(config: Mapping[str, Any], placement: str) -> dict[tuple[int, int], int]:
    """``(pipeline rank, chunk) ->`` the bytes of one TP rank's parameters of that chunk (a decoder LM's, module
    order), in the model's dtype: its weights', and its gradients' where the step keeps them in that dtype."""
    m, tp = config["model"], config["tp"]
    kv = m["kv_heads"] * (m["hidden"] // m["heads"])
    d = DTYPE_BYTES[config["dtype"]]
    return {key: d * sum(p.numel for p in param_sizes(m["hidden"], kv, m["ffn"], m["vocab_size"], int(spec.layers),
                                                      bool(spec.embed), bool(spec.head), tp, half_in=spec.half_in,
                                                      half_out=spec.half_out))
            for key, spec in chunk_specs(tuple(config["layers_per_stage"]), config["pp"], placement).items()}


def rank_params(config: Mapping[str, Any], pp_rank: int, placement: str) -> int:
    """Parameters one TP rank of pipeline rank ``pp_rank`` holds (a decoder LM's chunks, module order)."""
    d = DTYPE_BYTES[config["dtype"]]
    return sum(b for (rank, _), b in chunk_param_bytes(config, placement).items() if rank == pp_rank) // d


def captured_peak(trace: Trace, pp_rank: int, grads: Mapping[int, float]) -> float:
    """A whole-step CUDA graph's allocated peak on pipeline rank ``pp_rank`` above the weights, from the simulated
    step: its activation bytes plus the gradients the captured backward has allocated by then. A graphed step
    sets every gradient to None before it captures (:class:`braid.runtime.graphs.GraphedStep`), so chunk ``c``'s
    (``grads[c]`` bytes) are taken from the graph's pool as its first W unit task starts (a BW op's W units
    included; per chunk, not per layer: a peak inside that task is priced with all of them). A peak reached
    before some chunk's first W holds less than every gradient beside it."""
    first: dict[int, float] = {}
    for e in trace.events:
        if e.rank == pp_rank and e.lane == "compute" and e.kind == "W" and e.chunk in grads:
            first[e.chunk] = min(first.get(e.chunk, e.start), e.start)
    allocs = sorted((t, grads[c]) for c, t in first.items())
    series = trace.memory.get(pp_rank, [])
    best, held, level, i = 0.0, 0.0, 0.0, 0
    for t, b in series:
        while i < len(allocs) and allocs[i][0] <= t:
            held += allocs[i][1]
            best = max(best, level + held)
            i += 1
        level = b
        best = max(best, level + held)
    held += sum(g for _, g in allocs[i:]) + sum(g for c, g in grads.items() if c not in first)
    return max(best, level + held)


PRE_FLAG_CTAS = 4  # a report without ``tp_max_ctas`` in its config predates the flag, when the cap was always 4


def predicted_device_parts(config: Mapping[str, Any], schedule: str, placement: str, peaks: Sequence[float],
                           graphed: bool, terms: DeviceTerms = DEVICE_TERMS,
                           trace: Trace | None = None, m: int = 0) -> list[tuple[float, float]]:
    """Per global rank (``pp_rank * tp + tp_rank``): the allocator's reserve and the bytes outside the allocator of
    the layout. Eager, the reserve of ``peaks[pp_rank]`` (the predicted allocator peak of the step above the held
    state) beside the weights and gradients; ``graphed``, the graph's pool holds the capture's peak of activations
    and the gradients allocated by then: :func:`captured_peak` of the simulated step's ``trace`` (then ``peaks`` is
    not read), or without a trace ``peaks`` and every gradient. Under ``nccl-ce`` (a config with ``seq`` and
    ``micro_batch_size``) the held state includes its staging (:func:`braid.cost.device_memory.ce_staging_bytes`).
    ``m``: the step's micro-batches, whose unit instances a graphed step's instantiated graph holds outside the
    allocator (:func:`braid.cost.device_memory.graph_exec_bytes`; 0: not priced)."""
    tp, pp = config["tp"], config["pp"]
    params = chunk_param_bytes(config, placement)
    units: dict[int, int] = {}  # pipeline rank -> the unit instances of its chunks
    for (q, _), spec in chunk_specs(tuple(config["layers_per_stage"]), pp, placement).items():
        units[q] = units.get(q, 0) + len(spec.instances())
    backend = "nccl-capped" if config.get("tp_backend", "auto") == "auto" else config["tp_backend"]
    staging = ce_staging_bytes(config["seq"] * config.get("micro_batch_size", 1), config["model"]["hidden"],
                               DTYPE_BYTES[config["dtype"]], tp) if backend == "nccl-ce" else 0.0
    out = []
    for rank in range(tp * pp):
        r = rank // tp
        mine = {c: b for (q, c), b in params.items() if q == r}
        weights = sum(mine.values())
        if not graphed:
            held, capture = 2 * weights, peaks[r]  # the gradients held across steps
        else:  # the gradients are in the pool
            held, capture = weights, peaks[r] + weights if trace is None else captured_peak(trace, r, mine)
        reserve = reserve_bytes(terms, schedule, static_bytes=held + staging, peak_bytes=capture, graphed=graphed)
        outside = planned_outside_bytes(graphed=graphed, tp=tp, pp=pp, pp_rank=r, placement=placement, tp_backend=backend,
                                        tp_max_ctas=config.get("tp_max_ctas", PRE_FLAG_CTAS),
                                        captured_units=m * units.get(r, 0), terms=terms)
        out.append((reserve, outside))
    return out


def predicted_device_used(config: Mapping[str, Any], schedule: str, placement: str, peaks: Sequence[float],
                          graphed: bool, terms: DeviceTerms = DEVICE_TERMS, trace: Trace | None = None,
                          m: int = 0) -> list[float]:
    """Per global rank, the device memory in use: :func:`predicted_device_parts` added up."""
    return [device_bytes(reserve, outside)
            for reserve, outside in predicted_device_parts(config, schedule, placement, peaks, graphed, terms, trace, m)]
