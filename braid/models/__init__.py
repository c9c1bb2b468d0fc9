"""Models that expose their layers as units (Pre-Attn, Attn, Pre-MLP, MLP) for the executor."""

from braid.models.qwen2 import Qwen2Config, Qwen2Layer, Qwen2Model, parallelize_layer  # noqa: F401
