"""Which memory layout SDPA's output and gradients take for the two layouts of q, k and v, and their time.

braid's RoPE hands attention q and k (b, heads, s, d) views of (b, s, heads, d) memory
(:func:`braid.models.qwen2.rope_qk`). This shows why, on one GPU: for each input layout it prints the
strides of the output and of the gradients, whether the output's (b, s, h) view for the
out-projection is free (``o.transpose(1, 2)`` contiguous: no copy, and no second copy kept for the
backward), and the forward and backward of attention with that view, timed::

    python benchmarks/bench_attention_layout.py --heads 14 --kv-heads 2 --seq 4096 --head-dim 128

(a Qwen2-7B layer's attention at tp=2; bf16, causal, GQA). Stored: ``benchmarks/results/sdpa_layout_h200.txt``.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

PROG = "bench_attention_layout.py"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=14, help="query heads (default: %(default)s)")
    ap.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default: %(default)s)")
    ap.add_argument("--seq", type=int, default=4096, help="tokens (default: %(default)s)")
    ap.add_argument("--head-dim", type=int, default=128, help="(default: %(default)s)")
    ap.add_argument("--iters", type=int, default=20, help="timed iterations per round (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="(default: %(default)s; the first one warms up)")
    return ap


def _inputs(layout: str, b: int, heads: int, kv: int, s: int, d: int) -> tuple[torch.Tensor, ...]:
    def one(n: int) -> torch.Tensor:
        shape = (b, n, s, d) if layout == "bhsd" else (b, s, n, d)
        t = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        return (t if layout == "bhsd" else t.transpose(1, 2)).requires_grad_()
    return one(heads), one(kv), one(kv)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    bad = [f"--{n.replace('_', '-')} {v}" for n, v in vars(args).items() if v < 1]
    if bad or args.heads % args.kv_heads:
        print(f"{PROG}: {', '.join(bad) or '--heads must be a multiple of --kv-heads'}: give positive sizes", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(f"{PROG}: needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    b, h, kv, s, d = 1, args.heads, args.kv_heads, args.seq, args.head_dim
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; b={b} heads={h} kv_heads={kv} seq={s} head_dim={d}, bf16, causal")
    grad = torch.randn(b, s, h * d, device="cuda", dtype=torch.bfloat16)
    for layout in ("bhsd", "bshd"):
        q, k, v = _inputs(layout, b, h, kv, s, d)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=h != kv)
        o.transpose(1, 2).reshape(b, s, h * d).backward(grad)
        print(f"{layout}: q strides {q.stride()}, output {o.stride()} ({type(o.grad_fn).__name__}); its (b, s, h) view free: "
              f"{o.transpose(1, 2).is_contiguous()}; dq {q.grad.stride()}, dk {k.grad.stride()}")
        for r in range(args.rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(args.iters):
                q.grad = k.grad = v.grad = None
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=h != kv)
                o.transpose(1, 2).reshape(b, s, h * d).backward(grad)
            end.record()
            torch.cuda.synchronize()
            print(f"{layout}: round {r + 1}{' (warm-up)' if r == 0 else ''}: forward and backward with the view "
                  f"{start.elapsed_time(end) / args.iters:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
