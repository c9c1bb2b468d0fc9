"""Train a decoder language model (Qwen2, Llama: any family of ``braid.models.registry``) with a braided
(or any registered) pipeline schedule.

``--model``: any language-model preset of ``braid.cost.catalog`` (``tiny``, ``small``, ``7b``,
``15b`` mean ``qwen2-*``), built by its family's module. Layers are split evenly over the
virtual stages, the last one ``--last-stage-lighter`` layers lighter (its head over a large
vocabulary is heavy; paper Sec. 5). Data: synthetic
arithmetic progressions modulo the vocabulary (``examples/data.py``), deterministic by
seed, the loss falls within tens of steps; or ``--data`` text files with ``--tokenizer``
(:mod:`braid.training.data`).

    python examples/lm.py --steps 40
    torchrun --nproc-per-node 2 examples/lm.py --schedule braided_v --pp 2

``examples/qwen2.py`` is this script under the name of its first family.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from train_loop import Task, main  # noqa: E402

from braid.cost.catalog import MODELS  # noqa: E402

PRESETS = ("tiny", "small", "7b", "15b") + tuple(n for n, m in MODELS.items() if m.vit is None)  # short: qwen2-*


def _build(args):
    """The preset's model on the meta device: each rank materialises only its chunks
    (by-name initialisation on its device, so the unsplit reference gets the same weights)."""
    from braid.models.build import meta_model
    from braid.models.registry import get_family
    from braid.models.shapes import decoder_config, resolve_model
    from train_step import pick_device

    preset = resolve_model(args.model)
    return meta_model(get_family(preset.family).model_cls, decoder_config(preset), seed=args.seed, std=args.init_std,
                      device=pick_device(args))


def _stage_layers(model, num_stages: int, args) -> tuple[int, ...]:
    from braid.core.partition import split_layers

    return split_layers(model.cfg.layers, num_stages, last_stage_lighter=args.last_stage_lighter)


def _check(model, topo, num_stages: int, args) -> None:
    cfg = model.cfg
    topo.check_model(num_heads=cfg.heads, num_kv_heads=cfg.kv_heads, vocab_size=cfg.vocab_size, num_layers=cfg.layers, num_stages=num_stages)
    if cfg.ffn % topo.tp:
        raise ValueError(f"ffn ({cfg.ffn}) not divisible by tp={topo.tp}; pick a tp that divides it")
    experts = getattr(cfg, "experts", 0)
    if experts % topo.tp:
        raise ValueError(f"the {experts} experts per layer are split over TP ranks; tp={topo.tp} must divide them")


def _source(model, args):
    if args.data:
        from braid.training.data import PackedText

        return PackedText(args.data, args.tokenizer, args.seq, vocab_size=model.cfg.vocab_size, seed=args.seed,
                          text_field=args.text_field)
    from data import CountingText

    return CountingText(args.seq, model.cfg.vocab_size, seed=args.seed)


def _chunks(model, plan, pp_rank, stage_layers, tp_rank, tp_size, tp_group, sp=None, seq_len=None, seq_shard=False):
    from braid.models.build import build_rank_chunks

    return build_rank_chunks(model, plan, pp_rank, stage_layers, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group,
                             sp=sp, seq_len=seq_len, seq_shard=seq_shard)


def _flops(model, args) -> float:
    from braid.cost.costs import model_forward_flops
    from braid.models.registry import family_of
    from braid.models.shapes import from_decoder_config

    return 3 * model_forward_flops(from_decoder_config("lm", model.cfg, family_of(model).name, seq=args.seq, micro_batch_size=1))


TASK = Task(
    prog="lm.py",
    description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1],
    build_model=_build,
    stage_layers=_stage_layers,
    check=_check,
    build_chunks=_chunks,
    source=_source,
    inputs=lambda model, batch, args: (batch["tokens"], batch["labels"]),
    seq_len=lambda model, args: args.seq,
    flops_per_sample=_flops,
    default_seq=32,
    models=PRESETS,
)

if __name__ == "__main__":
    sys.exit(main(TASK))
