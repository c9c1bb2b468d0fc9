"""Whether a CUDA graph capture reuses a root gradient's memory, by the streams its backward runs on.

Under sequence parallelism a unit's head -- the norm, and in the backward the norm's backward
from the reduce-scatter's output -- runs on a side stream or on the caller's
(:mod:`braid.runtime.follow`). This replays that on one GPU: a norm's forward on one stream, its
output gradient made on the capturing stream, ``torch.autograd.grad`` called on one stream, three
times inside one capture, and prints whether the gradient's block was reused (one address for the
three) for each pair of streams::

    python benchmarks/probe_capture_stream_reuse.py

Autograd runs a node's backward on its forward's stream; a root gradient made on another stream is
marked in use there (``record_stream``), and a capture does not hand such a block out again before
it ends. Stored: ``benchmarks/results/probe_capture_stream_reuse_h200.txt``.
"""

from __future__ import annotations

import argparse
import sys

import torch

PROG = "probe_capture_stream_reuse.py"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256, help="rows of the normed tensor (default: %(default)s)")
    ap.add_argument("--hidden", type=int, default=1024, help="(default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="forward and backward pairs per capture (default: %(default)s)")
    return ap


def _addresses(fwd_side: bool, bwd_side: bool, tokens: int, hidden: int, repeats: int) -> list[int]:
    """The root gradient's address in each of ``repeats`` norm backwards captured into one graph."""
    dev = torch.device("cuda")
    side = torch.cuda.Stream()
    w = torch.nn.Parameter(torch.ones(hidden, device=dev))
    x = torch.randn(tokens, hidden, device=dev, requires_grad=True)
    addrs: list[int] = []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cur = torch.cuda.current_stream()
        for _ in range(repeats):
            side.wait_stream(cur)
            with torch.cuda.stream(side if fwd_side else cur):
                y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
            cur.wait_stream(side)
            dy = torch.ones(tokens, hidden, device=dev)  # made on the capturing stream, as a reduce-scatter's output is
            addrs.append(dy.data_ptr())
            side.wait_stream(cur)
            with torch.cuda.stream(side if bwd_side else cur):
                torch.autograd.grad(y, (x,), (dy,))
            cur.wait_stream(side)
            del y, dy
    torch.cuda.synchronize()
    return addrs


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    bad = [f"--{n} {v}" for n, v in vars(args).items() if v < 1]
    if bad:
        print(f"{PROG}: {', '.join(bad)}: give positive sizes", file=sys.stderr)
        return 2
    if torch.cuda.device_count() < 1:
        print(f"{PROG}: needs a CUDA device", file=sys.stderr)
        return 2
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.repeats} norm backwards per capture")
    for fwd_side in (False, True):
        for bwd_side in (False, True):
            addrs = _addresses(fwd_side, bwd_side, args.tokens, args.hidden, args.repeats)
            print(f"norm forward on the {'side' if fwd_side else 'capturing'} stream, autograd.grad on the "
                  f"{'side' if bwd_side else 'capturing'} stream: gradient block reused {len(set(addrs)) < len(addrs)} "
                  f"({len(set(addrs))} addresses for {len(addrs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
