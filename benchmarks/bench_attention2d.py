"""Benchmark 2D-Attention (forward + backward) against one device and torch's context parallel.

Spawns one process per device and, for every sequence length, times side by side:
one device (the block kernel on the full sequence), every valid 2D layout of the world
(HP only, CP ring, HP x CP with each placement and inner-ring size), and torch's own
context-parallel ring attention (``torch.distributed.tensor.experimental.context_parallel``).
Prints milliseconds per forward+backward (the slowest rank, median of ``--iters``) and
speedups. Defaults: GQA 7B-like shapes (28 query heads, 4 KV heads, head_dim 128), bf16,
causal, 32K..256K tokens.

    PYTHONPATH=. python benchmarks/bench_attention2d.py                 # all GPUs
    PYTHONPATH=. python benchmarks/bench_attention2d.py --device cpu --tiny   # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from braid.attention.kernels import BACKENDS, get_kernel
from braid.attention import Attention2DGroups, GroupPool, RingSpec, attention_2d, ring_attention, zigzag_shard


def _layouts(world: int) -> list[tuple[int, int, int, str]]:
    out = []
    for d_hp in range(1, world + 1):
        if world % d_hp:
            continue
        d_cp = world // d_hp
        for w in (x for x in range(1, d_cp + 1) if d_cp % x == 0):
            for placement in (("head_first", "context_first") if d_hp > 1 and d_cp > 1 else ("head_first",)):
                out.append((d_hp, d_cp, w, placement))
    return out


def _name(d_hp: int, d_cp: int, w: int, placement: str) -> str:
    if d_cp == 1:
        return f"HP{d_hp}"
    ring = "ring" if w == d_cp else f"double-ring w={w}"
    return f"CP{d_cp} {ring}" if d_hp == 1 else f"HP{d_hp}xCP{d_cp} {ring} {placement}"


def _time(fn: Callable[[], None], device: torch.device, warmup: int, iters: int) -> float:
    """Median wall time (ms) of ``fn`` on the slowest rank."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _torch_cp(q, k, v, dout, scale: float, device: torch.device, warmup: int, iters: int) -> tuple[float, str]:
    """torch's context-parallel ring attention; returns (ms, note) or (nan, why unusable)."""
    if device.type != "cuda":
        return float("nan"), "needs CUDA (flash/efficient/cuDNN SDPA only)"
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
    except ImportError as e:
        return float("nan"), f"not importable: {e}"
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    rep = q.shape[1] // k.shape[1]

    def step(gqa: bool) -> None:
        kk, vv = (k, v) if gqa else (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
        bufs = [t.detach().clone() for t in (q, kk, vv, dout)]
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs)):
            qq, kq, vq = (t.requires_grad_() for t in bufs[:3])
            kw = dict(enable_gqa=True) if gqa else {}
            out = F.scaled_dot_product_attention(qq, kq, vq, is_causal=True, scale=scale, **kw)
            out.backward(bufs[3])

    for gqa in (True, False):
        try:
            return _time(lambda: step(gqa), device, warmup, iters), "GQA native" if gqa else "KV heads repeated"
        except Exception as e:  # noqa: BLE001 - report why the baseline cannot run
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return float("nan"), f"unusable ({why})"


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600), device_id=device if device.type == "cuda" else None)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pool = GroupPool()
    kernel = get_kernel(device, args.backend)
    scale = args.head_dim ** -0.5
    if rank == 0:
        print(f"# {world} x {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch "
              f"{torch.__version__}, kernel {kernel.name}, heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, {dtype}, causal, "
              f"fwd+bwd ms (slowest rank, median of {args.iters})")
    for seq in args.seqs:
        g = torch.Generator(device=device).manual_seed(seq)
        q = torch.randn(1, args.heads, seq, args.head_dim, generator=g, device=device, dtype=dtype)
        k = torch.randn(1, args.kv_heads, seq, args.head_dim, generator=g, device=device, dtype=dtype)
        v = torch.randn_like(k)
        dout = torch.randn_like(q)
        rows: list[tuple[str, float, str]] = []

        def single(q=q, k=k, v=v, dout=dout) -> None:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out, _ = ring_attention(*leaves, RingSpec(1, 1, 0), causal=True, scale=scale, kernel=kernel)
            out.backward(dout)

        if rank == 0:
            rows.append(("1 device", _time_local(single, device, args.warmup, args.iters), ""))
        dist.barrier()
        for d_hp, d_cp, w, placement in _layouts(world):
            groups = Attention2DGroups.build(list(range(world)), d_hp, d_cp, w, placement, pool=pool)
            loc = [zigzag_shard(t, groups.layout, rank) for t in (q, k, v, dout)]

            def step(loc=loc, groups=groups) -> None:
                leaves = [t.detach().requires_grad_() for t in loc[:3]]
                attention_2d(*leaves, groups=groups, causal=True, scale=scale, kernel=kernel).backward(loc[3])

            rows.append((_name(d_hp, d_cp, w, placement), _time(step, device, args.warmup, args.iters), ""))
            del loc
        ms, note = _torch_cp(q, k, v, dout, scale, device, args.warmup, args.iters)
        rows.append((f"torch context_parallel CP{world}", ms, note))
        if rank == 0:
            _report(seq, rows)
        del q, k, v, dout
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.destroy_process_group()


def _time_local(fn: Callable[[], None], device: torch.device, warmup: int, iters: int) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _report(seq: int, rows: list[tuple[str, float, str]]) -> None:
    one = rows[0][1]
    ours = [r for r in rows[1:] if not r[0].startswith("torch")]
    best = min(ours, key=lambda r: r[1])
    torch_cp = rows[-1][1]
    print(f"\nseq {seq // 1024}K" if seq >= 1024 else f"\nseq {seq}")
    print(f"  {'layout':<40} {'ms':>10} {'vs 1 dev':>9} {'vs torch CP':>12}")
    for name, ms, note in rows:
        mark = "  <- best 2D" if (name, ms, note) == best else ""
        print(f"  {name:<40} {ms:>10.2f} {one / ms:>8.2f}x {torch_cp / ms:>11.2f}x{mark}{'  ' + note if note else ''}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--world", type=int, default=0, help="processes (default: all GPUs, 2 on CPU)")
    p.add_argument("--seqs", type=lambda s: [int(x) for x in s.split(",")], default=[32768, 65536, 131072, 262144],
                   help="comma-separated sequence lengths")
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--backend", choices=list(BACKENDS), default="auto", help="block kernel for ours and 1 device")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--tiny", action="store_true", help="tiny shapes for a smoke test")
    args = p.parse_args(argv)
    if args.tiny:
        args.seqs, args.heads, args.kv_heads, args.head_dim, args.iters = [256, 512], 4, 2, 16, 2
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device; use --device cpu --tiny")
    world = args.world or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if world < 2:
        p.error("needs at least 2 processes (--world)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(world, port, args), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
