"""How each external peer runs: the modes of the torch and megatron-core baselines.

A speed-up counts only against a peer at its best on the same model and machine, so each
baseline runs in named modes and the bench shows every mode as its own row:

- torch (:mod:`braid.baselines.torch_pp`), :class:`TorchMode`: ``eager`` is today's DTensor tensor
  parallelism (column/row-parallel linears, a vocabulary-parallel loss), eager;
  ``titan`` is TP as torchtitan's ``parallelize_llama`` applies it (sequence parallelism on
  the norms, the embedding's output and the row-parallel outputs reduce-scattered over the
  sequence, one all-gather before each column-parallel group, ``loss_parallel``;
  :mod:`braid.baselines.titan`); ``compile`` compiles every decoder layer with
  ``torch.compile(fullgraph=True)`` as torchtitan's ``apply_compile`` does; ``async_tp`` turns
  on Inductor's micro-pipelined TP (``torch._inductor.config._micro_pipeline_tp`` with symmetric
  memory for the TP group: the all-gather/matmul and matmul/reduce-scatter pairs become
  overlapped kernels). Modes join with ``+``: ``titan+compile+async_tp`` is torchtitan's best.
- megatron-core (:mod:`braid.baselines.mcore`), :class:`McoreMode`: ``eager``; ``graphed``
  wraps the whole forward-backward of an iteration in one CUDA graph
  (``megatron.core.full_cuda_graph.FullCudaGraphWrapper``, ``cuda_graph_scope=full_iteration``,
  as Megatron-LM's ``--cuda-graph-impl local --cuda-graph-scope full_iteration``); ``te``
  builds the layers from megatron-core's Transformer Engine spec instead of the local one;
  ``a2a_overlap`` (a mixture of experts at ep > 1, bf16/fp16, CUDA) turns on megatron-core's
  EP all-to-all overlap (``overlap_moe_expert_parallel_comm``: its combined 1F1B runs one
  micro-batch's forward beside another's backward, layer by layer, so that each one's
  dispatch/combine all-to-alls hide behind the other's compute). A MoE model's rows run
  eager or ``a2a_overlap`` (:func:`braid.baselines.megatron_moe.mode_refusal` says why not graphed).

Every mode says in one line why it cannot run on a given device (:meth:`TorchMode.unavailable`,
:meth:`McoreMode.unavailable`), so the bench prints that row instead of failing.
"""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import dataclass
from typing import Literal, Sequence

from braid.core.partition import whole_layers

TORCH_PARTS = ("eager", "titan", "compile", "async_tp")
MCORE_PARTS = ("eager", "graphed", "te", "a2a_overlap")
BEST_MCORE_MODE = "graphed"  # megatron-core at its best on the local spec (te needs Transformer Engine built)
DEFAULT_MCORE_MODES = ("eager", BEST_MCORE_MODE)
MOE_MCORE_MODES = (*DEFAULT_MCORE_MODES, "a2a_overlap")  # a mixture of experts: graphed says why not, EP overlap is its best


def default_mcore_modes(moe: bool) -> tuple[str, ...]:
    """megatron-core's default modes: eager and graphed, and for a mixture of experts its EP all-to-all overlap."""
    return MOE_MCORE_MODES if moe else DEFAULT_MCORE_MODES


def _parts(text: str, valid: Sequence[str], what: str) -> set[str]:
    parts = [p for p in text.split("+") if p]
    bad = [p for p in parts if p not in valid]
    if bad or not parts:
        raise ValueError(f"unknown {what} mode {text!r}; parts: {', '.join(valid)} joined with '+' (e.g. {valid[1]}+{valid[2]})")
    return set(parts) - {"eager"}


