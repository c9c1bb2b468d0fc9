"""TP communication backends: how the tensor-parallel all-reduce of a unit is carried out.

A braided block runs each TP all-reduce *beside* the other micro-batch's GEMMs, so what
matters is not the all-reduce's own speed but what it takes from the compute beside it.
cuBLAS's bf16 GEMMs on Hopper are persistent kernels holding every SM; an NCCL kernel
issued beside one waits for SMs, and once running it spins on SMs the GEMMs need. The
backends differ in exactly that:

``nccl-capped``
    NCCL with the TP communicator's CTAs capped (``max_ctas``, by default
    :func:`braid.core.ctas.default_max_ctas` of the TP size): few SMs taken, some bandwidth lost. The default on CUDA
    without sequence sharding.
``nccl``
    NCCL's defaults (fastest alone, most contention).
``nccl-zero-cta``
    NCCL's zero-CTA policy (``NCCL_CTA_POLICY_ZERO``, NCCL >= 2.28; needs a torch whose NCCL
    config exposes ``cta_policy``). NCCL 2.28 drives only AllGather, AlltoAll, Gather and
    Scatter by the copy engines, and only between buffers in registered symmetric windows;
    this backend registers none, so its all-reduce runs NCCL's kernels.
``nccl-ce``
    An all-reduce built from NCCL 2.28's copy-engine collectives (:mod:`braid.tp.ce_reduce`):
    the zero-CTA policy, staging buffers registered as symmetric windows, an all-to-all and
    an in-place all-gather on the copy engines, and one local sum kernel between them (under
    sequence sharding the reduce-scatter is the all-to-all and the sum, the all-gather the
    copy-engine one). Single node, NCCL >= 2.28, a torch with ``cta_policy`` and
    ``register_mem_pool(pool, symm=True)``. The default on CUDA under sequence sharding where
    NCCL and torch have it (:func:`resolve_tp_backend`): measured on 2 H100s (7b-layer, tp=2,
    ``benchmarks/results/sp_tp2_pp1_h100_4l_backends.txt``) braided_v's sequence-sharded step
    took 247.0 ms on nccl-capped, 221.1 ms on nccl-ce.
``symm-mem``
    A copy-engine all-reduce over torch's symmetric memory: the low-contention
    reduce-scatter then the low-contention all-gather of ``torch.ops.symm_mem`` (peer
    copies on the copy engines; only the reduction and one local copy use SMs). Single
    node (NVLink peers), any TP size that divides the node.
``gloo``
    CPU (tests, CI): a plain all-reduce.

Every backend computes the same sum (``tests/test_tp_comm.py``; bitwise where the
reduction order is the same, as for two ranks; ``nccl-ce`` accumulates bfloat16 in float32 and
rounds once, NCCL's ring rounds after each step). ``python -m braid.profile --tp-backend all`` measures each
available one alone and beside a GEMM and picks the best for braided execution.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.distributed as dist

from braid.core.ctas import auto_tp_backend, max_ctas_for
from braid.tp.ce_reduce import CEBuffers, EventWork
from braid.tp.seq_shard import Scatter, gather_buffer, gather_start, reduce_scatter

TPBackend = Literal["nccl-capped", "nccl", "nccl-zero-cta", "nccl-ce", "symm-mem", "gloo"]
TP_BACKENDS: tuple[str, ...] = ("nccl-capped", "nccl", "nccl-zero-cta", "nccl-ce", "symm-mem", "gloo")
CUDA_BACKENDS: tuple[str, ...] = ("nccl-capped", "nccl", "nccl-zero-cta", "nccl-ce", "symm-mem")
NCCL_CTA_POLICY_ZERO = 0x02  # nccl.h: NCCL_CTA_POLICY_DEFAULT 0, _EFFICIENCY 1, _ZERO 2


class TPBackendError(ValueError):
    """A TP backend that cannot run here; the message says what to use instead."""


def zero_cta_missing() -> str | None:
    """Why this torch's NCCL cannot run the zero-CTA policy (``nccl-zero-cta``) and the copy-engine
    collectives (``nccl-ce``): NCCL < 2.28, or no ``cta_policy`` field; None when it can."""
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return "no CUDA NCCL in this torch"
    version = torch.cuda.nccl.version()
    if tuple(version) < (2, 28, 0):
        return f"needs NCCL >= 2.28 (this torch has {'.'.join(map(str, version))})"
    if not hasattr(dist.ProcessGroupNCCL.Options().config, "cta_policy"):
        return "this torch's NCCL config has no cta_policy field"
    return None


def copy_engine_collectives() -> bool:
    """Whether this torch's NCCL has the copy-engine collectives ``nccl-ce`` needs (:func:`zero_cta_missing`)."""
    return zero_cta_missing() is None


