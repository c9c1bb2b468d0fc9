"""Model size presets for the cost model: Qwen2 LLMs and Qwen2-VL MLLMs (paper Sec. 5).

``qwen2-1.5b``, ``qwen2-7b``, ``qwen2-72b`` and ``qwen2-vl-72b`` use the published Qwen2 and
Qwen2-VL configurations (the 72B MLLM: the Qwen2-72B language model behind the same ViT). ``qwen2-12b`` and
``qwen2-vl-15b`` stand for the paper's 12.1B LLM and 14.9B MLLM: the paper's Table 2 is
not in the text we have, so they are Qwen2-family shapes (hidden 4096, 32 heads, 8 KV
heads) whose layer counts and FFN width give 12.1B and 14.9B parameters. The MLLMs carry
the Qwen2-VL ViT (32 layers, hidden 1280, 16 heads, MLP 5120, 14x14 patches, 2x2 merge),
which the partition puts on the first virtual stage.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class ViTConfig:
    """Vision encoder: ``patches`` per sample before the 2x2 merge into LM tokens."""

    layers: int = 32
    hidden: int = 1280
    heads: int = 16
    ffn: int = 5120
    patch_pixels: int = 14 * 14 * 3 * 2  # temporal patch of 2 frames, RGB
    patches: int = 1024


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A decoder-only LM (SwiGLU MLP, GQA, causal), optionally with a ViT in front.

    ``seq``: tokens per sample; ``micro_batch_size``: samples per micro-batch;
    ``dtype_bytes``: activation/weight element size (2 for bf16).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int = 4096
    micro_batch_size: int = 1
    dtype_bytes: int = 2
    vit: ViTConfig | None = None

    def __post_init__(self) -> None:
        bad = [f"{n}={getattr(self, n)}" for n in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "micro_batch_size", "dtype_bytes")
               if not (isinstance(getattr(self, n), int) and getattr(self, n) >= 1)]
        if bad:
            raise ValueError(f"model {self.name!r}: sizes must be positive integers, got {', '.join(bad)}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"model {self.name!r}: hidden must divide by heads and heads by kv_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def tokens(self) -> int:
        """LM tokens of one micro-batch."""
        return self.seq * self.micro_batch_size

    def with_(self, **changes: object) -> "ModelConfig":
        """A copy with some fields changed (``seq``, ``micro_batch_size``, ...)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def lm_layer_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return h * (h + 2 * kv) + h * h + 3 * h * self.ffn

    def params(self) -> int:
        """Parameter count (untied embedding and head; norms and biases ignored)."""
        n = self.layers * self.lm_layer_params() + 2 * self.vocab * self.hidden
        if self.vit is not None:
            v = self.vit
            n += v.layers * (4 * v.hidden * v.hidden + 2 * v.hidden * v.ffn) + v.patch_pixels * v.hidden
            n += 4 * v.hidden * 4 * v.hidden + 4 * v.hidden * self.hidden  # patch merger MLP
        return n


_QWEN2_VOCAB = 152064

MODELS: dict[str, ModelConfig] = {
    "tiny": ModelConfig("tiny", layers=32, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq=64),
    "qwen2-1.5b": ModelConfig("qwen2-1.5b", layers=28, hidden=1536, heads=12, kv_heads=2, ffn=8960, vocab=151936),
    "qwen2-7b": ModelConfig("qwen2-7b", layers=28, hidden=3584, heads=28, kv_heads=4, ffn=18944, vocab=_QWEN2_VOCAB),
    "qwen2-12b": ModelConfig("qwen2-12b", layers=48, hidden=4096, heads=32, kv_heads=8, ffn=14976, vocab=_QWEN2_VOCAB),
    "qwen2-vl-7b": ModelConfig("qwen2-vl-7b", layers=28, hidden=3584, heads=28, kv_heads=4, ffn=18944,
                               vocab=_QWEN2_VOCAB, vit=ViTConfig()),
    "qwen2-vl-15b": ModelConfig("qwen2-vl-15b", layers=57, hidden=4096, heads=32, kv_heads=8, ffn=14976,
                                vocab=_QWEN2_VOCAB, vit=ViTConfig()),
    "qwen2-72b": ModelConfig("qwen2-72b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=29568, vocab=_QWEN2_VOCAB),
    "qwen2-vl-72b": ModelConfig("qwen2-vl-72b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=29568,
                                vocab=_QWEN2_VOCAB, vit=ViTConfig()),
}


def get_model(name: str) -> ModelConfig:
    """The preset called ``name``; ``ValueError`` listing the valid names otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODELS)}") from None
