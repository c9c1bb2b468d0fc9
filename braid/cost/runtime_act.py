"""The bytes braid's runtime holds per dense LM unit: what each saves for its backward (the analytic cost model's ``activations="runtime"``) and the head's loss workspace."""

from __future__ import annotations

from braid.core.braiding import Unit


def runtime_act(tokens: int, h: int, heads: int, kv_heads: int, ffn: int, t: int, d: int) -> dict[Unit, float]:
    """Bytes each LM unit of braid's runtime saves for its backward (``activations="runtime"``).

    Counted from the chunk's saved-tensor boxes (``ModelChunk.live_bytes``), distinct
    storages: RMSNorm keeps its fp32 input (the input itself when ``d`` = 4), the fp32
    rsqrt and the normalised input cast back (4h + d*h + 4 per token); the linears after
    it keep their (shared) input; RoPE's cos/sin tables are the layer's, kept across micro-batches
    (:class:`braid.models.qwen2.RopeCache`, not an activation); flash attention keeps q, k, v, its
    output (o_proj's input is a view of it: :func:`braid.models.qwen2.rope_qk`) and the fp32 LSE; the SwiGLU
    MLP keeps gate and up (the down-projection remakes their product in the backward,
    :mod:`braid.tp.swiglu_down`). Korthikanti's
    coefficients assume a 4h GELU MLP and no fp32 norm copies: for a Qwen2-7B layer in
    bf16 they count about half of these bytes.
    """
    hd = h // heads
    kvh = max(kv_heads // t, 1) * hd
    norm = tokens * (4 * h + d * h + 4)
    return {
        Unit.PRE_ATTN: norm + tokens * d * h,
        Unit.ATTN: tokens * (d * (2 * heads // t * hd + 2 * kvh) + 4 * heads // t),
        Unit.PRE_MLP: norm + tokens * d * h,
        Unit.MLP: tokens * 2 * (ffn // t) * d,
    }


def eager_loss_workspace(tokens: int, vocab_t: int, d: int) -> float:
    """The head's workspace under the eager vocab-parallel loss (:func:`braid.tp.embedding.vocab_parallel_cross_entropy`
    with its eager pieces): above the logits it keeps, the forward holds their shifted fp32 copy (and the cast
    that makes it, when ``d`` < 4) and the backward the recomputed softmax and its cast -- 8 bytes per token and
    vocabulary entry of the TP shard in bf16, 4 in fp32. The simulator charges it on top of the kept bytes."""
    c = max(d, 4)  # the loss computes in fp32 (fp64 for an fp64 model)
    return float(tokens * vocab_t * (c + (c if d < c else 0)))


def loss_workspace(tokens: int, vocab_t: int, d: int, compiled: bool, t: int) -> float:
    """The head unit's workspace (``tmp``): compiled at tp=1 the fused cross-entropy (none counted); compiled
    at tp > 1 the vocab-parallel loss's fused pieces, whose backward writes the logits' gradient (``d`` bytes
    per token and vocabulary entry of the shard); eager, :func:`eager_loss_workspace`."""
    if compiled:
        return 0.0 if t == 1 else float(tokens * vocab_t * d)
    return eager_loss_workspace(tokens, vocab_t, d)