def resolve_tp_backend(name: str, device: torch.device | str, seq_shard: bool = False) -> str:
    """The backend ``name`` means on ``device`` (``"auto"``: gloo on CPU; on CUDA nccl-capped, or under
    sequence sharding ``seq_shard`` nccl-ce where :func:`copy_engine_collectives`), or one clear
    :class:`TPBackendError`."""
    dev = torch.device(device)
    if name == "auto":
        if dev.type != "cuda":
            return "gloo"
        return auto_tp_backend(seq_shard, copy_engine_collectives())
    if name not in TP_BACKENDS:
        raise TPBackendError(f"unknown TP backend {name!r}; choose one of auto, {', '.join(TP_BACKENDS)}")
    if dev.type == "cuda" and name == "gloo":
        raise TPBackendError("TP backend gloo is the CPU backend; on CUDA choose one of " + ", ".join(CUDA_BACKENDS))
    if dev.type != "cuda" and name != "gloo":
        raise TPBackendError(f"TP backend {name!r} needs CUDA GPUs; on CPU use gloo (or auto)")
    return name


def nccl_group_options(backend: str, max_ctas: int | None) -> object | None:
    """``pg_options`` for the TP group's NCCL communicator under ``backend`` (None: defaults); ``max_ctas``:
    nccl-capped's thread blocks (None: NCCL's own choice)."""
    if backend in ("gloo", "nccl", "symm-mem") or dist.get_backend() != "nccl":
        return None
    opts = dist.ProcessGroupNCCL.Options()
    if backend == "nccl-capped":
        if max_ctas is None:
            return None
        opts.config.max_ctas = int(max_ctas)
    elif backend in ("nccl-zero-cta", "nccl-ce"):
        why = zero_cta_missing()
        if why:
            raise TPBackendError(f"{backend}: {why}; use symm-mem or nccl-capped")
        # nccl.h's policies are flags, but NCCL 2.28 takes its copy-engine path only when the policy is exactly ZERO
        opts.config.cta_policy = NCCL_CTA_POLICY_ZERO
    return opts


@functools.lru_cache(maxsize=None)
def _enable_symm_mem(group_name: str) -> None:
    from torch.distributed import _symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None and not symm_mem.is_symm_mem_enabled_for_group(group_name):
        enable(group_name)


def _symm_mem_all_reduce(t: torch.Tensor, group: dist.ProcessGroup) -> EventWork:
    """Sum ``t`` in place over ``group`` with copy-engine peer copies (see the module doc)."""
    from torch.distributed import _symmetric_memory as symm_mem

    name = group.group_name
    _enable_symm_mem(name)
    world = dist.get_world_size(group)
    flat = t.reshape(-1)
    n = flat.numel()
    pad = (-n) % world
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    rs = torch.ops.symm_mem._low_contention_reduce_scatter(flat, "sum", name)
    ag = torch.ops.symm_mem._low_contention_all_gather(rs, name)
    # Both ops ran on symmetric memory's backend stream; copy back there, then hand the
    # caller an event to wait on, as NCCL's work handles do.
    side = symm_mem._get_backend_stream()
    with torch.cuda.stream(side):
        t.view(-1).copy_(ag[:n])
        ev = torch.cuda.Event()
        ev.record(side)
    # The gathered output and a padded input were allocated on the caller's stream but are
    # used on the side stream: without this the allocator hands their memory to the caller's
    # next tensors while the copies still run (seen as wrong losses when braided units overlap).
    for used in (t, flat, ag):
        used.record_stream(side)
    return EventWork(ev)


