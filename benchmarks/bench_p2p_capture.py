"""What point-to-point messages add to a CUDA graph's pool: a tensor per message against kept buffers.

Two ranks capture ``K`` iterations of one ``batch_isend_irecv`` each way of a b.s.h bfloat16 tensor (the
7b-layer shape at seq 4096: 28 MiB), either with a fresh tensor per message (the tensor sent, a receive into
``torch.empty``) or through two kept buffers each way (copied in, cloned out: what
:class:`braid.runtime.p2p.Staging` does in a captured step), and print the pool's growth per ``K``. NCCL's
stream marks a message's tensor as used there; freed during a capture, such a block is not reused until the
capture ends, so with fresh tensors the pool grows with every message::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=. python benchmarks/bench_p2p_capture.py
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _spawn import spawn_two  # noqa: E402

N = 4096 * 3584  # one b.s.h activation of the 7b-layer shape at seq 4096


def _step(dist, torch, k: int, kept, peer: int):
    sums = []
    for i in range(k):
        x = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        if kept is not None:
            s, r = kept[0][i % 2], kept[1][i % 2]
            s.copy_(x)
        else:
            s, r = x, torch.empty(N, device="cuda", dtype=torch.bfloat16)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, s, peer), dist.P2POp(dist.irecv, r, peer)]):
            w.wait()
        sums.append((r.clone() if kept is not None else r).sum())
    return torch.stack(sums).sum()


def _worker(rank: int, ks: list[int], port: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    rows = []
    try:
        for mode in ("fresh", "kept"):
            for k in ks:
                kept = None if mode == "fresh" else tuple([torch.empty(N, device="cuda", dtype=torch.bfloat16)
                                                          for _ in range(2)] for _ in range(2))
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up, eager, as before any capture
                    _step(dist, torch, k, kept, 1 - rank)
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                before = torch.cuda.memory_reserved()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    res = _step(dist, torch, k, kept, 1 - rank)
                torch.cuda.synchronize()
                rows.append((mode, k, torch.cuda.memory_reserved() - before))
                g.replay()
                torch.cuda.synchronize()
                del g, res, kept
                torch.cuda.empty_cache()
        out.put((rank, rows))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(prog="bench_p2p_capture.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8, 16], help="messages each way per capture (default 4 8 16)")
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print(f"bench_p2p_capture.py: needs 2 CUDA devices, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    if any(k < 1 or k > 64 for k in args.k):
        ap.error("--k: each between 1 and 64")
    got = dict(spawn_two(_worker, args.k, results=2, timeout_s=600))
    mib = N * 2 / 2**20
    for mode, k, grown in got[0]:
        print(f"{mode:5s} K={k:2d}: graph pool {grown / 2**20:8.1f} MiB ({grown / 2**20 / mib:.1f} activations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