@dataclass(frozen=True, slots=True)
class TorchMode:
    """How the torch baseline runs: TP style (``plain`` DTensor TP or torchtitan's ``titan``),
    per-layer ``torch.compile`` with ``backend``, and async TP (needs ``titan`` and ``compile``)."""

    tp: Literal["plain", "titan"] = "plain"
    compile: bool = False
    async_tp: bool = False
    backend: str = "inductor"

    @classmethod
    def parse(cls, text: str) -> "TorchMode":
        """``eager``, ``titan``, ``compile``, ``titan+compile``, ``titan+compile+async_tp``, ..."""
        parts = _parts(text, TORCH_PARTS, "torch")
        mode = cls("titan" if "titan" in parts else "plain", "compile" in parts, "async_tp" in parts)
        if mode.async_tp and not (mode.compile and mode.tp == "titan"):
            raise ValueError(f"torch mode {text!r}: async_tp is an Inductor pass over sequence-parallel TP; "
                             "use titan+compile+async_tp")
        return mode

    @property
    def label(self) -> str:
        parts = [p for p, on in (("titan", self.tp == "titan"), ("compile", self.compile), ("async_tp", self.async_tp)) if on]
        return "+".join(parts) or "eager"

    def check_layout(self, tp: int) -> None:
        """``ValueError`` when the mode means nothing at this TP size (titan and async TP need tp > 1)."""
        if tp == 1 and self.tp == "titan":
            raise ValueError(f"torch mode {self.label}: titan is a tensor-parallel layout; at tp=1 use eager or compile")

    def unavailable(self, device_type: str, tp: int) -> str | None:
        """Why this mode cannot run here, in one line, or None."""
        if tp == 1 and self.tp == "titan":
            return "titan TP needs tp > 1"
        if self.async_tp:
            if device_type != "cuda":
                return f"async TP needs CUDA and symmetric memory (torch.distributed._symmetric_memory); this job runs on {device_type}"
            if importlib.util.find_spec("torch.distributed._symmetric_memory") is None:
                return "async TP needs torch.distributed._symmetric_memory, absent from this torch"
        if self.compile and self.backend == "inductor":
            if device_type == "cuda" and importlib.util.find_spec("triton") is None:
                return "torch.compile (Inductor) on CUDA needs triton, which is not installed"
            if device_type == "cpu" and not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
                return "torch.compile (Inductor) on CPU needs a C++ compiler (g++), none on PATH"
        return None


@dataclass(frozen=True, slots=True)
class McoreMode:
    """How the megatron-core baseline runs: layer ``spec`` (``local`` torch layers with SDPA, or
    ``te``: Transformer Engine), ``graphed`` (one CUDA graph per iteration) and ``a2a_overlap``
    (a mixture of experts' EP all-to-all overlap, ``overlap_moe_expert_parallel_comm``)."""

    spec: Literal["local", "te"] = "local"
    graphed: bool = False
    a2a_overlap: bool = False

    @classmethod
    def parse(cls, text: str) -> "McoreMode":
        """``eager``, ``graphed``, ``te``, ``te+graphed``, ``a2a_overlap``, ..."""
        parts = _parts(text, MCORE_PARTS, "megatron-core")
        return cls("te" if "te" in parts else "local", "graphed" in parts, "a2a_overlap" in parts)

    @property
    def label(self) -> str:
        return "+".join(p for p, on in (("te", self.spec == "te"), ("graphed", self.graphed),
                                        ("a2a_overlap", self.a2a_overlap)) if on) or "eager"

    def unavailable(self, device_type: str) -> str | None:
        """Why this mode cannot run here, in one line, or None (what the model makes impossible:
        :func:`braid.baselines.megatron_moe.mode_refusal`)."""
        if self.a2a_overlap:
            if self.graphed:
                return ("a2a_overlap with the full-iteration graph: megatron-core refuses a CUDA graph over the MoE "
                        "layers with EP overlap")
            if device_type != "cuda":
                return f"megatron-core's EP all-to-all overlap runs on CUDA streams; this job runs on {device_type}"
        if self.graphed and device_type != "cuda":
            return f"megatron-core's full-iteration CUDA graph needs CUDA; this job runs on {device_type}"
        if self.spec == "te":
            if device_type != "cuda":
                return f"Transformer Engine needs CUDA; this job runs on {device_type}"
            if importlib.util.find_spec("transformer_engine") is None:
                return ("Transformer Engine is not installed (transformer_engine_torch, its torch extension, is "
                        "published as source only: it builds with nvcc against the installed torch)")
        return None


