"""What a profile or bench job runs on: the model (any registered family through the catalog, or a
vision-language preset: its tower on the first virtual stage, as ``examples/qwen2_vl.py`` runs it), the
layout, the data shape and the device; the shared command-line flags."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from braid.core.ir import Placement, Plan, ScheduleConfig
from braid.core.partition import chunk_specs, split_layers, stage_halves, whole_layers
from braid.cost.catalog import get_model
from braid.cost.costs import (
    Layout,
)
from braid.io.cli import (add_moe_dispatch_arg, add_seq_shard_arg, check_counts, check_cpu_ranks, check_moe_dispatch,
                          check_range, layer_count, local_seq, resolve_seq_shard)
from braid.io.limits import MAX_CTAS, MAX_LAYERS
from braid.models.registry import family_of_config
from braid.models.shapes import decoder_config, resolve_model
from braid.core.ctas import MAX_CTAS_TP2, MAX_CTAS_WIDER

# Per-layer shapes from the one preset list (braid.cost.catalog), built by their family's
# config class (braid.models.registry); the profiler's own choices are one layer
# (--layers-per-stage sets the count) and the vocabulary of its head.
_PER_LAYER = {"tiny": ("qwen2-toy", 128), "small": ("qwen2-small", 8192), "7b-layer": ("qwen2-7b", 32768)}
PRESETS: dict[str, Any] = {name: decoder_config(get_model(m), layers=1, vocab_size=v) for name, (m, v) in _PER_LAYER.items()}


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class ProfileConfig:
    """What to profile: model shape, layout and data shape (see the module doc).

    ``layers_per_stage``: decoder layers of each virtual stage (``pp * v`` entries; a half,
    e.g. ``(1, 1, 1.5, 0.5)``, cuts a layer between attention and MLP: :func:`braid.core.partition.stage_halves`);
    ``peak_flops``: the MFU denominator written to the file (0 = unknown).

    ``ep``: expert parallelism of a mixture-of-experts model (:mod:`braid.runtime.expert_parallel`): the job
    runs ``ep`` data-parallel replicas of the ``tp * pp`` layout (``dp = ep``; world ``tp * pp * ep``), each
    MoE layer's experts sharded over them, each replica on micro-batches of its own.

    ``vision``: a vision-language model's config (:class:`braid.models.qwen2_vl.Qwen2VLConfig`; its
    ``vit.image_size`` sets the image of every sample). Stage 0 is then its vision chunk (patch
    embedding, all ``layers_per_stage[0]`` ViT blocks, merge), the other stages hold LM layers,
    built by :func:`braid.models.vision_chunk.build_vlm_rank_chunks` as the example builds them;
    ``seq`` counts the LM's tokens per sample, the image's included; ``model`` is the LM's layer.
    """

    model: Any  # the family's config (braid.models.registry), one layer: ``layers_per_stage`` sets the count
    layers_per_stage: tuple[float, ...]
    seq: int = 16
    micro_batch_size: int = 1
    tp: int = 1
    pp: int = 1
    v: int = 2
    placement: Placement = "v"
    dtype: str = "float32"
    device: str = "cpu"
    iters: int = 5
    warmup: int = 1
    peak_flops: float = 0.0
    compile: bool | None = None  # compiled units (:mod:`braid.runtime.compiled`); None: on with CUDA
    tp_backend: str = "auto"  # braid.tp.comm backend, or "all": measure each and pick the best
    seq_shard: bool = False  # sequence parallelism inside TP (braid.tp.seq_shard; --sequence-parallel, on at tp > 1)
    vision: Any = None  # a vision-language model (see above); None: a decoder LM
    ep: int = 1  # expert-parallel degree (see above): dp = ep data-parallel replicas share each layer's experts
    moe_dispatch: str = "splits"  # how rows cross EP ranks: "splits" or "padded" (host-free; braid.runtime.expert_parallel)
    tp_max_ctas: int | None = None  # thread blocks of the TP group's NCCL kernels under nccl-capped (None: by TP size; 0: NCCL's default)
    ep_max_ctas: int = 0  # the same for the EP group's all-to-all (0: NCCL's default)
    ep_backend: str = "nccl"  # the EP exchanges: NCCL's kernels, or "nccl-ce" (copy engines; padded dispatch)

    def __post_init__(self) -> None:
        Layout(self.tp, self.pp, self.v, self.placement)  # validates degrees and placement
        from braid.runtime.expert_parallel import check_expert_layout

        check_expert_layout(self.ep, self.dp, experts=getattr(self.model, "experts", 0), tp=self.tp)
        check_moe_dispatch(self.moe_dispatch, ep=self.ep, tp=self.tp)
        from braid.runtime.expert_parallel import check_ep_backend

        check_ep_backend(self.ep_backend, max_ctas=self.ep_max_ctas, dispatch=self.moe_dispatch)
        for what, n in (("--tp-max-ctas", self.tp_max_ctas), ("--ep-max-ctas", self.ep_max_ctas)):
            if n is not None and not 0 <= n <= MAX_CTAS:
                raise ValueError(f"{what} {n}: thread blocks per NCCL kernel, 1..{MAX_CTAS}, or 0 for NCCL's default")
        if self.tp_backend != "all":
            from braid.tp.comm import resolve_tp_backend

            resolve_tp_backend(self.tp_backend, self.device)  # one clear error for a backend that cannot run here
        if len(self.layers_per_stage) != self.pp * self.v:
            raise ValueError(f"layers_per_stage has {len(self.layers_per_stage)} entries; pp*v = {self.pp * self.v} stages need one each")
        if any(h < 1 for h in stage_halves(self.layers_per_stage)):
            raise ValueError(f"every stage needs at least half a layer, got {self.layers_per_stage}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.seq < 1 or self.micro_batch_size < 1 or self.iters < 1 or self.warmup < 0:
            raise ValueError("seq, micro_batch_size and iters must be >= 1 and warmup >= 0")
        local_seq(self.seq, self.tp, self.seq_shard)  # a sequence the TP ranks cannot split: one clear error
        for what, n in (("heads", self.model.heads), ("KV heads", self.model.kv_heads), ("ffn", self.model.ffn),
                        ("vocab", self.model.vocab_size)):
            if n % self.tp:
                raise ValueError(f"tp={self.tp} must divide the model's {what} ({n})")
        if self.vision is not None:
            self._check_vision()

    def _check_vision(self) -> None:
        from braid.io.cli import NO_SEQ_SHARD_VISION

        vit, first = self.vision.vit, self.layers_per_stage[0]
        if first != vit.layers or not whole_layers(self.layers_per_stage):
            raise ValueError(f"a vision-language model's stage 0 holds all {vit.layers} ViT blocks and the others whole "
                             f"LM layers, got layers per stage {','.join(map(str, self.layers_per_stage))}")
        for what, n in (("ViT heads", vit.heads), ("ViT ffn", vit.ffn), ("patch features (channels*2*patch^2)", vit.patch_dim)):
            if n % self.tp:
                raise ValueError(f"tp={self.tp} must divide the vision tower's {what} ({n})")
        if self.seq_shard:
            raise ValueError(NO_SEQ_SHARD_VISION)
        if self.seq <= len(self.vision.image_tokens()):
            raise ValueError(f"seq {self.seq} holds no text after the image's {len(self.vision.image_tokens())} tokens")

    @property
    def dp(self) -> int:
        """Data-parallel replicas of the layout: the expert-parallel ranks (1 without expert parallelism)."""
        return self.ep

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Global indices of the (LM) layers that are mixtures of experts (none for a dense model)."""
        is_moe = getattr(self.model, "is_moe", None)
        return tuple(i for i in range(self.num_layers) if is_moe(i)) if is_moe is not None else ()

    @property
    def layout(self) -> Layout:
        return Layout(self.tp, self.pp, self.v, self.placement)

    @property
    def num_layers(self) -> int:
        """Decoder (LM) layers the stages hold."""
        if self.vision is not None:
            return int(sum(self.layers_per_stage[1:]))
        return sum(stage_halves(self.layers_per_stage)) // 2

    @property
    def peer_layers_per_stage(self) -> tuple[int, ...]:
        """The layout for the external baselines, which split whole layers: :attr:`layers_per_stage`
        itself, or where a stage holds half a layer, the layers spread as evenly as whole layers go
        (``ValueError`` where there are fewer layers than stages)."""
        if whole_layers(self.layers_per_stage):
            return tuple(int(n) for n in self.layers_per_stage)
        return split_layers(self.num_layers, len(self.layers_per_stage))

    def full_model(self) -> Any:
        """The model config with as many (LM) layers as the stages hold."""
        if self.vision is not None:
            return replace(self.vision, lm=replace(self.vision.lm, layers=self.num_layers))
        return replace(self.model, layers=self.num_layers)

    def specs(self, placement: Placement) -> dict:
        """``(rank, chunk) -> ChunkSpec`` of this split under ``placement`` (the vision stage ends with ``merge``)."""
        return chunk_specs(self.layers_per_stage, self.pp, placement, moe_layers=self.moe_layers, vision=self.vision is not None)

    def micro_batches(self, m: int, dev: torch.device, seed: int = 7, dp_rank: int = 0) -> tuple[list[Any], list[torch.Tensor]]:
        """``m`` random micro-batches (items, labels) as the executor takes them: token ids, or a
        vision-language model's ``(images, input_ids)`` (:func:`braid.models.qwen2_vl.synthetic_batch`);
        each data-parallel replica (``dp_rank``) its own, as in real data parallelism."""
        g = torch.Generator().manual_seed(seed + 1_000_003 * dp_rank)
        b = self.micro_batch_size
        if self.vision is not None:
            from braid.models.qwen2_vl import synthetic_batch

            got = [synthetic_batch(self.vision, b, self.seq, g) for _ in range(m)]
            dtype = DTYPES[self.dtype]  # pixels in the model's dtype, as the examples' loader gives them
            return ([tuple(t.to(dev, dtype if t.is_floating_point() else t.dtype) for t in item) for item, _ in got],
                    [lab.to(dev) for _, lab in got])
        v = self.model.vocab_size
        toks = [torch.randint(0, v, (b, self.seq), generator=g).to(dev) for _ in range(m)]
        labs = [torch.randint(0, v, (b, self.seq), generator=g).to(dev) for _ in range(m)]
        return toks, labs

    def build_model(self, device: torch.device | str = "cpu") -> torch.nn.Module:
        """The single-device model of :meth:`full_model` on the CPU, in :attr:`dtype`, every parameter
        initialised from seed 1234 and its name (:mod:`braid.models.init`), so every rank builds the
        same weights. Built on the meta device and materialised once: constructing it for real would
        first give every linear layer its default (Kaiming-uniform) values, only for the family's
        initialisation to overwrite them -- most of the ~15 s a 7B-shaped model of four layers took.

        A vision-language model stays on the meta device, its values by name on ``device``: each
        rank materialises only its own chunks, as the example does (no baseline runs it whole)."""
        from braid.models.build import materialize, meta_model

        if self.vision is not None:
            from braid.models.qwen2_vl import Qwen2VLModel

            return meta_model(Qwen2VLModel, self.full_model(), seed=1234, device=device, dtype=DTYPES[self.dtype])

        return materialize(meta_model(family_of_config(self.model).model_cls, self.full_model(), seed=1234,
                                      dtype=DTYPES[self.dtype]))

    def act_shape(self) -> tuple[int, int, int]:
        """The tensor between stages: (micro-batch size, this rank's tokens, hidden)."""
        return (self.micro_batch_size, local_seq(self.seq, self.tp, self.seq_shard), self.model.hidden)


