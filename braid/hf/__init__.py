"""Hugging Face checkpoints in and out of braid: ``load(path, dtype=..., device=...)``, ``save(model, path)``.

``load`` dispatches on ``config.json``'s ``model_type`` through the model registry
(:mod:`braid.models.registry`): Qwen2 / Qwen2.5 (``qwen2``) and Llama-style (``llama``)
decoders, and Qwen2-VL / Qwen2.5-VL (``qwen2_vl``, ``qwen2_5_vl``: ``logits(input_ids,
pixel_values=..., image_grid_thw=...)``), tied heads included. ``load_meta`` gives the model on the meta device so that
each rank's chunks read only their own tensors; ``save_chunks`` writes a pipelined,
tensor-parallel model as one checkpoint, each stage from its rank. Labels: HF shifts them inside its loss,
braid expects them shifted -- :func:`shift_labels`. Needs ``pip install 'braid-pipeline[hf]'``.
"""

from braid.hf.checkpoint import CheckpointReader, CheckpointSource, check_tensors, load, load_meta, save  # noqa: F401
from braid.hf.config import read_config  # noqa: F401
from braid.hf.distributed import save_chunks  # noqa: F401
from braid.hf.labels import IGNORE_INDEX, causal_lm_loss, shift_labels  # noqa: F401

__all__ = ["CheckpointReader", "CheckpointSource", "IGNORE_INDEX", "causal_lm_loss", "check_tensors", "load", "load_meta", "read_config",
           "save", "save_chunks", "shift_labels"]
