"""Model size presets -- the one list, used by the cost model, the profiler and the examples (paper Sec. 5).

Names: ``<family>-<size>`` (``qwen2-7b``, ``qwen2-vl-15b``, ``qwen2.5-vl-7b``, ``llama3-8b``). The examples'
short names (``tiny``, ``small``, ``7b``, ``15b``) are accepted with the family prefix the
caller gives (:func:`get_model`'s ``prefix``: ``qwen2-`` by default, ``qwen2-vl-`` for
the VLM example), and so is the path of a Hugging Face ``config.json`` (or of the
checkpoint directory holding it). :func:`decoder_config` turns a preset into the runnable
model's config of its family (:mod:`braid.models.registry`).

``qwen2-1.5b``, ``qwen2-7b``, ``qwen2-72b`` and ``qwen2-vl-72b`` use the published Qwen2 and
Qwen2-VL configurations (1.5B ties its embedding and head; the 72B MLLM: the Qwen2-72B
language model behind the same ViT). ``qwen2-12b`` and
``qwen2-vl-15b`` stand for the paper's 12.1B LLM and 14.9B MLLM: the paper's Table 2 is
not in the text we have, so they are Qwen2-family shapes (hidden 4096, 32 heads, 8 KV
heads) whose layer counts and FFN width give 12.1B and 14.9B parameters. The MLLMs carry
the Qwen2-VL ViT (32 layers, hidden 1280, 16 heads, MLP 5120, 14x14 patches, 2x2 merge),
which the partition puts on the first virtual stage. ``qwen2-vl-2b``/``-7b`` and
``qwen2.5-vl-3b``/``-7b`` are the published shapes (Qwen2.5-VL: SwiGLU tower with window
attention; the cost model counts every ViT block as full attention over the image, an upper
bound for its window blocks). The vision-language presets are also the VLM example's
(:func:`braid.models.qwen2_vl.vl_config` makes them runnable).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class ViTConfig:
    """Vision tower (Qwen2-VL's, or Qwen2.5-VL's with ``kind="qwen2_5_vl"``): the cost model's shape and what
    :func:`braid.models.qwen2_vl.vl_config` builds the runnable tower from (same field names as
    :class:`braid.models.vit.ViTConfig`). ``image_size``: the image side the presets assume
    (``patches`` per sample before the ``merge x merge`` merge into LM tokens)."""

    layers: int = 32
    hidden: int = 1280
    heads: int = 16
    ffn: int = 5120
    kind: str = "qwen2_vl"
    patch: int = 14
    temporal_patch: int = 2
    merge: int = 2
    channels: int = 3
    image_size: int = 448
    window: int = 0
    full_attention_blocks: tuple[int, ...] = ()

    @property
    def gated(self) -> bool:
        """SwiGLU MLP (Qwen2.5-VL) rather than fc1 -> QuickGELU -> fc2 (Qwen2-VL)."""
        return self.kind == "qwen2_5_vl"

    @property
    def patch_pixels(self) -> int:
        """Features of one flattened patch (channels x temporal patch x patch x patch)."""
        return self.channels * self.temporal_patch * self.patch * self.patch

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch) ** 2


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A decoder-only LM (SwiGLU MLP, GQA, causal), optionally with a ViT in front.

    ``seq``: tokens per sample; ``micro_batch_size``: samples per micro-batch;
    ``dtype_bytes``: activation/weight element size (2 for bf16); ``family``: the model
    family that runs it (:mod:`braid.models.registry`); ``tie_embeddings``: the LM head
    reuses the embedding matrix. ``head_size``: one head's size where it is not
    ``hidden / heads`` (0: it is). A mixture of experts (every layer): ``experts`` SwiGLU
    experts of width ``moe_ffn``, ``experts_per_token`` of them per token (0: a dense MLP of
    width ``ffn``).
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
    family: str = "qwen2"
    tie_embeddings: bool = False
    head_size: int = 0
    experts: int = 0
    experts_per_token: int = 0
    moe_ffn: int = 0

    def __post_init__(self) -> None:
        bad = [f"{n}={getattr(self, n)}" for n in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "micro_batch_size", "dtype_bytes")
               if not (isinstance(getattr(self, n), int) and getattr(self, n) >= 1)]
        bad += [f"{n}={getattr(self, n)}" for n in ("head_size", "experts", "experts_per_token", "moe_ffn")
                if not (isinstance(getattr(self, n), int) and getattr(self, n) >= 0)]
        if bad:
            raise ValueError(f"model {self.name!r}: sizes must be positive integers, got {', '.join(bad)}")
        if (self.hidden % self.heads and not self.head_size) or self.heads % self.kv_heads:
            raise ValueError(f"model {self.name!r}: hidden must divide by heads and heads by kv_heads")
        if self.experts and not (1 <= self.experts_per_token <= self.experts and self.moe_ffn >= 1):
            raise ValueError(f"model {self.name!r}: a mixture of experts needs 1 <= experts_per_token <= experts and moe_ffn >= 1")

    @property
    def head_dim(self) -> int:
        """One attention head's size: ``head_size`` where the family gives it (Qwen3), else hidden / heads."""
        return self.head_size or self.hidden // self.heads

    @property
    def tokens(self) -> int:
        """LM tokens of one micro-batch."""
        return self.seq * self.micro_batch_size

    def with_(self, **changes: object) -> "ModelConfig":
        """A copy with some fields changed (``seq``, ``micro_batch_size``, ...)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def lm_layer_halves(self) -> tuple[int, int]:
        """A decoder layer's weights in its attention half (Q, K, V, O) and its MLP half (gate, up,
        down; of every expert and the router in a mixture of experts)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        mlp = self.expert_params() + self.experts * h if self.experts else 3 * h * self.ffn
        return h * (q + 2 * kv) + q * h, mlp

    def expert_params(self, experts: int | None = None) -> int:
        """Weights of ``experts`` (default: all) SwiGLU experts of one MoE layer (gate, up, down); 0 for a dense model."""
        return (self.experts if experts is None else experts) * 3 * self.hidden * self.moe_ffn

    def active_params(self) -> int:
        """Parameters one token passes through: :meth:`params` with ``experts_per_token`` experts per layer."""
        if not self.experts:
            return self.params()
        return self.params() - self.layers * self.expert_params(self.experts - self.experts_per_token)

    def lm_layer_params(self) -> int:
        return sum(self.lm_layer_halves())

    def params(self) -> int:
        """Parameter count (norms and biases ignored; a tied head counted once)."""
        n = self.layers * self.lm_layer_params() + (1 if self.tie_embeddings else 2) * self.vocab * self.hidden
        if self.vit is not None:
            v = self.vit
            n += v.layers * (4 * v.hidden * v.hidden + (3 if v.gated else 2) * v.hidden * v.ffn) + v.patch_pixels * v.hidden
            wide = v.hidden * v.merge ** 2
            n += wide * wide + wide * self.hidden  # patch merger MLP
        return n