def build_chunks(pc: ProfileConfig, groups, dev: torch.device, m: int = 1, plan: Plan | None = None,
                 model: torch.nn.Module | None = None, experts: Any = None) -> dict:
    """This rank's TP-sharded model chunks on ``dev`` (same seed on every rank, so shards agree),
    cut from ``model`` (default: a fresh :meth:`ProfileConfig.build_model`; a 7B-shaped one takes
    seconds to initialise, so a job that has it passes it). ``experts``: this rank's
    :class:`braid.runtime.expert_parallel.ExpertGroups` at ``pc.ep > 1``: every MoE layer keeps its
    expert-parallel share of the experts and sends its rows through the all-to-all, as the examples run it."""
    from braid.models.build import build_rank_chunks

    plan = plan or Plan("profile", ScheduleConfig(pc.pp, m, pc.v), pc.placement, tuple(() for _ in range(pc.pp)))
    model = pc.build_model(dev) if model is None else model
    tp_group = groups.tp if pc.tp > 1 else None
    if pc.vision is not None:  # the example's builder: vision chunk on stage 0, M-RoPE LM chunks after
        from braid.models.vision_chunk import build_vlm_rank_chunks

        chunks = build_vlm_rank_chunks(model, plan, groups.coords.pp, [int(n) for n in pc.layers_per_stage],
                                       tp_rank=groups.coords.tp, tp_size=pc.tp, tp_group=tp_group)
    else:
        chunks = build_rank_chunks(model, plan, groups.coords.pp, pc.layers_per_stage, tp_rank=groups.coords.tp,
                                   tp_size=pc.tp, tp_group=tp_group, seq_shard=pc.seq_shard)
    if experts is not None:
        from braid.runtime.expert_parallel import shard_experts

        shard_experts(chunks.values(), experts.ep_rank, experts.ep, experts, pc.moe_dispatch)
    from braid.runtime.compiled import resolve, set_compiled

    set_compiled(chunks.values(), resolve(pc.compile, dev))  # units timed as the executor runs them
    return {c: ch.to(dev) for c, ch in chunks.items()}


