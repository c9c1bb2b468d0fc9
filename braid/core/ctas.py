"""Which backend runs the TP group's collectives on CUDA by default, and how many thread blocks (CTAs) NCCL
gives them under ``nccl-capped``: the runtime (:mod:`braid.tp.comm`, :meth:`braid.runtime.distributed.ProcessGroups.create`)
sets both, the device-memory model (:mod:`braid.cost.device_memory`: the group's buffers grow with the blocks,
nccl-ce adds its staging) prices them. Torch-free."""

from __future__ import annotations

MAX_CTAS_TP2, MAX_CTAS_WIDER = 4, 16  # the defaults (default_max_ctas)


def auto_tp_backend(seq_shard: bool, copy_engines: bool = True) -> str:
    """What ``--tp-backend auto`` runs on CUDA: under sequence sharding ``nccl-ce`` where NCCL has its copy-engine
    collectives (``copy_engines``: NCCL >= 2.28, :func:`braid.tp.comm.copy_engine_collectives`), else ``nccl-capped``
    (the measurements behind it: :mod:`braid.tp.comm`'s module doc)."""
    return "nccl-ce" if seq_shard and copy_engines else "nccl-capped"


def default_max_ctas(tp: int) -> int:
    """nccl-capped's thread blocks for a TP group of ``tp`` ranks, as measured with braided_v beside them.

    tp=2: 4 (2 H200s, ``benchmarks/bench_braided_overlap.py``: uncapped, braided ran 1.33x slower than
    unbraided; with 4, 0.97x). tp=4: 16 (4 H100s, 7b-layer, seq 4096, m=8,
    ``benchmarks/results/bench_7b_h100x4_tp4_pp1_ctas.txt``: braided_v 126.9 ms at 16, 128.4 uncapped, 142.3 at 4,
    whose all-reduce moved ~69 GB/s of bus bandwidth): a ring over more ranks needs more blocks to keep NVLink busy.
    """
    return MAX_CTAS_TP2 if tp <= 2 else MAX_CTAS_WIDER


def max_ctas_for(setting: int | None, tp: int) -> int | None:
    """The thread blocks a user's ``setting`` means for a TP group of ``tp`` ranks: None, the default
    (:func:`default_max_ctas`); 0, NCCL's own choice (returned as None); n, n."""
    if setting is None:
        return default_max_ctas(tp)
    return int(setting) or None