def make_tp_comm(groups, backend: str, max_ctas: int | None = None) -> "TPComm":
    """A :class:`TPComm` for ``backend`` over this rank's TP group, created anew with the
    backend's NCCL options (collective: every rank calls it, and every TP group of the
    layout is created on every rank, as ``new_group`` requires). ``max_ctas``: a setting of
    :func:`braid.core.ctas.max_ctas_for` (None: by TP size; 0: NCCL's own choice). Returns the groups' own
    :attr:`~braid.runtime.distributed.ProcessGroups.tp_comm` when its backend is already ``backend``."""
    if groups.topo.tp == 1:
        return TPComm(backend, None)
    if backend == groups.tp_backend:
        return groups.tp_comm
    opts = nccl_group_options(backend, max_ctas_for(max_ctas, groups.topo.tp))
    mine = None
    for ranks in groups.topo.groups("tp"):
        g = dist.new_group(ranks, pg_options=opts)
        if groups.rank in ranks:
            mine = g
    return TPComm(backend, mine)


class TPComm:
    """The TP all-reduce of one rank under a backend: ``all_reduce(t)`` sums ``t`` in place
    over the TP group and returns a handle whose ``wait()`` orders the caller after it.

    Under ``nccl-ce`` it owns the group's registered staging buffers (:class:`~braid.tp.ce_reduce.CEBuffers`,
    made on first use and kept as long as this object), so a run keeps one TPComm per TP group
    (:attr:`braid.runtime.distributed.ProcessGroups.tp_comm` is one)."""

    def __init__(self, backend: str, group: dist.ProcessGroup | None) -> None:
        if backend not in TP_BACKENDS:
            raise TPBackendError(f"unknown TP backend {backend!r}; choose one of {', '.join(TP_BACKENDS)}")
        self.backend = backend
        self.group = group
        self._ce: CEBuffers | None = None

    def reduce(self, t: torch.Tensor | Scatter):
        """A unit's TP reduction, started: the all-reduce of ``t`` in place, or under sequence sharding
        (:mod:`braid.tp.seq_shard`) the reduce-scatter a :class:`Scatter` asks for. The reduce-scatter
        runs as the group's collective under every backend but ``nccl-ce`` (NCCL's kernels under
        nccl-zero-cta and symm-mem's NCCL group), which runs it as a copy-engine all-to-all and a sum."""
        if isinstance(t, Scatter):
            if self.backend == "nccl-ce":
                return self._ce_buffers(t.src.device).reduce_scatter(t)
            return reduce_scatter(t, self.group)
        return self.all_reduce(t)

    def gather_start(self, local: torch.Tensor, buf: torch.Tensor | None = None) -> tuple[torch.Tensor, object]:
        """Sequence sharding's all-gather of every rank's tokens ``local`` (b, s/t, h), started: its buffer
        (t, b, s/t, h) and work, as :func:`braid.tp.seq_shard.gather_start`; under ``nccl-ce`` through the
        group's staging on the copy engines, else the group's collective."""
        if self.backend != "nccl-ce":
            return gather_start(local, self.group, buf)
        buf = gather_buffer(local, self.group) if buf is None else buf
        return buf, self._ce_buffers(local.device).all_gather(buf.view(-1), local.contiguous())

    def all_reduce(self, t: torch.Tensor):
        if self.backend == "symm-mem":
            return _symm_mem_all_reduce(t, self.group)
        if self.backend == "nccl-ce":
            return self._ce_buffers(t.device).all_reduce(t)
        return dist.all_reduce(t, group=self.group, async_op=True)

    def _ce_buffers(self, device: torch.device) -> CEBuffers:
        if self._ce is None:
            self._ce = CEBuffers(self.group, device)
        return self._ce

    def __repr__(self) -> str:
        return f"TPComm({self.backend})"