PeerMode = TorchMode | McoreMode


def best_torch_mode(tp: int) -> str:
    """torch at its best: torchtitan's TP with compile and async TP at tp > 1, compile at tp = 1
    (run by ``torch_1f1b_i``: the zero-bubble schedules cannot compile, see :data:`SPLIT_BACKWARD`)."""
    return "titan+compile+async_tp" if tp > 1 else "compile"


def default_torch_modes(tp: int) -> tuple[str, ...]:
    """torch's eager mode and its best (:func:`best_torch_mode`)."""
    return ("eager", best_torch_mode(tp))


def parse_modes(names: Sequence[str], torch_modes: Sequence[str], mcore_modes: Sequence[str], tp: int
                ) -> list[tuple[str, PeerMode]]:
    """Every ``(baseline name, mode)`` run: each torch baseline in each torch mode, each megatron-core
    baseline in each megatron-core mode. ``ValueError`` names a bad mode."""
    tm = [TorchMode.parse(t) for t in torch_modes]
    for mode in tm:
        mode.check_layout(tp)
    mm = [McoreMode.parse(t) for t in mcore_modes]
    return [(n, mode) for n in names for mode in (mm if peer_of(n) == "mcore" else tm)]


def check_baseline_layout(name: str, topo, layers_per_stage: Sequence[int], ep: int = 1) -> tuple[int, int]:
    """``(pp, number of stages)`` of an external baseline's layout, or ``ValueError``: the baselines
    run tp x pp layouts (dp = cp = 1) with two virtual stages per rank; with ``ep`` > 1 expert-parallel
    ranks (a mixture of experts), dp may be a multiple of ``ep``: the ranks the experts are carved from."""
    if topo.cp != 1 or (topo.dp != 1 and (ep < 2 or topo.dp % ep)):
        moe = f" (a mixture of experts: or dp a multiple of ep={ep})" if ep > 1 else ""
        raise ValueError(f"{name} runs tp x pp layouts only{moe}, got dp={topo.dp}, cp={topo.cp}; use dp=1, cp=1")
    pp, n_stages = topo.pp, len(layers_per_stage)
    if not whole_layers(layers_per_stage):
        raise ValueError(f"{name} splits whole layers over its stages, got {list(layers_per_stage)}; "
                         "a half-layer cut (--last-stage-lighter 0.5) is braid's own")
    if n_stages != 2 * pp:
        raise ValueError(f"{name} runs 2 virtual stages per rank: {n_stages} stages for pp={pp}")
    return pp, n_stages


def peer_of(name: str) -> str:
    """The peer a baseline name belongs to: ``torch`` or ``mcore``."""
    return "mcore" if name.startswith("mcore_") else "torch"


# torch schedules whose backward is split into input (B) and weight (W) grads by walking the
# autograd graph: a compiled layer is one opaque node there, and the W step fails on the last
# stage's rank only (pytorch/pytorch#161904) while its peer waits in a P2P receive.
SPLIT_BACKWARD = ("torch_zb_v", "torch_dualpipe_v")


def mode_unavailable(name: str, mode: PeerMode, device_type: str, tp: int) -> str | None:
    """Why baseline ``name`` cannot run in ``mode`` here, in one line, or None."""
    if isinstance(mode, McoreMode):
        return mode.unavailable(device_type)
    if mode.compile and name in SPLIT_BACKWARD:
        return ("torch's zero-bubble schedules split the backward through the autograd graph, which a compiled layer "
                "hides (pytorch/pytorch#161904): they run eager only")
    return mode.unavailable(device_type, tp)


def row_label(schedule_label: str, mode: PeerMode) -> str:
    """A baseline row's name: the schedule and its mode, ``torch:ScheduleZBVZeroBubble [titan+compile+async_tp]``."""
    return f"{schedule_label} [{mode.label}]"