_QWEN2_VOCAB = 152064

_QWEN2_15B_LM = dict(layers=57, hidden=4096, heads=32, kv_heads=8, ffn=14976, vocab=_QWEN2_VOCAB)  # the 14.9B MLLM's LM
_QWEN2_7B_LM = dict(layers=28, hidden=3584, heads=28, kv_heads=4, ffn=18944, vocab=_QWEN2_VOCAB)
_TINY_LM = dict(layers=4, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=32, seq=32)
_SMALL_LM = dict(layers=16, hidden=1024, heads=16, kv_heads=4, ffn=2816, vocab=32768)
_TINY_VIT = dict(layers=2, hidden=32, heads=4, ffn=64, patch=4, image_size=16)  # CPU tests: 16 px images, 4 visual tokens
# Qwen2.5-VL's tower: RMSNorm, SwiGLU, 112 px windows, full attention in blocks 7, 15, 23, 31
_QWEN25_VIT = ViTConfig(ffn=3420, kind="qwen2_5_vl", window=112, full_attention_blocks=(7, 15, 23, 31))

# Qwen3-MoE (published configurations; every layer a mixture of experts, 128 experts, 8 per token)
_QWEN3_MOE = dict(family="qwen3_moe", head_size=128, experts=128, experts_per_token=8, vocab=151936)

