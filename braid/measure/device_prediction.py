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
from braid.cost.device_memory import DEVICE_TERMS, DeviceTerms, device_bytes, outside_allocator_bytes, reserve_bytes
from braid.cost.step_memory import param_sizes

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
DENSE_KEYS = frozenset({"hidden", "heads", "kv_heads", "ffn", "vocab_size"})


def is_dense_decoder(model: Mapping[str, Any]) -> bool:
    """Whether a model config is a dense decoder LM, the one family :func:`rank_params` counts (no experts, no vision)."""
    return DENSE_KEYS <= model.keys() and not any(model.get(k) for k in ("experts", "num_experts", "vision"))


def rank_params(config: Mapping[str, Any], pp_rank: int, placement: str) -> int:
    """Parameters one TP rank of pipeline rank ``pp_rank`` holds (a decoder LM's chunks, module order)."""
    m, tp = config["model"], config["tp"]
    kv = m["kv_heads"] * (m["hidden"] // m["heads"])
    n = 0
    for (rank, _), spec in chunk_specs(tuple(config["layers_per_stage"]), config["pp"], placement).items():
        if rank == pp_rank:
            n += sum(p.numel for p in param_sizes(m["hidden"], kv, m["ffn"], m["vocab_size"], int(spec.layers),
                                                  bool(spec.embed), bool(spec.head), tp, half_in=spec.half_in,
                                                  half_out=spec.half_out))
    return n


PRE_FLAG_CTAS = 4  # a report without ``tp_max_ctas`` in its config predates the flag, when the cap was always 4


def predicted_device_used(config: Mapping[str, Any], schedule: str, placement: str, peaks: Sequence[float],
                          graphed: bool, terms: DeviceTerms = DEVICE_TERMS) -> list[float]:
    """Per global rank (``pp_rank * tp + tp_rank``): the reserve of ``peaks[pp_rank]`` (the predicted allocator
    peak of the step above the held state) and the bytes outside the allocator of the layout."""
    tp, pp = config["tp"], config["pp"]
    d = DTYPE_BYTES[config["dtype"]]
    backend = "nccl-capped" if config.get("tp_backend", "auto") == "auto" else config["tp_backend"]
    out = []
    for rank in range(tp * pp):
        r = rank // tp
        weights = rank_params(config, r, placement) * d
        held, captured = (weights, weights) if graphed else (2 * weights, 0)  # graphed: the gradients in the pool
        reserve = reserve_bytes(terms, schedule, static_bytes=held, peak_bytes=peaks[r] + captured, graphed=graphed)
        outside = outside_allocator_bytes(terms, tp=tp, pp=pp, pp_rank=r, placement=placement, tp_backend=backend,
                                          tp_max_ctas=config.get("tp_max_ctas", PRE_FLAG_CTAS))
        out.append(device_bytes(reserve, outside))
    return out
