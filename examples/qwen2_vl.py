"""Train a Qwen2-VL / Qwen2.5-VL vision-language model with a braided (or any registered) pipeline schedule.

The vision tower (patch embedding, 2D-rotary blocks, 2x2 patch merger; Qwen2.5-VL's with
window attention) is the first virtual stage on device 0; the Qwen2 language model's layers
(M-RoPE) are spread over the other virtual stages, the last one ``--last-stage-lighter``
layers lighter (paper Sec. 5, MLLM). The LM reads ``<vision_start> <image_pad>...
<vision_end> caption``, the image pads replaced by the visual tokens, and is trained on the
caption only. Data: synthetic shape-caption pairs (``examples/data.py``: a coloured shape at
one of four positions, captioned "a red disc at top left"), deterministic by seed.

    python examples/qwen2_vl.py --steps 40
    python examples/qwen2_vl.py --model qwen2.5-vl-tiny --steps 40
    torchrun --nproc-per-node 4 examples/qwen2_vl.py --schedule braided_v --tp 2 --pp 2
    torchrun --nproc-per-node 4 examples/qwen2_vl.py --hf DIR --tp 2 --pp 2 --schedule braided_v --reference

``--image-sizes 16,24,32`` draws each sample's image side from a list (dynamic resolution,
deterministic by seed): every micro-batch is padded to one visual-token budget
(``--visual-token-budget``, default: the most a micro-batch can need), the padding its own
attention segment and out of the LM's input, so every step has one shape (one CUDA graph) and
the real tokens' loss and gradients are the unpadded model's (``braid.models.vlm_pack``). The
budget, the number of sizes and the padding share are printed at the start.

``--model``: a preset of ``braid.cost.catalog`` (``tiny``, ``small``, ``2b``, ``7b``, ``15b``
mean ``qwen2-vl-*``; ``qwen2.5-vl-*`` picks Qwen2.5-VL's tower). ``--hf DIR`` starts from a
Qwen2-VL / Qwen2.5-VL checkpoint (its ``config.json`` picks the tower), ``--save-hf DIR``
exports one that ``transformers`` loads.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from train_loop import Task, main  # noqa: E402

from braid.cost.catalog import MODELS  # noqa: E402

_VL = "qwen2-vl-"
PRESETS = tuple([n.removeprefix(_VL) for n, m in MODELS.items() if m.vit is not None and n.startswith(_VL)]
                + [n for n, m in MODELS.items() if m.vit is not None])


def _build(args):
    """The preset's model on the meta device: each rank materialises only its chunks
    (by-name initialisation on its device, so the unsplit reference gets the same weights)."""
    from braid.models.build import meta_model
    from braid.models.qwen2_vl import Qwen2VLModel, vlm_preset
    from train_step import pick_device

    return meta_model(Qwen2VLModel, vlm_preset(args.model), seed=args.seed, std=args.init_std, device=pick_device(args))


log = logging.getLogger("braid.examples")
SCAN_MICRO_BATCHES = 100_000  # micro-batches whose image sizes the start-up report and budget check read


def _add_args(group) -> None:
    group.add_argument("--image-size", type=int, default=None, help="image side in pixels (default: the preset's)")
    group.add_argument("--image-sizes", type=_sides, default=None, metavar="S1,S2,...",
                       help="dynamic resolution: each sample's image side drawn from these (multiples of patch*merge); "
                            "micro-batches padded to --visual-token-budget, one shape for the whole run")
    group.add_argument("--visual-token-budget", type=int, default=None, metavar="N",
                       help="with --image-sizes: visual tokens every micro-batch is padded to (default: the most one can "
                            "need, --micro-batch-size x the largest image's); a micro-batch of the run above it is an error")


def _sides(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give image sides as integers separated by commas, e.g. 224,336,448") from None


def _cfg(model, args):
    """The model's config with ``--image-size`` or the largest of ``--image-sizes`` (the examples' images; a
    checkpoint's tower takes any size). ``ValueError`` (one line) for sizes the tower cannot take."""
    cfg = model.cfg
    if args.image_sizes is not None:
        from braid.models.vlm_pack import check_image_sizes

        if args.image_size is not None:
            raise ValueError("--image-size and --image-sizes: give one of them")
        check_image_sizes(cfg.vit, args.image_sizes)
        return replace(cfg, vit=replace(cfg.vit, image_size=max(args.image_sizes)))
    if args.visual_token_budget is not None:
        raise ValueError("--visual-token-budget pads micro-batches of images of several sizes: it needs --image-sizes")
    return cfg if args.image_size is None else replace(cfg, vit=replace(cfg.vit, image_size=args.image_size))


def _budget(model, args) -> int:
    """Visual tokens per micro-batch under ``--image-sizes``: ``--visual-token-budget`` or the most one can need."""
    from braid.models.vlm_pack import image_tokens_of

    most = args.micro_batch_size * image_tokens_of(model.cfg.vit, max(args.image_sizes))
    return most if args.visual_token_budget is None else args.visual_token_budget


