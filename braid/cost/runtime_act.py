"""The activation bytes braid's runtime saves per dense LM unit (the analytic cost model's ``activations="runtime"``)."""

from __future__ import annotations

from braid.core.braiding import Unit


def runtime_act(tokens: int, seq: int, h: int, heads: int, kv_heads: int, ffn: int, t: int, d: int) -> dict[Unit, float]:
    """Bytes each LM unit of braid's runtime saves for its backward (``activations="runtime"``).

    Counted from the chunk's saved-tensor boxes (``ModelChunk.live_bytes``), distinct
    storages: RMSNorm keeps its fp32 input (the input itself when ``d`` = 4), the fp32
    rsqrt and the normalised input cast back (4h + d*h + 4 per token); the linears after
    it keep their (shared) input; RoPE keeps one cos/sin pair for q and k (per position); flash
    attention keeps q, k, v, its output (= o_proj's input) and the fp32 LSE; the SwiGLU
    MLP keeps gate, up, silu(gate) and their product (down_proj's input). Korthikanti's
    coefficients assume a 4h GELU MLP and no fp32 norm copies: for a Qwen2-7B layer in
    bf16 they count about half of these bytes.
    """
    hd = h // heads
    kvh = max(kv_heads // t, 1) * hd
    norm = tokens * (4 * h + d * h + 4)
    return {
        Unit.PRE_ATTN: norm + tokens * d * h + 2 * seq * hd * d,
        Unit.ATTN: tokens * (d * (2 * heads // t * hd + 2 * kvh) + 4 * heads // t),
        Unit.PRE_MLP: norm + tokens * d * h,
        Unit.MLP: tokens * 4 * (ffn // t) * d,
    }