MODELS: dict[str, ModelConfig] = {
    "qwen2-tiny": ModelConfig("qwen2-tiny", **_TINY_LM),
    "qwen2-toy": ModelConfig("qwen2-toy", layers=32, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq=64),
    "qwen2-small": ModelConfig("qwen2-small", **_SMALL_LM),
    "qwen2-1.5b": ModelConfig("qwen2-1.5b", layers=28, hidden=1536, heads=12, kv_heads=2, ffn=8960, vocab=151936,
                              tie_embeddings=True),
    "qwen2-7b": ModelConfig("qwen2-7b", **_QWEN2_7B_LM),
    "qwen2-12b": ModelConfig("qwen2-12b", layers=48, hidden=4096, heads=32, kv_heads=8, ffn=14976, vocab=_QWEN2_VOCAB),
    "qwen2-15b": ModelConfig("qwen2-15b", **_QWEN2_15B_LM),
    "qwen2-vl-tiny": ModelConfig("qwen2-vl-tiny", **_TINY_LM, vit=ViTConfig(**_TINY_VIT)),
    "qwen2-vl-small": ModelConfig("qwen2-vl-small", **_SMALL_LM,
                                  vit=ViTConfig(layers=8, hidden=512, heads=8, ffn=1536, image_size=224)),
    "qwen2-vl-2b": ModelConfig("qwen2-vl-2b", layers=28, hidden=1536, heads=12, kv_heads=2, ffn=8960, vocab=151936,
                               tie_embeddings=True, vit=ViTConfig()),
    "qwen2-vl-7b": ModelConfig("qwen2-vl-7b", **_QWEN2_7B_LM, vit=ViTConfig()),
    "qwen2-vl-15b": ModelConfig("qwen2-vl-15b", **_QWEN2_15B_LM, vit=ViTConfig()),
    "qwen2.5-vl-tiny": ModelConfig("qwen2.5-vl-tiny", **_TINY_LM,
                                   vit=ViTConfig(**_TINY_VIT, kind="qwen2_5_vl", window=16, full_attention_blocks=(1,))),
    "qwen2.5-vl-3b": ModelConfig("qwen2.5-vl-3b", layers=36, hidden=2048, heads=16, kv_heads=2, ffn=11008, vocab=151936,
                                 tie_embeddings=True, vit=_QWEN25_VIT),
    "qwen2.5-vl-7b": ModelConfig("qwen2.5-vl-7b", **_QWEN2_7B_LM, vit=_QWEN25_VIT),
    "llama3-8b": ModelConfig("llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                             family="llama"),
    "qwen3-moe-tiny": ModelConfig("qwen3-moe-tiny", layers=4, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=32, seq=32,
                                  family="qwen3_moe", experts=4, experts_per_token=2, moe_ffn=16),
    "qwen3-moe-30b-a3b": ModelConfig("qwen3-moe-30b-a3b", layers=48, hidden=2048, heads=32, kv_heads=4, ffn=6144,
                                     moe_ffn=768, **_QWEN3_MOE),
    "qwen3-moe-235b-a22b": ModelConfig("qwen3-moe-235b-a22b", layers=94, hidden=4096, heads=64, kv_heads=4, ffn=12288,
                                       moe_ffn=1536, **_QWEN3_MOE),
    "qwen2-72b": ModelConfig("qwen2-72b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=29568, vocab=_QWEN2_VOCAB),
    "qwen2-vl-72b": ModelConfig("qwen2-vl-72b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=29568,
                                vocab=_QWEN2_VOCAB, vit=ViTConfig()),
}


def get_model(name: str, *, prefix: str = "qwen2-") -> ModelConfig:
    """The preset called ``name`` (or ``prefix + name``); ``ValueError`` listing the valid names otherwise.
    (A Hugging Face ``config.json`` path is read by :func:`braid.models.shapes.resolve_model`.)"""
    if name in MODELS:
        return MODELS[name]
    if prefix + name in MODELS:
        return MODELS[prefix + name]
    short = sorted({n.removeprefix(prefix) for n in MODELS if n.startswith(prefix) and "-" not in n.removeprefix(prefix)})
    raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODELS)} (or short: {', '.join(short)}), "
                     "or the path of a Hugging Face config.json")
