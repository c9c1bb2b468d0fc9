"""Hugging Face checkpoints in and out of braid: ``load(path, dtype=..., device=...)``, ``save(model, path)``.

``load`` dispatches on ``config.json``'s ``model_type`` through the model registry
(:mod:`braid.models.registry`): Qwen2 / Qwen2.5 (``qwen2``) and Llama-style (``llama``)
decoders, tied heads included. ``load_meta`` gives the model on the meta device so that
each rank's chunks read only their own tensors. Labels: HF shifts them inside its loss,
braid expects them shifted -- :func:`shift_labels`. Needs ``pip install 'braid[hf]'``.
"""

from braid.hf.checkpoint import CheckpointReader, CheckpointSource, load, load_meta, read_config, save  # noqa: F401
from braid.hf.labels import IGNORE_INDEX, causal_lm_loss, shift_labels  # noqa: F401

__all__ = ["CheckpointReader", "CheckpointSource", "IGNORE_INDEX", "causal_lm_loss", "load", "load_meta", "read_config",
           "save", "shift_labels"]