def device_name(device: str) -> str:
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({os.cpu_count()} cores)"


# ----------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------
def add_model_args(ap: argparse.ArgumentParser) -> None:
    """Flags shared with ``python -m braid.bench``: model, layout, data shape, device."""
    ap.add_argument("--preset", default=None, help=f"per-layer shape preset: {', '.join(PRESETS)} (default tiny)")
    ap.add_argument("--model", default=None,
                    help="instead of --preset: any catalog model of a registered family (qwen2-7b, llama3-8b, ...) or a "
                         "Hugging Face config.json; its layer shape and vocabulary, one layer per --layers-per-stage. A "
                         "vision-language preset (qwen2-vl-tiny, qwen2-vl-7b, qwen2.5-vl-7b, ...) runs as examples/qwen2_vl.py "
                         "does: its vision tower (with the merger) is stage 0, its LM layers split as the simulator splits them")
    for flag in ("hidden", "heads", "kv-heads", "ffn", "vocab"):
        ap.add_argument(f"--{flag}", type=int, default=None, help=f"override the preset's or model's {flag}")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    ap.add_argument("--pp", type=int, default=2, help="pipeline ranks (default 2)")
    ap.add_argument("--chunks", type=int, default=2, help="chunks (virtual stages) per rank (default 2)")
    ap.add_argument("--ep", type=int, default=1,
                    help="expert-parallel degree of a mixture-of-experts --model (qwen3-moe-*): E data-parallel replicas "
                         "of the tp x pp layout (world tp*pp*E), each on micro-batches of its own, share every MoE "
                         "layer's experts, whose rows go through the all-to-all as in examples/train_cli.py --ep (default 1)")
    add_moe_dispatch_arg(ap)
    ap.add_argument("--tp-max-ctas", type=int, default=None, metavar="N",
                    help="thread blocks NCCL gives the TP group's collectives under nccl-capped: fewer leave more SMs to the "
                         f"GEMMs braided beside them, more move the bytes faster (0: NCCL's default; default {MAX_CTAS_TP2} at tp=2, "
                         f"{MAX_CTAS_WIDER} at tp >= 4, as measured)")
    ap.add_argument("--ep-max-ctas", type=int, default=0, metavar="N",
                    help="the same cap for the expert-parallel group's all-to-all (0: NCCL's default, the default)")
    ap.add_argument("--ep-backend", choices=("nccl", "nccl-ce"), default="nccl",
                    help="the expert-parallel exchanges: NCCL's kernels (default), or nccl-ce, the copy engines through "
                         "registered staging buffers (NCCL >= 2.28; no SMs beside the braided compute; --moe-dispatch padded)")
    ap.add_argument("--layers-per-stage", default=None, help="layers of each virtual stage: one number or a comma list, whole or half layers "
                         "(1,1,1.5,0.5 cuts layer 3 between attention and MLP; default 1). A vision-language model: "
                         "LM layers of each stage after the tower's (one number), or the whole list with the ViT blocks "
                         "first; default the model's own split (braid.simulate's, the example's)")
    ap.add_argument("--seq", type=int, default=16, help="sequence length (default 16); a vision-language model: text tokens "
                         "after the image's, as examples/qwen2_vl.py --seq")
    ap.add_argument("--image-size", type=int, default=None, help="a vision-language model's image side in pixels, one "
                         "image per sample (default the preset's; (size/patch/merge)^2 visual tokens)")
    ap.add_argument("--micro-batch-size", type=int, default=1, help="samples per micro-batch (default 1)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when enough GPUs, else cpu")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--iters", type=int, default=5, help="measured repetitions per unit (median; default 5)")
    ap.add_argument("--peak-flops", type=float, default=None, help="MFU denominator per device (default: 989e12 on cuda, 0 on cpu)")
    ap.add_argument("--tp-backend", default="auto",
                    help="how TP all-reduces run (braid.tp.comm): auto, nccl-capped, nccl, nccl-zero-cta, nccl-ce, symm-mem, gloo; "
                         "or 'all': measure each available one alone and beside a GEMM and use the best (default auto: "
                         "nccl-capped, or nccl-ce under --sequence-parallel where NCCL >= 2.28)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile the units' element-wise functions (default: on with CUDA, off on CPU)")
    add_seq_shard_arg(ap)


