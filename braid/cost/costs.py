"""The cost model: per-unit compute, TP all-reduce, P2P and memory costs of every chunk.

The simulator reads a :class:`CostModel`: for each ``(rank, chunk)`` a :class:`ChunkCosts`
with one :class:`UnitCost` per unit kind (every layer of a chunk is alike), the time to
send the chunk's boundary tensor to a neighbour, and the host-copy bandwidth. It comes
from one of two places:

* :func:`analytic_costs` -- FLOPs and bytes of a :class:`~braid.cost.catalog.ModelConfig`
  on a :class:`~braid.cost.hardware.Hardware` preset under a :class:`Layout` (tp, p, v,
  placement). Forward FLOPs per unit: matmuls ``2*tokens*in*out/t``; attention core
  ``4*tokens*seq*head_dim*heads/t``, halved when causal. Activation backward = forward
  for matmuls, 2x for the attention core (flash attention recomputes); weight gradient =
  forward for matmuls, none for the attention core. All-reduce: ring,
  ``2(t-1)/t * tokens*hidden*dtype / busbw + latency``. Activation bytes per layer
  (Korthikanti et al., flash attention): ``s*b*h*(10 + 24/t)`` for bf16, split over units
  as pre_attn 4, attn 1 + 8/t, pre_mlp 4, mlp 1 + 16/t; the head keeps fp32 logits
  ``s*b*vocab/t*4``. W residual (what a split B keeps for W): the inputs of the unit's
  linear layers plus their output gradients.
* a JSON cost file (:func:`read_costs` / :func:`write_costs`; schema in ``docs/costs.md``),
  e.g. the uniform ``{"T_F": 1, "T_B": 1, "T_W": 1, "T_AR": 0.25, "T_P2P": 0}`` used to
  check the paper's Table 1, or per-chunk figures written by a profiler.

``M_a`` (``CostModel.ma_bytes``) is the activation memory of one micro-batch on one chunk
of average layer count in the paper's two-chunks-per-rank layout: (LM layers / 2p) * the
LM's per-layer activation bytes. It does not depend on the schedule's own v, so one
yardstick serves every schedule in a comparison.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Mapping

from braid.core.braiding import A2A_BACKWARD, A2A_FORWARD, AR_BACKWARD, AR_FORWARD, ChunkSpec, Unit
from braid.cost.hardware import Hardware, ring_s
from braid.core.ir import Placement
from braid.cost.catalog import ModelConfig
from braid.cost.moe_costs import MoeLayout, applied_imbalance, check_moe, mlp_width, moe_units
from braid.core.partition import chunk_specs, split_layers, whole_layers
from braid.cost.recompute_costs import full_recompute, selective_recompute
from braid.cost.runtime_act import loss_workspace, runtime_act
from braid.cost.seq_shard_costs import KORTHIKANTI_ACT, seq_shard_units
from braid.io.inputs import InputFileError, read_json
from braid.io.cli import NO_SEQ_SHARD_VISION
from braid.io.limits import COST_FILE

AR_SLOWDOWN = 1.075  # paper Appendix F: a GEMM overlapped with an all-reduce runs ~7.5% slower
ATTN_BWD_FACTOR = 2.0
FORMAT = "braid-costs/1"


class CostFileError(ValueError):
    """A cost file that is missing, not JSON, or does not follow ``docs/costs.md``."""


@dataclass(frozen=True, slots=True)
class Layout:
    """How the model is laid out: TP size, pipeline ranks, chunks per rank, placement."""

    tp: int
    p: int
    v: int
    placement: Placement = "loop"

    def __post_init__(self) -> None:
        bad = [f"{n}={getattr(self, n)}" for n in ("tp", "p", "v") if not (isinstance(getattr(self, n), int) and getattr(self, n) >= 1)]
        if bad:
            raise ValueError(f"layout needs positive integers, got {', '.join(bad)}")
        if self.placement == "v" and self.v != 2:
            raise ValueError(f"V placement needs v=2 chunks per rank, got v={self.v}")

    @property
    def num_stages(self) -> int:
        return self.p * self.v


@dataclass(frozen=True, slots=True)
class UnitCost:
    """Costs of one instance of a unit (seconds, bytes).

    ``f``/``b``/``w``: forward, activation-backward, weight-backward compute;
    ``ar_f``/``ar_b``: the all-reduce that ends the unit's forward / backward (0 if none);
    ``a2a_f``/``a2a_b``: the all-to-all that ends an MoE layer unit's forward / backward
    (:mod:`braid.cost.moe_costs`; 0 if none, and without expert parallelism);
    ``ag_f``/``ag_b``: under sequence sharding, the all-gather a unit's forward / backward starts
    with (after its head, :data:`braid.core.braiding.GATHER_HEAD_F`) when it is its op's first unit
    task -- elsewhere it follows the reduction before it and is part of that unit's ``ar_f``/``ar_b``
    (:func:`braid.cost.seq_shard_costs.seq_shard_units`); not in cost files: a profile times it
    inside the unit;
    ``act``: bytes its forward keeps for the backward; ``w_res``: bytes kept after a split
    B until W; ``tmp``: workspace -- bytes allocated on top of those while the unit runs
    and freed when it ends (logits and their gradient, MLP intermediates), the most of its
    F, B and W (a GPU profile measures it; the analytic model counts the eager loss's, see
    :func:`braid.cost.runtime_act.eager_loss_workspace`, and full recomputation's re-run).
    """

    f: float
    b: float
    w: float
    ar_f: float = 0.0
    ar_b: float = 0.0
    act: float = 0.0
    w_res: float = 0.0
    tmp: float = 0.0
    a2a_f: float = 0.0
    a2a_b: float = 0.0
    ag_f: float = 0.0
    ag_b: float = 0.0


@dataclass(frozen=True, slots=True)
class ChunkCosts:
    """Costs of one model chunk: per-unit costs and the P2P time of its boundary tensor."""

    spec: ChunkSpec
    units: Mapping[Unit, UnitCost]
    p2p: float = 0.0

    def instances(self) -> list[Unit]:
        """Every unit instance of the chunk (layer units repeated per layer, half layers' halves)."""
        return self.spec.instances()

    def total(self, attr: str) -> float:
        """Sum of ``attr`` (``"f"``, ``"ar_f"``, ``"act"``, ...) over the chunk's unit instances."""
        return sum(getattr(self.units[u], attr) for u in self.instances())


@dataclass(frozen=True, slots=True)
class CostModel:
    """Everything the simulator needs to time and size a compiled schedule.

    ``model_flops_per_sample`` (forward + backward, no recompute) and ``peak_flops`` feed MFU;
    both 0 when unknown (uniform cost files), and MFU is then reported as 0.
    ``copy_duplex_slowdown``: the factor a host copy's time is multiplied by while a copy in
    the other direction is in flight (1 = full-duplex link, 2 = shared; default 2).
    ``ar_stretch``: the factor a TP all-reduce's time is multiplied by when compute runs
    beside it (the next unit task does not wait for it): the two share SMs and memory
    bandwidth, so a hidden all-reduce takes longer than an exposed one (1 = no contention).
    ``host_task_s``: host time the executor spends issuing one unit task (Python, autograd,
    kernel launches). It is the simulator's *host lane*: a rank's host issues its unit tasks
    one after another, never waiting for the device, and a unit cannot start on the device
    before the host has issued it. Measured by ``braid.profile`` on GPU; 0 on CPU, where a
    unit's measured time already includes its host time.
    ``a2a_slowdown``: compute's slowdown while an expert-parallel all-to-all is in flight (as
    ``ar_slowdown`` is beside a TP all-reduce; None: ``ar_slowdown`` serves both); read it as :attr:`a2a_factor`.
    """

    layout: Layout
    chunks: Mapping[tuple[int, int], ChunkCosts]
    ma_bytes: float
    pcie_bytes_per_s: float = 25e9
    p2p_over_pcie: bool = False
    ar_slowdown: float = AR_SLOWDOWN
    samples_per_microbatch: int = 1
    tokens_per_sample: int = 1
    model_flops_per_sample: float = 0.0
    peak_flops: float = 0.0
    source: str = "analytic"
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    copy_duplex_slowdown: float = 2.0
    ar_stretch: float = 1.0
    host_task_s: float = 0.0
    a2a_slowdown: float | None = None

    @property
    def a2a_factor(self) -> float:
        return self.ar_slowdown if self.a2a_slowdown is None else self.a2a_slowdown

    def __post_init__(self) -> None:
        want = {(r, c) for r in range(self.layout.p) for c in range(self.layout.v)}
        if set(self.chunks) != want:
            missing = sorted(want - set(self.chunks))
            raise ValueError(f"cost model must cover every (rank, chunk) of the layout; missing {missing[:6]}")
        if self.ar_slowdown < 1.0:
            raise ValueError(f"ar_slowdown must be >= 1 (a slowdown factor), got {self.ar_slowdown}")
        if not 1.0 <= self.ar_stretch <= 4.0:
            raise ValueError(f"ar_stretch must be in [1, 4] (an all-reduce's slowdown beside compute), got {self.ar_stretch}")
        if self.a2a_slowdown is not None and not 1.0 <= self.a2a_slowdown <= 4.0:
            raise ValueError(f"a2a_slowdown must be in [1, 4] (compute's slowdown beside an all-to-all), got {self.a2a_slowdown}")
        if not 0.0 <= self.host_task_s <= 1.0:
            raise ValueError(f"host_task_s must be in [0, 1] s (host time to issue one unit task), got {self.host_task_s}")
        if not 1.0 <= self.copy_duplex_slowdown <= 2.0:
            raise ValueError(f"copy_duplex_slowdown must be in [1, 2] (1 = full duplex, 2 = shared link), "
                             f"got {self.copy_duplex_slowdown}")

    def spec_of(self, rank: int):
        """``chunk -> ChunkSpec`` for one rank, as :func:`braid.core.braiding.steps` wants it."""
        return lambda chunk: self.chunks[(rank, chunk)].spec

    def units_on(self, rank: int) -> int:
        """Unit instances of one rank's chunks: what a micro-batch's whole-step graph captures there."""
        return sum(len(self.chunks[(rank, c)].instances()) for c in range(self.layout.v))


# ----------------------------------------------------------------------------------------
# Analytic model
# ----------------------------------------------------------------------------------------
def _layer_units(tokens: int, seq: int, h: int, heads: int, kv_heads: int, ffn: int, gated: bool, causal: bool,
                 t: int, dtype: int, hw: Hardware, ar: float) -> dict[Unit, UnitCost]:
    """Per-unit costs of one transformer layer (LM: SwiGLU + causal; ViT: GELU (Qwen2-VL) or SwiGLU (Qwen2.5-VL),
    full attention over the image -- Qwen2.5-VL's window blocks are counted as full, an upper bound)."""
    hd = h // heads
    qkv_out = h + 2 * kv_heads * hd
    mm = lambda flops: flops / hw.matmul_flops  # noqa: E731
    f_qkv = 2 * tokens * h * qkv_out / t
    f_core = 4 * tokens * seq * hd * heads / t * (0.5 if causal else 1.0)
    f_oproj = 2 * tokens * h * h / t
    f_up = 2 * tokens * h * ffn * (2 if gated else 1) / t
    f_down = 2 * tokens * ffn * h / t
    sbh = tokens * h * dtype / 2  # Korthikanti's coefficients are bf16 bytes per s*b*h
    act = lambda u: sbh * (KORTHIKANTI_ACT[u][0] + KORTHIKANTI_ACT[u][1] / t)  # noqa: E731
    return {
        Unit.PRE_ATTN: UnitCost(mm(f_qkv), mm(f_qkv), mm(f_qkv), 0.0, ar, act(Unit.PRE_ATTN), sbh * (2 + 2 * qkv_out / h / t)),
        Unit.ATTN: UnitCost(f_core / hw.attn_flops + mm(f_oproj), ATTN_BWD_FACTOR * f_core / hw.attn_flops + mm(f_oproj),
                            mm(f_oproj), ar, 0.0, act(Unit.ATTN), sbh * (2 / t + 2)),
        Unit.PRE_MLP: UnitCost(mm(f_up), mm(f_up), mm(f_up), 0.0, ar, act(Unit.PRE_MLP),
                               sbh * (2 + 2 * ffn * (2 if gated else 1) / h / t)),
        Unit.MLP: UnitCost(mm(f_down), mm(f_down), mm(f_down), ar, 0.0, act(Unit.MLP), sbh * (2 * ffn / h / t + 2)),
    }


RECOMPUTE_MODES = ("none", "selective", "full")


def _allreduce_time(nbytes: float, t: int, hw: Hardware) -> float:
    return ring_s(nbytes, t, hw.ar_bus_bytes_per_s, hw.ar_latency_s, passes=2)


def model_forward_flops(model: ModelConfig) -> float:
    """Forward FLOPs of one micro-batch through the whole model (no TP split)."""
    total = 0.0
    lm = _layer_units(model.tokens, model.seq, model.hidden, model.heads, model.kv_heads, model.ffn, True, True, 1,
                      model.dtype_bytes, _UNIT_RATE, 0.0)
    if model.experts:  # the active experts and the router
        lm = moe_units(lm, model, model.tokens, 1, model.dtype_bytes, _UNIT_RATE, MoeLayout())
    total += model.layers * sum(u.f for u in lm.values())
    total += 2 * model.tokens * model.hidden * model.vocab  # LM head
    if model.vit is not None:
        v = model.vit
        tok = v.patches * model.micro_batch_size
        vit = _layer_units(tok, v.patches, v.hidden, v.heads, v.heads, v.ffn, v.gated, False, 1, model.dtype_bytes, _UNIT_RATE, 0.0)
        wide = v.hidden * v.merge ** 2
        merger = 2 * (tok // v.merge ** 2) * (wide * wide + wide * model.hidden)
        total += v.layers * sum(u.f for u in vit.values()) + 2 * tok * v.patch_pixels * v.hidden + merger
    return total


# A "hardware" at 1 FLOP/s turns the unit times above into FLOP counts.
_UNIT_RATE = Hardware("flops", 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0)


def model_stage_layers(model: ModelConfig, layout: Layout, last_stage_lighter: float | None = None) -> tuple[float, ...]:
    """Layers per virtual stage as the paper splits them (Sec. 5): last stage two lighter
    (fewer when the layers are too few for that, see :func:`stage_lighter`); an MLLM's ViT
    alone on the first stage. ``last_stage_lighter``: that count instead (a half cuts a
    layer: :func:`braid.core.partition.split_layers`)."""
    if last_stage_lighter is None:
        last_stage_lighter = stage_lighter(model, layout.num_stages)
    return _split(model, layout.num_stages, last_stage_lighter)


def stage_lighter(model: ModelConfig, num_stages: int) -> int:
    """How many layers lighter the last virtual stage is: 2 (the paper's split), or 1 or 0
    when the LM layers are too few to give every stage one with 2 (80 layers on 64 stages).
    Raises ``ValueError`` when even an even split leaves a stage without a layer."""
    if num_stages < 2:
        return 0
    for lighter in (2, 1):
        try:
            _split(model, num_stages, lighter)
            return lighter
        except ValueError:
            pass
    _split(model, num_stages, 0)  # raises with the reason
    return 0


def _split(model: ModelConfig, n: int, lighter: float) -> tuple[float, ...]:
    if model.vit is None:
        return split_layers(model.layers, n, last_stage_lighter=lighter)
    if n < 2:
        raise ValueError(f"model {model.name!r} has a ViT, which needs its own virtual stage: use at least 2 stages")
    return split_layers(model.vit.layers + model.layers, n, last_stage_lighter=lighter, first_stage_layers=model.vit.layers)


def analytic_costs(model: ModelConfig, hw: Hardware, layout: Layout, ar_slowdown: float = AR_SLOWDOWN,
                   activations: Literal["korthikanti", "runtime"] = "korthikanti", recompute: str = "none",
                   compiled: bool = True, last_stage_lighter: float | None = None, seq_shard: bool = False,
                   moe: MoeLayout | None = None) -> CostModel:
    """The analytic cost model of ``model`` on ``hw`` under ``layout`` (see module doc).

    ``activations``: how the LM units' (and the head's, embedding's) saved bytes are
    counted -- Korthikanti's per-layer formula (the paper's yardstick), or ``"runtime"``:
    what braid's runtime really saves (:func:`braid.cost.runtime_act.runtime_act`), for predictions that are
    compared with a measured activation peak (Sec. 4.4 offload benchmark).
    ``recompute``: ``"selective"`` applies :func:`selective_recompute`, ``"full"``
    :func:`braid.cost.recompute_costs.full_recompute` to the LM layers. ``compiled``: whether the
    executor compiles its unit functions (its default on CUDA); with ``"runtime"`` the head's
    workspace is :func:`braid.cost.runtime_act.loss_workspace`'s.
    ``last_stage_lighter``: the layer split's (:func:`model_stage_layers`; None: the paper's).
    ``seq_shard``: sequence parallelism inside TP (:func:`seq_shard_units`; no effect at tp=1;
    the LM only: a vision-language model is refused, as the runtime refuses it).
    ``moe``: expert parallelism and load imbalance of an MoE model's layers (:mod:`braid.cost.moe_costs`;
    None: ``ep`` 1, balanced).
    """
    if seq_shard and model.vit is not None and layout.tp > 1:
        raise ValueError(NO_SEQ_SHARD_VISION)
    if activations not in ("korthikanti", "runtime"):
        raise ValueError(f"activations must be 'korthikanti' or 'runtime', got {activations!r}")
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")
    t, d = layout.tp, model.dtype_bytes
    if model.heads % t or model.kv_heads % t and t % model.kv_heads:
        raise ValueError(f"tp={t} must divide the {model.heads} attention heads of {model.name!r} (and match its {model.kv_heads} KV heads)")
    check_moe(model, t, moe.ep if moe else 1)
    per_stage = model_stage_layers(model, layout, last_stage_lighter)
    if recompute == "full" and not whole_layers(per_stage):
        raise ValueError(f"full recomputation re-runs whole layers; the stages {list(per_stage)} cut one in half")
    first_lm = model.vit.layers if model.vit is not None else 0  # every LM layer of an MoE model is one
    specs = chunk_specs(per_stage, layout.p, layout.placement,
                        moe_layers=range(first_lm, first_lm + model.layers) if model.experts else (),
                        vision=model.vit is not None)
    tok, h = model.tokens, model.hidden
    ar_lm = _allreduce_time(tok * h * d, t, hw)
    lm = _layer_units(tok, model.seq, h, model.heads, model.kv_heads, model.ffn, True, True, t, d, hw, ar_lm)
    f_head = 2 * tok * h * model.vocab / t / hw.matmul_flops
    sbh = tok * h * d / 2
    head = UnitCost(f_head, f_head, f_head, 0.0, ar_lm, 4 * sbh + tok * model.vocab / t * 4,
                    2 * sbh + tok * model.vocab / t * d)
    embed = UnitCost(0.0, 0.0, 0.0, ar_lm, 0.0, tok * 8, tok * h * d)
    if activations == "runtime":
        acts = runtime_act(tok, h, model.heads, model.kv_heads, model.ffn, t, d)
        lm = {u: replace(c, act=acts[u]) for u, c in lm.items()}
        # norm, its output, the logits of the vocab shard; the loss's per-token max and sum of exponentials,
        # local labels and mask (17 bytes per token)
        head = replace(head, act=tok * (4 * h + 2 * d * h + 4 + d * (model.vocab // t) + 17),
                       tmp=loss_workspace(tok, model.vocab // t, d, compiled, t))
        embed = replace(embed, act=tok * 9)  # shifted token ids and the shard mask
    if model.experts:
        lm = moe_units(lm, model, tok, t, d, hw, moe or MoeLayout(), activations)
    shard = seq_shard and t > 1
    if shard:
        lm, head, embed = seq_shard_units(lm, head, embed, tok, h, t, d, hw, activations == "runtime")
    layer_act = sum(u.act for u in lm.values())  # M_a counts the layer without recomputation (a fixed yardstick)
    if recompute == "selective":
        lm = selective_recompute(lm, tok, model.seq, h, model.heads, mlp_width(model, t, moe), t, d, hw, activations)
    elif recompute == "full":
        lm = full_recompute(lm, tok * h * d)
    vit_units = None
    if model.vit is not None:
        v = model.vit
        vtok = v.patches * model.micro_batch_size
        ar_v = _allreduce_time(vtok * v.hidden * d, t, hw)
        vit_units = _layer_units(vtok, v.patches, v.hidden, v.heads, v.heads, v.ffn, v.gated, False, t, d, hw, ar_v)
        f_patch = 2 * vtok * v.patch_pixels * v.hidden / hw.matmul_flops
        embed = UnitCost(f_patch, f_patch, f_patch, ar_lm, 0.0, vtok * v.patch_pixels * d, vtok * v.patch_pixels * d)
        # Patch merger (2x2 -> one LM token): norm, column-parallel fc1 (4hv -> 4hv), GELU, row-parallel fc2
        # (4hv -> h); joined with the text embedding by the AR of the LM-sized output; backward ends with
        # the AR of fc1's input gradient (ViT-sized).
        mtok, wide = vtok // v.merge ** 2, v.hidden * v.merge ** 2
        f_merge = 2 * mtok * (wide * wide + wide * h) / t / hw.matmul_flops
        merge = UnitCost(f_merge, f_merge, f_merge, ar_lm, ar_v, mtok * wide * d * (2 + 2 / t), mtok * wide * d * (1 + 1 / t))
    p2p = hw.p2p_latency_s + tok * h * d / (t if shard else 1) / hw.p2p_bytes_per_s
    chunks = {}
    for key, spec in specs.items():
        units = dict(vit_units if (vit_units is not None and spec.embed) else lm)
        units[Unit.EMBED], units[Unit.HEAD] = embed, head
        if vit_units is not None:
            units[Unit.MERGE] = merge  # used by chunks whose spec has merge=True (the vision stage)
        chunks[key] = ChunkCosts(spec, units, p2p)
    ma = model.layers / (2 * layout.p) * layer_act
    return CostModel(layout, chunks, ma, hw.pcie_bytes_per_s, hw.p2p_over_pcie, ar_slowdown, model.micro_batch_size,
                     model.seq, 3 * model_forward_flops(model) / model.micro_batch_size, hw.peak_flops,
                     f"analytic:{model.name}@{hw.name}", {"model": model.name, "hardware": hw.name, **(
                         {"ep": (moe or MoeLayout()).ep, "moe_imbalance": applied_imbalance(moe or MoeLayout(), layout.tp)}
                         if model.experts else {})},
                     copy_duplex_slowdown=hw.pcie_duplex_slowdown)


def uniform_costs(layout: Layout, specs: Mapping[tuple[int, int], ChunkSpec], **chunk: float) -> CostModel:
    """Uniform per-chunk costs (``T_F``, ``T_B``, ``T_W``, ``T_AR``, ``T_P2P``, ...) spread evenly over units."""
    return costs_from_dict(dict(chunk), layout, specs)


# ----------------------------------------------------------------------------------------
# Cost files
# ----------------------------------------------------------------------------------------
_CHUNK_KEYS = ("T_F", "T_B", "T_W", "T_AR", "T_AR_B", "T_A2A", "T_A2A_B", "T_P2P", "activation_bytes", "w_residual_bytes",
               "unit_split", "unit_workspace")
_GLOBAL_KEYS = ("format", "chunks", "M_a_bytes", "W_residual", "ar_slowdown", "pcie_bytes_per_s", "p2p_over_pcie",
                "copy_duplex_slowdown", "ar_stretch", "host_task_s", "a2a_slowdown", "samples_per_microbatch", "tokens_per_sample", "model_flops_per_sample", "peak_flops", "meta", "layout")
# split key -> (UnitCost field, total key)
_SPLITS = {"F": "f", "B": "b", "W": "w", "AR": "ar_f", "AR_B": "ar_b", "act": "act", "w_residual": "w_res",
           "A2A": "a2a_f", "A2A_B": "a2a_b"}
# units that may carry a collective's total, per split key (default: every unit)
_ELIGIBLE = {"AR": AR_FORWARD, "AR_B": AR_BACKWARD, "A2A": A2A_FORWARD, "A2A_B": A2A_BACKWARD}


# Upper bounds of a cost-file figure: far above any real machine, low enough that sums and
# products over a step stay finite (1e308 per chunk would make the step time inf).
_MAX_SECONDS = 1e6
_MAX_BYTES = 1e18
_MAX_RATE = 1e18  # bytes/s or FLOP/s
_MAX_FLOPS = 1e24
_LIMITS: dict[str, tuple[float, float]] = {
    **{k: (0.0, _MAX_SECONDS) for k in ("T_F", "T_B", "T_W", "T_AR", "T_AR_B", "T_A2A", "T_A2A_B", "T_P2P")},
    **{k: (0.0, _MAX_BYTES) for k in ("activation_bytes", "w_residual_bytes", "M_a_bytes")},
    "W_residual": (0.0, 16.0), "pcie_bytes_per_s": (1.0, _MAX_RATE), "peak_flops": (0.0, _MAX_RATE),
    "model_flops_per_sample": (0.0, _MAX_FLOPS), "samples_per_microbatch": (1.0, 1e9), "tokens_per_sample": (1.0, 1e12),
    "ar_slowdown": (1.0, 100.0), "ar_stretch": (1.0, 4.0), "copy_duplex_slowdown": (1.0, 2.0), "host_task_s": (0.0, 1.0),
    "a2a_slowdown": (1.0, 4.0),
}
_INT_KEYS = ("samples_per_microbatch", "tokens_per_sample")


def _num(d: Mapping[str, Any], key: str, where: str, default: float | None = None, limits: tuple[float, float] | None = None) -> float:
    """``d[key]`` as a float in its range (``_LIMITS``; workspace bytes: ``[0, _MAX_BYTES]``)."""
    if key not in d:
        if default is None:
            raise CostFileError(f"{where}: missing {key!r} (needed: T_F, T_B, T_W, T_AR; optional T_AR_B, T_P2P, ...)")
        return default
    val = d[key]
    lo, hi = limits or _LIMITS.get(key, (0.0, _MAX_BYTES))
    if isinstance(val, bool) or not isinstance(val, (int, float)) or not lo <= val <= hi:
        raise CostFileError(f"{where}: {key!r} must be a finite number in [{lo:g}, {hi:g}], got {val!r}")
    if key in _INT_KEYS and val != int(val):
        raise CostFileError(f"{where}: {key!r} must be a whole number, got {val!r}")
    return float(val)


def _weight(val: Any, where: str, key: str, unit: str) -> float:
    if isinstance(val, bool) or not isinstance(val, (int, float)) or not 0.0 <= val <= 1e12:
        raise CostFileError(f"{where}: unit_split[{key!r}][{unit!r}] must be a number in [0, 1e12], got {val!r}")
    return float(val)


def _chunk_from_dict(d: Mapping[str, Any], spec: ChunkSpec, where: str, ma: float, w_frac: float) -> ChunkCosts:
    unknown = sorted(set(d) - set(_CHUNK_KEYS))
    if unknown:
        raise CostFileError(f"{where}: unknown keys {unknown}; valid chunk keys: {', '.join(_CHUNK_KEYS)}")
    t_ar = _num(d, "T_AR", where)
    act = _num(d, "activation_bytes", where, ma)
    totals = {"F": _num(d, "T_F", where), "B": _num(d, "T_B", where), "W": _num(d, "T_W", where), "AR": t_ar,
              "AR_B": _num(d, "T_AR_B", where, t_ar), "act": act, "w_residual": _num(d, "w_residual_bytes", where, w_frac * act)}
    t_a2a = _num(d, "T_A2A", where, 0.0)  # an MoE chunk's all-to-alls (only its MoE layers' units carry them)
    totals.update({"A2A": t_a2a, "A2A_B": _num(d, "T_A2A_B", where, t_a2a)})
    split = d.get("unit_split") or {}
    if not isinstance(split, dict) or set(split) - set(_SPLITS):
        raise CostFileError(f"{where}: 'unit_split' must map some of {', '.join(_SPLITS)} to {{unit: weight}}")
    probe = ChunkCosts(spec, {})
    inst = probe.instances()
    vals: dict[Unit, dict[str, float]] = {u: {} for u in sorted(set(inst), key=list(Unit).index)}
    for key, attr in _SPLITS.items():
        eligible = set(_ELIGIBLE.get(key, Unit))
        if key in ("A2A", "A2A_B") and not spec.moe:
            eligible = set()
        weights = split.get(key)
        if weights is None:
            w = {u: 1.0 if u in eligible else 0.0 for u in vals}
        else:
            if not isinstance(weights, Mapping):
                raise CostFileError(f"{where}: unit_split[{key!r}] must be an object {{unit: weight}}, got {weights!r}"[:300])
            missing = [u.value for u in vals if u in eligible and u.value not in weights]
            if missing:
                raise CostFileError(f"{where}: unit_split[{key!r}] lacks unit {missing[0]!r} of this chunk")
            w = {u: _weight(weights[u.value], where, key, u.value) if u in eligible else 0.0 for u in vals}
        norm = sum(w[u] for u in inst)
        for u in vals:
            vals[u][attr] = totals[key] * w[u] / norm if norm > 0 else 0.0
        if norm == 0 and totals[key] > 0:
            raise CostFileError(f"{where}: {key} total is {totals[key]} but this chunk has no unit to carry it")
    work = d.get("unit_workspace") or {}
    if not isinstance(work, dict) or set(work) - {u.value for u in vals}:
        raise CostFileError(f"{where}: 'unit_workspace' must map units of this chunk ({', '.join(u.value for u in vals)}) to bytes")
    for u in vals:
        vals[u]["tmp"] = _num(work, u.value, f"{where}: unit_workspace", 0.0, (0.0, _MAX_BYTES))
    units = {u: UnitCost(**v) for u, v in vals.items()}
    return ChunkCosts(spec, units, _num(d, "T_P2P", where, 0.0))


def costs_from_dict(d: Mapping[str, Any], layout: Layout, specs: Mapping[tuple[int, int], ChunkSpec],
                    base: CostModel | None = None, where: str = "costs") -> CostModel:
    """Build a :class:`CostModel` from the cost-file schema (``docs/costs.md``).

    Top-level chunk keys are defaults for every chunk; ``chunks`` overrides them per chunk,
    keyed ``"rank,chunk"`` or by virtual stage (``"3"``). ``specs`` give each chunk's layers
    (from the model partition); ``base`` supplies global figures the file leaves out.
    """
    if not isinstance(d, Mapping):
        raise CostFileError(f"{where}: expected a JSON object")
    if d.get("format", FORMAT) != FORMAT:
        raise CostFileError(f"{where}: format {d.get('format')!r} is not {FORMAT!r}")
    unknown = sorted(set(d) - set(_CHUNK_KEYS) - set(_GLOBAL_KEYS))
    if unknown:
        raise CostFileError(f"{where}: unknown keys {unknown}; valid: {', '.join(_CHUNK_KEYS + _GLOBAL_KEYS)}")
    from braid.core.ir import rank_chunk_of

    for key, kind in (("chunks", Mapping), ("meta", Mapping), ("layout", Mapping), ("unit_split", Mapping),
                      ("unit_workspace", Mapping), ("p2p_over_pcie", bool)):
        if d.get(key) is not None and not isinstance(d[key], kind):
            want = "an object" if kind is Mapping else "true or false"
            raise CostFileError(f"{where}: {key!r} must be {want}, got {type(d[key]).__name__}")
    defaults = {k: v for k, v in d.items() if k in _CHUNK_KEYS}
    per_chunk: dict[tuple[int, int], Mapping[str, Any]] = {}
    for key, entry in (d.get("chunks") or {}).items():
        try:
            parts = [int(x) for x in str(key).split(",")]
        except ValueError:
            parts = []
        if len(parts) == 2:
            rc = (parts[0], parts[1])
        elif len(parts) == 1 and 0 <= parts[0] < layout.num_stages:
            rc = rank_chunk_of(layout.placement, layout.p, parts[0])
        else:
            raise CostFileError(f"{where}: chunk key {key!r} must be 'rank,chunk' or a stage 0..{layout.num_stages - 1}")
        if rc not in specs:
            raise CostFileError(f"{where}: chunk {key!r} is not in the layout (p={layout.p}, v={layout.v})")
        if not isinstance(entry, Mapping):
            raise CostFileError(f"{where}: chunks[{key!r}] must be an object")
        per_chunk[rc] = entry
    ma = _num(d, "M_a_bytes", where, base.ma_bytes if base else float(1 << 30))
    w_frac = _num(d, "W_residual", where, 0.5)
    chunks = {rc: _chunk_from_dict({**defaults, **per_chunk.get(rc, {})}, spec, f"{where}: chunk {rc[0]},{rc[1]}", ma, w_frac)
              for rc, spec in specs.items()}
    b = base
    try:
        return CostModel(
            layout, chunks, ma,
            _num(d, "pcie_bytes_per_s", where, b.pcie_bytes_per_s if b else 25e9),
            bool(d.get("p2p_over_pcie", b.p2p_over_pcie if b else False)),
            _num(d, "ar_slowdown", where, b.ar_slowdown if b else AR_SLOWDOWN),
            int(_num(d, "samples_per_microbatch", where, b.samples_per_microbatch if b else 1)),
            int(_num(d, "tokens_per_sample", where, b.tokens_per_sample if b else 1)),
            _num(d, "model_flops_per_sample", where, b.model_flops_per_sample if b else 0.0),
            _num(d, "peak_flops", where, b.peak_flops if b else 0.0),
            "file", dict(d.get("meta") or {}),
            _num(d, "copy_duplex_slowdown", where, b.copy_duplex_slowdown if b else 2.0),
            _num(d, "ar_stretch", where, b.ar_stretch if b else 1.0),
            _num(d, "host_task_s", where, b.host_task_s if b else 0.0),
            _num(d, "a2a_slowdown", where) if "a2a_slowdown" in d else (b.a2a_slowdown if b else None))
    except ValueError as err:
        if isinstance(err, CostFileError):
            raise
        raise CostFileError(f"{where}: {err}") from None


def costs_to_dict(costs: CostModel) -> dict[str, Any]:
    """The cost-file form of ``costs`` (per-chunk totals with a per-unit split)."""
    chunks = {}
    for (r, c), cc in sorted(costs.chunks.items()):
        present = sorted(set(cc.instances()), key=list(Unit).index)
        chunks[f"{r},{c}"] = {
            "T_F": cc.total("f"), "T_B": cc.total("b"), "T_W": cc.total("w"), "T_AR": cc.total("ar_f"),
            "T_AR_B": cc.total("ar_b"), "T_P2P": cc.p2p, "activation_bytes": cc.total("act"),
            "w_residual_bytes": cc.total("w_res"),
            "unit_split": {key: {u.value: getattr(cc.units[u], attr) for u in present} for key, attr in _SPLITS.items()
                           if key not in ("A2A", "A2A_B")},
        }
        if cc.total("a2a_f") or cc.total("a2a_b"):  # an MoE chunk with expert parallelism
            chunks[f"{r},{c}"].update({"T_A2A": cc.total("a2a_f"), "T_A2A_B": cc.total("a2a_b")})
            chunks[f"{r},{c}"]["unit_split"].update({key: {u.value: getattr(cc.units[u], attr) for u in present}
                                                     for key, attr in (("A2A", "a2a_f"), ("A2A_B", "a2a_b"))})
        if any(cc.units[u].tmp for u in present):
            chunks[f"{r},{c}"]["unit_workspace"] = {u.value: cc.units[u].tmp for u in present}
    return {
        "format": FORMAT, "layout": {"tp": costs.layout.tp, "p": costs.layout.p, "v": costs.layout.v,
                                     "placement": costs.layout.placement},
        "M_a_bytes": costs.ma_bytes, "ar_slowdown": costs.ar_slowdown, "ar_stretch": costs.ar_stretch,
        "host_task_s": costs.host_task_s, "pcie_bytes_per_s": costs.pcie_bytes_per_s,
        **({"a2a_slowdown": costs.a2a_slowdown} if costs.a2a_slowdown is not None else {}),
        "p2p_over_pcie": costs.p2p_over_pcie, "copy_duplex_slowdown": costs.copy_duplex_slowdown,
        "samples_per_microbatch": costs.samples_per_microbatch,
        "tokens_per_sample": costs.tokens_per_sample, "model_flops_per_sample": costs.model_flops_per_sample,
        "peak_flops": costs.peak_flops, "meta": {**costs.meta, "source": costs.source}, "chunks": chunks,
    }


def write_costs(costs: CostModel, path: str | Path) -> None:
    """Write ``costs`` as a cost file (the format a profiler writes and :func:`read_costs` reads), atomically."""
    from braid.io.files import atomic_write_text

    atomic_write_text(path, json.dumps(costs_to_dict(costs), indent=1))


def read_costs(path: str | Path, layout: Layout, specs: Mapping[tuple[int, int], ChunkSpec],
               base: CostModel | None = None) -> CostModel:
    """Read a cost file; any problem is one :class:`CostFileError` naming the file and the key."""
    p = Path(path)
    return costs_from_dict(load_cost_json(p), layout, specs, base, where=str(p))


def load_cost_json(path: str | Path) -> dict[str, Any]:
    """The JSON object of a cost file, before it is checked against a layout; any problem reading it (missing,
    unreadable, not JSON, larger or deeper than :data:`braid.io.limits.COST_FILE`, not an object) is one :class:`CostFileError`."""
    try:
        return read_json(path, "cost file", limit=COST_FILE)
    except InputFileError as err:
        raise CostFileError(str(err)) from None
