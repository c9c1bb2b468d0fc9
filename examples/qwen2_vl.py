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

``--model``: a preset of ``braid.cost.catalog`` (``tiny``, ``small``, ``2b``, ``7b``, ``15b``
mean ``qwen2-vl-*``; ``qwen2.5-vl-*`` picks Qwen2.5-VL's tower). ``--hf DIR`` starts from a
Qwen2-VL / Qwen2.5-VL checkpoint (its ``config.json`` picks the tower), ``--save-hf DIR``
exports one that ``transformers`` loads.
"""

from __future__ import annotations

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


def _cfg(model, args):
    """The model's config with ``--image-size`` (the examples' images; a checkpoint's tower takes any size)."""
    cfg = model.cfg
    return cfg if args.image_size is None else replace(cfg, vit=replace(cfg.vit, image_size=args.image_size))


def _stage_layers(model, num_stages: int, args) -> tuple[int, ...]:
    from braid.models.qwen2_vl import vlm_stage_layers

    return vlm_stage_layers(model.cfg, num_stages, args.last_stage_lighter)


def _check(model, topo, num_stages: int, args) -> None:
    lm, vit = model.cfg.lm, _cfg(model, args).vit
    topo.check_model(num_heads=lm.heads, num_kv_heads=lm.kv_heads, vocab_size=lm.vocab_size, num_layers=lm.layers,
                     num_stages=max(topo.pp, num_stages - 1))  # stage 0 holds the ViT, not LM layers
    for what, n in (("ViT heads", vit.heads), ("ViT ffn", vit.ffn), ("LM ffn", lm.ffn),
                    ("patch features (3*2*patch^2)", vit.patch_dim)):
        if n % topo.tp:
            raise ValueError(f"{what} ({n}) not divisible by tp={topo.tp}; pick a tp that divides it")


def _source(model, args):
    from data import ShapesCaptions

    cfg = _cfg(model, args)
    return ShapesCaptions(cfg.vit.image_size, args.seq, cfg.lm.vocab_size, seed=args.seed, image_tokens=tuple(cfg.image_tokens()))


def _inputs(model, batch):
    return (batch["pixels"], batch["tokens"]), batch["labels"]


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
)

if __name__ == "__main__":
    sys.exit(main(TASK))