def config_from_args(ap: argparse.ArgumentParser, args: argparse.Namespace, placement: Placement = "v") -> ProfileConfig:
    """A :class:`ProfileConfig` from the shared flags; bad values exit with one line (code 2)."""
    if args.preset is not None and args.model is not None:
        ap.error("--preset and --model name the model twice; give one")
    if args.model is None and (args.preset or "tiny") not in PRESETS:
        ap.error(f"unknown preset {args.preset!r}; valid names: {', '.join(PRESETS)}")
    check_counts(ap, args, ("image_size",))
    vision = None
    try:
        shape = resolve_model(args.model) if args.model is not None else get_model(_PER_LAYER[args.preset or "tiny"][0])
        cfg = decoder_config(shape, layers=1) if args.model is not None else PRESETS[args.preset or "tiny"]
        if args.model is not None and shape.vit is not None:
            from braid.models.qwen2_vl import vl_config

            vision = vl_config(shape, args.image_size)  # an image side the patches do not tile: one line here
    except ValueError as err:
        ap.error(str(err))
    if vision is None and args.image_size is not None:
        ap.error("--image-size sets a vision-language model's images; pick one with --model (qwen2-vl-tiny, qwen2-vl-7b, ...)")
    check_counts(ap, args, ("hidden", "heads", "kv_heads", "ffn", "vocab", "tp", "pp", "chunks", "ep", "seq", "micro_batch_size",
                            "iters"))
    check_range(ap, "--peak-flops", args.peak_flops, 0.0, 1e18)
    overrides = {key: getattr(args, flag) for flag, key in (("hidden", "hidden"), ("heads", "heads"), ("kv_heads", "kv_heads"),
                                                             ("ffn", "ffn"), ("vocab", "vocab_size")) if getattr(args, flag) is not None}
    if vision is not None and overrides:
        ap.error(f"--{next(iter(overrides)).replace('_size', '').replace('_', '-')}: a vision-language --model runs at its "
                 "preset's shape (its tower and M-RoPE follow from it); pick another preset")
    from braid.runtime.expert_parallel import check_expert_layout

    try:  # the experts' layout before the ranks are counted: the runtime's own check (dp = ep here)
        check_expert_layout(args.ep, args.ep, experts=getattr(cfg, "experts", 0), tp=args.tp)
        check_moe_dispatch(args.moe_dispatch, ep=args.ep, tp=args.tp)
    except ValueError as err:
        ap.error(str(err))
    world, what = args.tp * args.pp * args.ep, "tp x pp" + (" x ep" if args.ep > 1 else "")
    device = args.device or ("cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "cpu")
    if device == "cpu":
        check_cpu_ranks(ap, world, what)
    if device == "cuda" and torch.cuda.device_count() < world:
        ap.error(f"--device cuda with {what} = {world} ranks needs {world} GPUs; {torch.cuda.device_count()} visible")
    from braid.runtime.compiled import resolve as resolve_compile

    try:
        stages = args.pp * args.chunks
        if vision is not None and args.layers_per_stage is None:
            from braid.cost.costs import Layout as CostLayout, model_stage_layers

            lps = list(model_stage_layers(shape, CostLayout(1, args.pp, args.chunks)))
        else:
            try:
                lps = [layer_count(x) for x in str(args.layers_per_stage or "1").split(",")]
            except argparse.ArgumentTypeError as err:
                raise ValueError(f"--layers-per-stage {args.layers_per_stage!r}: {err} (one number or a comma list of "
                                 "whole or half layers: 2, 1.5)") from None
        if len(lps) == 1:
            lps = [vision.vit.layers] + lps * (stages - 1) if vision is not None else lps * stages
        if sum(lps) > MAX_LAYERS:
            raise ValueError(f"--layers-per-stage {args.layers_per_stage}: {sum(lps):g} layers over {len(lps)} stages, at most "
                             f"{MAX_LAYERS} (more than any real model)")
        model = replace(cfg, **overrides)
        peak = args.peak_flops if args.peak_flops is not None else (989e12 if device == "cuda" else 0.0)
        seq = args.seq + (len(vision.image_tokens()) if vision is not None else 0)  # the LM's tokens per sample
        return ProfileConfig(model, tuple(lps), seq, args.micro_batch_size, args.tp, args.pp, args.chunks,
                             placement if args.chunks == 2 else "loop", args.dtype or ("bfloat16" if device == "cuda" else "float32"),
                             device, args.iters, 1, peak, resolve_compile(args.compile, device), args.tp_backend,
                             resolve_seq_shard(args.sequence_parallel, args.tp, seq=seq, vision=vision is not None,
                                               moe=bool(getattr(cfg, "experts", 0))),
                             vision=vision, ep=args.ep, moe_dispatch=args.moe_dispatch, tp_max_ctas=args.tp_max_ctas,
                             ep_max_ctas=args.ep_max_ctas, ep_backend=args.ep_backend)
    except ValueError as err:
        ap.error(str(err))
        raise  # unreachable: error() exits


DEFAULT_SCHEDULES = ("braided_v", "1f1b_i", "zb_v")


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One bench job: what to profile/run, which schedules and micro-batch counts, how many steps."""

    profile: ProfileConfig
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    mbs: tuple[int, ...] = (4, 8)
    warmup: int = 2
    steps: int = 5
    costs: dict[str, Any] | None = None  # a cost-file dict instead of a fresh profile
    external: bool = True
    calibrate: bool = True  # fit a fresh profile to a measured probe run (see :func:`calibrate`)
    rounds: int = 1  # every run (schedules and baselines) this many times in turn; see :func:`round_ratios`
    cuda_graph: str | None = None  # braid's runs: "none", "step" or None (graphs where capturable; braid.runtime.graphs)
    peers: tuple[Any, ...] | None = None  # external rows (braid.measure.peers.PeerRun: baseline x mode); None: the defaults
    partial_json: str | None = None  # rank 0 writes the summary so far here after each round but the last
    probe_mbs: int | None = None  # the calibration probe's m (None: calibrate.probe_mbs's default)
    compute_busy: bool = False  # profile one more step per run and row in the first round: compute per rank (CUDA)
    memory_snapshot: str | None = None  # the first run records one more step's allocator history here (braid.measure.snapshot)
