"""Train a Qwen2-VL-shaped vision-language model with a braided (or any registered) pipeline schedule.

The ViT (patch embedding, 2D-rotary blocks, 2x2 patch merger: Qwen2-VL's tower) is the
first virtual stage on device 0; the Qwen2 language model's layers (M-RoPE) are spread over
the other virtual stages, the last one ``--last-stage-lighter`` layers lighter (paper
Sec. 5, MLLM). The LM reads ``<vision_start> <image_pad>... <vision_end> caption``, the
image pads replaced by the visual tokens, and is trained on the caption only. Data:
synthetic shape-caption pairs (``examples/data.py``: a coloured shape at one of four
positions, captioned "a red disc at top left"), deterministic by seed.

    python examples/qwen2_vl.py --steps 40
    torchrun --nproc-per-node 4 examples/qwen2_vl.py --schedule braided_v --tp 2 --pp 2
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from train_loop import Task, main  # noqa: E402


def _build(args):
    from braid.models.qwen2_vl import Qwen2VLModel, vlm_preset

    model = Qwen2VLModel(vlm_preset(args.model, args.image_size))
    model.reset_parameters(args.init_std)
    return model


def _stage_layers(model, num_stages: int, args) -> tuple[int, ...]:
    from braid.models.qwen2_vl import vlm_stage_layers

    return vlm_stage_layers(model.cfg, num_stages, args.last_stage_lighter)


def _check(model, topo, num_stages: int, args) -> None:
    lm, vit = model.cfg.lm, model.cfg.vit
    topo.check_model(num_heads=lm.heads, num_kv_heads=lm.kv_heads, vocab_size=lm.vocab_size, num_layers=lm.layers,
                     num_stages=max(topo.pp, num_stages - 1))  # stage 0 holds the ViT, not LM layers
    for what, n in (("ViT heads", vit.heads), ("ViT ffn", vit.ffn), ("LM ffn", lm.ffn),
                    ("patch features (3*2*patch^2)", vit.patch_dim)):
        if n % topo.tp:
            raise ValueError(f"{what} ({n}) not divisible by tp={topo.tp}; pick a tp that divides it")


def _source(model, args):
    from data import ShapesCaptions

    return ShapesCaptions(model.cfg.vit.image_size, args.seq, model.cfg.lm.vocab_size, seed=args.seed,
                          image_tokens=tuple(model.cfg.image_tokens()))


def _inputs(model, batch):
    return (batch["pixels"], batch["tokens"]), batch["labels"]


def _chunks(model, plan, pp_rank, stage_layers, tp_rank, tp_size, tp_group, sp=None, seq_len=None):
    from braid.models.vision_chunk import build_vlm_rank_chunks

    return build_vlm_rank_chunks(model, plan, pp_rank, stage_layers, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group)


def _flops(model, args) -> float:
    from braid.models.qwen2_vl import vlm_train_flops_per_sample

    return vlm_train_flops_per_sample(model.cfg, args.seq)


TASK = Task(
    prog="qwen2_vl.py",
    description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1],
    build_model=_build,
    stage_layers=_stage_layers,
    check=_check,
    build_chunks=_chunks,
    source=_source,
    inputs=_inputs,
    seq_len=lambda model, args: len(model.cfg.image_tokens()) + args.seq,
    flops_per_sample=_flops,
    default_seq=16,
    vision=True,
)

if __name__ == "__main__":
    sys.exit(main(TASK))