def _stage_layers(model, num_stages: int, args) -> tuple[int, ...]:
    from braid.models.qwen2_vl import vlm_stage_layers

    return vlm_stage_layers(model.cfg, num_stages, args.last_stage_lighter)


def _check(model, topo, num_stages: int, args) -> None:
    lm, vit = model.cfg.lm, _cfg(model, args).vit
    if args.image_sizes is not None:
        from braid.io.limits import count_error

        for side in args.image_sizes:
            if why := count_error("image_size", side):
                raise ValueError(why.replace("--image-size", "--image-sizes"))
        if why := count_error("visual_token_budget", args.visual_token_budget):
            raise ValueError(why)
        if torch_names := [n for n in args.schedule if n.startswith("torch_")]:
            raise ValueError(f"--image-sizes: {torch_names[0]} stacks one image size per run; use braid's schedules")
    topo.check_model(num_heads=lm.heads, num_kv_heads=lm.kv_heads, vocab_size=lm.vocab_size, num_layers=lm.layers,
                     num_stages=max(topo.pp, num_stages - 1))  # stage 0 holds the ViT, not LM layers
    for what, n in (("ViT heads", vit.heads), ("ViT ffn", vit.ffn), ("LM ffn", lm.ffn),
                    ("patch features (3*2*patch^2)", vit.patch_dim)):
        if n % topo.tp:
            raise ValueError(f"{what} ({n}) not divisible by tp={topo.tp}; pick a tp that divides it")


def _source(model, args):
    from data import ShapesCaptions

    cfg = _cfg(model, args)
    if args.image_sizes is None:
        return ShapesCaptions(cfg.vit.image_size, args.seq, cfg.lm.vocab_size, seed=args.seed,
                              image_tokens=tuple(cfg.image_tokens()))
    from braid.models.vlm_pack import image_tokens_of

    sides = tuple(sorted(set(args.image_sizes)))
    tokens = {s: tuple(cfg.image_tokens(image_tokens_of(cfg.vit, s))) for s in sides}
    source = ShapesCaptions(cfg.vit.image_size, args.seq, cfg.lm.vocab_size, seed=args.seed, image_tokens=tokens,
                            image_sizes=sides)
    _report_padding(source, cfg, args, _budget(model, args))
    return source


def _report_padding(source, cfg, args, budget: int) -> None:
    """The budget check over the run's micro-batches (their first :data:`SCAN_MICRO_BATCHES`: ``ValueError`` naming
    the first one above the budget) and, on rank 0, the start-up line: budget, sizes, padding share."""
    from braid.models.vlm_pack import image_tokens_of, padding_waste

    b = args.micro_batch_size
    count = min(args.steps * args.dp * args.mbs, SCAN_MICRO_BATCHES)
    real = [sum(image_tokens_of(cfg.vit, source.side(k * b + j)) for j in range(b)) for k in range(count)]
    over = next((k for k, n in enumerate(real) if n > budget), None)
    if over is not None:
        raise ValueError(f"--visual-token-budget {budget}: micro-batch {over} of the run (global step "
                         f"{over // (args.dp * args.mbs) + 1}) needs {real[over]} visual tokens; give at least {max(real)}")
    if int(os.environ.get("RANK", "0")) == 0:
        whole = "the run's" if count == args.steps * args.dp * args.mbs else "the first"
        log.info("dynamic resolution: %d image sizes (%s px), one padded shape: visual-token budget %d per micro-batch "
                 "(%d samples), padding %.1f%% of visual tokens over %s %d micro-batches", len(source.image_sizes),
                 ", ".join(map(str, source.image_sizes)), budget, b, 100 * padding_waste(real, budget), whole, count)


def _inputs(model, batch, args):
    if args.image_sizes is None:
        return (batch["pixels"], batch["tokens"]), batch["labels"]
    from braid.models.vlm_pack import pack_images

    return pack_images(model.cfg, list(batch["pixels"]), batch["tokens"], _budget(model, args)), batch["labels"]


def _chunks(model, plan, pp_rank, stage_layers, tp_rank, tp_size, tp_group, sp=None, seq_len=None):
    from braid.models.vision_chunk import build_vlm_rank_chunks

    return build_vlm_rank_chunks(model, plan, pp_rank, stage_layers, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group)


def _flops(model, args) -> float:
    from braid.models.qwen2_vl import vlm_train_flops_per_sample

    return vlm_train_flops_per_sample(_cfg(model, args), args.seq)


TASK = Task(
    prog="qwen2_vl.py",
    description="\n\n".join(__doc__.split("\n\n")[:2]),
    build_model=_build,
    stage_layers=_stage_layers,
    check=_check,
    build_chunks=_chunks,
    source=_source,
    inputs=_inputs,
    seq_len=lambda model, args: len(_cfg(model, args).image_tokens()) + args.seq,
    flops_per_sample=_flops,
    default_seq=16,
    vision=True,
    models=PRESETS,
    add_args=_add_args,
)

if __name__ == "__main__":
    sys.exit(main(TASK))
