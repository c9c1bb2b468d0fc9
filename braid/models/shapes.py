"""Between the cost model's shapes (:class:`braid.cost.catalog.ModelConfig`) and the model families'
runnable configs: a preset made runnable (:func:`decoder_config`), a runnable config or a Hugging
Face ``config.json`` turned into a shape (:func:`from_decoder_config`, :func:`from_hf_config`), and
the command lines' ``--model`` (:func:`resolve_model`: a preset name or a ``config.json`` path).
The catalog itself knows nothing of checkpoints or of the families' code."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from braid.cost.catalog import ModelConfig, ViTConfig, get_model
from braid.hf.config import read_family_config
from braid.models.registry import get_family


def _is_path(name: str) -> bool:
    return name.endswith(".json") or os.sep in name or Path(name).is_dir()


def resolve_model(name: str, *, prefix: str = "qwen2-") -> ModelConfig:
    """``--model``: a catalog preset (:func:`braid.cost.catalog.get_model`, short names with ``prefix``)
    or the path of a Hugging Face ``config.json`` (or of the checkpoint directory holding it)."""
    if _is_path(name):
        return from_hf_config(name)
    return get_model(name, prefix=prefix)


def from_hf_config(path: str | os.PathLike) -> ModelConfig:
    """The shape of a Hugging Face checkpoint's ``config.json`` (a file path or its directory)."""
    p = Path(path)
    d, family, cfg = read_family_config(p)
    name = str(d.get("_name_or_path") or (p.parent.name if p.is_file() else p.name) or family.name)
    if hasattr(cfg, "vit") and hasattr(cfg, "lm"):  # a vision-language model: its LM and its tower
        v = cfg.vit
        vit = ViTConfig(**{f: getattr(v, f) for f in ViTConfig.__dataclass_fields__})
        return from_decoder_config(name, cfg.lm, "qwen2", vit=vit)
    if not hasattr(cfg, "vocab_size"):
        raise ValueError(f"{path}: the {family.name} family has no cost-model shape")
    return from_decoder_config(name, cfg, family.name)


def from_decoder_config(name: str, cfg: Any, family: str = "qwen2", **changes: Any) -> ModelConfig:
    """The cost-model shape of a runnable decoder config (the inverse of :func:`decoder_config`)."""
    moe = {f: getattr(cfg, f) for f in ("experts", "experts_per_token", "moe_ffn") if hasattr(cfg, f)}
    if cfg.head_dim * cfg.heads != cfg.hidden:
        moe["head_size"] = cfg.head_dim
    return ModelConfig(name, layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads, kv_heads=cfg.kv_heads, ffn=cfg.ffn,
                       vocab=cfg.vocab_size, family=family, tie_embeddings=cfg.tie_embeddings, **moe, **changes)


def decoder_config(model: ModelConfig, **changes: Any) -> Any:
    """The runnable LM config of ``model``'s family (e.g. :class:`braid.models.qwen2.Qwen2Config`), fields overridden by ``changes``."""
    fields = dict(vocab_size=model.vocab, hidden=model.hidden, layers=model.layers, heads=model.heads,
                  kv_heads=model.kv_heads, ffn=model.ffn, tie_embeddings=model.tie_embeddings)
    if model.head_size:
        fields["head_dim"] = model.head_size
    if model.experts:
        fields.update(experts=model.experts, experts_per_token=model.experts_per_token, moe_ffn=model.moe_ffn)
    return get_family(model.family).config_cls(**{**fields, **changes})
