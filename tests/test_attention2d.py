"""2D-Attention on real gloo processes: forward and dQ/dK/dV equal full single-process attention.

Each world size (4 and 8) runs its whole grid of (d_hp, d_cp, w,
placement) x (MHA, GQA) x (causal, not) inside one process group. Inputs and the reference
are fp64 (tolerance 1e-9: only summation order differs); one fp32 pass per world checks the
low-precision path (tolerance 2e-5).
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from braid.attention import (
    Attention2DGroups,
    GroupPool,
    Layout2D,
    RingSpec,
    attention_2d,
    checkpoint_with_attention_cache,
    get_kernel,
    reference_attention,
    zigzag_order,
    zigzag_shard,
    zigzag_unshard,
)

B, H, D, S = 2, 8, 16, 64
GRIDS = {
    4: [(4, 1, 1), (1, 4, 4), (1, 4, 2), (1, 4, 1), (2, 2, 2), (2, 2, 1)],
    8: [(2, 4, 2), (2, 4, 4), (4, 2, 1), (8, 1, 1), (1, 8, 2)],
}
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-9), torch.float32: dict(rtol=2e-5, atol=2e-5)}


class CountingKernel:
    """Wraps a block kernel and counts forward calls."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.fwd_calls = inner, "counting", 0

    def fwd(self, *a):
        self.fwd_calls += 1
        return self.inner.fwd(*a)

    def bwd(self, *a):
        return self.inner.bwd(*a)


def _full_inputs(h_kv: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, h_kv, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, h_kv, S, D, generator=g, dtype=torch.float64)
    dout = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _check_case(pool: GroupPool, world: int, d_hp: int, d_cp: int, w: int, placement: str, h_kv: int,
                causal: bool, dtype: torch.dtype, seed: int) -> None:
    rank = dist.get_rank()
    groups = Attention2DGroups.build(list(range(world)), d_hp, d_cp, w, placement, pool=pool)
    lay = groups.layout
    q, k, v, dout = _full_inputs(h_kv, dtype, seed)
    scale = D ** -0.5
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference_attention(*ref_in, causal=causal, scale=scale)
    ref_out.backward(dout)

    loc = [zigzag_shard(t, lay, rank).to(dtype).requires_grad_() for t in (q, k, v)]
    out = attention_2d(*loc, groups=groups, causal=causal, scale=scale)
    out.backward(zigzag_shard(dout, lay, rank).to(dtype))
    what = f"world={world} hp={d_hp} cp={d_cp} w={w} {placement} h_kv={h_kv} causal={causal} {dtype} rank={rank}"
    torch.testing.assert_close(out.double(), zigzag_shard(ref_out.detach(), lay, rank), **TOL[dtype], msg=what)
    for name, t, r in zip("qkv", loc, ref_in):
        torch.testing.assert_close(t.grad.double(), zigzag_shard(r.grad, lay, rank), **TOL[dtype],
                                   msg=lambda m: f"d{name} {what}: {m}")

    # the pieces gathered back are the full output (the shard helpers are each other's inverse)
    pieces = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(pieces, out.detach().contiguous())
    torch.testing.assert_close(zigzag_unshard(pieces, lay).double(), ref_out.detach(), **TOL[dtype], msg=what)


def _check_checkpoint(pool: GroupPool, world: int) -> None:
    """Selective Checkpoint++ across ranks: no attention forward in the recompute, same grads."""
    rank = dist.get_rank()
    groups = Attention2DGroups.build(list(range(world)), 2, world // 2, 1, "context_first", pool=pool)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(B, S, 32, generator=g, dtype=torch.float64)
    wq, wk, wv = (torch.randn(32, H * D, generator=g, dtype=torch.float64) * 0.2 for _ in range(3))
    x_loc = zigzag_shard(x, groups.layout, rank, dim=1)
    kern = CountingKernel(get_kernel("cpu"))

    def layer(cache, x, wq, wk, wv):
        def heads(t):  # (B, s, H*D) -> (B, H, s, D)
            return t.view(B, -1, H, D).transpose(1, 2)
        o = attention_2d(heads(x @ wq), heads(x @ wk), heads(x @ wv), groups=groups, causal=True, kernel=kern,
                         cache=cache)
        return o.transpose(1, 2).reshape(B, -1, H * D).tanh()

    grads = []
    for use_ckpt in (False, True):
        params = [t.clone().requires_grad_() for t in (x_loc, wq, wk, wv)]
        kern.fwd_calls = 0
        y = checkpoint_with_attention_cache(layer, *params) if use_ckpt else layer(None, *params)
        calls_forward = kern.fwd_calls
        (y * y).sum().backward()
        assert kern.fwd_calls == calls_forward == groups.layout.d_cp, (use_ckpt, kern.fwd_calls, calls_forward)
        grads.append([p.grad for p in params])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _check_grid(world: int) -> None:
    """Every case of ``world``'s grid on this rank (the default group spans the ``world`` ranks)."""
    pool = GroupPool()
    seed = 0
    for d_hp, d_cp, w in GRIDS[world]:
        placements = ("head_first", "context_first") if d_hp > 1 and d_cp > 1 else ("head_first",)
        for placement in placements:
            for h_kv in (H, 2):
                for causal in (True, False):
                    seed += 1
                    _check_case(pool, world, d_hp, d_cp, w, placement, h_kv, causal, torch.float64, seed)
    _check_case(pool, world, 2, world // 2, 2, "head_first", 2, True, torch.float32, 99)
    _check_checkpoint(pool, world)
    dist.barrier()


def _grid_on_pool(ctx, world: int) -> None:
    """:func:`_check_grid` on a rank of the shared gloo pool (``conftest.pools``)."""
    assert dist.get_world_size() == world
    _check_grid(world)


def _worker(rank: int, world: int, port: int, errfile: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        _check_grid(world)
    except BaseException:
        with open(f"{errfile}.{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 8])
def test_attention2d_matches_full_attention(world: int, tmp_path, pools) -> None:
    """World 4 on the session's 4-rank gloo pool; world 8 (no other module runs 8 ranks) spawned here."""
    if world == 4:
        pools(4).run(_grid_on_pool, world, timeout_s=300)
        return
    errfile = str(tmp_path / "err")
    try:
        mp.spawn(_worker, args=(world, _free_port(), errfile), nprocs=world, join=True)
    except Exception as e:  # show the first rank's traceback, not only "process 3 terminated"
        logs = sorted(tmp_path.glob("err.*"))
        raise AssertionError(logs[0].read_text() if logs else str(e)) from None


# ---- single-process tests: layout math, shard helpers, errors, Selective Checkpoint++ ----

@pytest.mark.parametrize("placement", ["head_first", "context_first"])
def test_layout_groups_partition_the_sp_group(placement: str) -> None:
    ranks = tuple(range(10, 18))
    lay = Layout2D(ranks, d_hp=2, d_cp=4, w=2, placement=placement)
    hp_groups = {lay.hp_group(c) for c in range(4)}
    cp_groups = {lay.cp_group(h) for h in range(2)}
    assert sorted(r for g in hp_groups for r in g) == list(ranks)
    assert sorted(r for g in cp_groups for r in g) == list(ranks)
    assert sorted(lay.seq_index(r) for r in ranks) == list(range(8))
    adjacent = lay.hp_group(0) if placement == "head_first" else lay.cp_group(0)
    assert adjacent == tuple(range(adjacent[0], adjacent[0] + len(adjacent)))
    for h in range(2):  # inner rings x outer rings tile each CP group
        inner = {lay.inner_ring(h, o) for o in range(2)}
        outer = {lay.outer_ring(h, i) for i in range(2)}
        assert sorted(r for g in inner for r in g) == sorted(lay.cp_group(h))
        assert sorted(r for g in outer for r in g) == sorted(lay.cp_group(h))


def test_zigzag_order_gives_each_cp_rank_chunks_c_and_mirror() -> None:
    order = zigzag_order(16, d_hp=1, d_cp=4)
    assert order.view(4, 4).tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    lay = Layout2D(tuple(range(6)), d_hp=3, d_cp=2, w=1, placement="context_first")
    x = torch.arange(2 * 24).view(2, 24)
    pieces = [zigzag_shard(x, lay, r, dim=1) for r in range(6)]
    assert torch.equal(zigzag_unshard(pieces, lay, dim=1), x)


@pytest.mark.parametrize("kwargs, match", [
    (dict(sp_ranks=(0, 1, 2, 3), d_hp=2, d_cp=4, w=1), "must equal the SP group size"),
    (dict(sp_ranks=tuple(range(6)), d_hp=1, d_cp=6, w=4), "w=4 must divide d_cp=6"),
    (dict(sp_ranks=(0, 1), d_hp=1, d_cp=2, w=1, placement="diagonal"), "placement"),
])
def test_invalid_layout_raises(kwargs, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Layout2D(**kwargs)


@pytest.mark.parametrize("seq, d_hp, d_cp, match", [(18, 1, 4, "2\\*d_cp = 8"), (40, 3, 4, "d_sp = 12")])
def test_zigzag_bad_sequence_raises(seq: int, d_hp: int, d_cp: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        zigzag_order(seq, d_hp, d_cp)


@pytest.mark.parametrize("h, h_kv, d_hp, match", [
    (6, 6, 4, "d_hp=4 must divide the 6 query heads"),
    (12, 6, 4, "d_hp=4 must divide the 6 key/value heads"),
    (12, 4, 6, "not a multiple"),
    (8, 3, 2, "multiple of key/value heads"),
])
def test_head_degree_errors(h: int, h_kv: int, d_hp: int, match: str) -> None:
    lay = Layout2D(tuple(range(d_hp)), d_hp, 1, 1)
    groups = Attention2DGroups(layout=lay, rank=0, hp_group=None, ring=RingSpec(1, 1, 0))
    q, kv = torch.zeros(1, h, 4, 8), torch.zeros(1, h_kv, 4, 8)
    with pytest.raises(ValueError, match=match):
        attention_2d(q, kv, kv, groups=groups, causal=True)


@pytest.mark.parametrize("h, h_kv, d_hp, rep", [(8, 4, 8, 2), (8, 2, 4, 2), (8, 8, 2, 1), (28, 4, 2, 1), (28, 4, 4, 1)])
def test_kv_replication_factor(h: int, h_kv: int, d_hp: int, rep: int) -> None:
    from braid.attention.attention2d import _check_heads

    assert _check_heads(h, h_kv, d_hp) == rep


def test_selective_checkpoint_skips_attention_in_recompute() -> None:
    torch.manual_seed(0)
    kern = CountingKernel(get_kernel("cpu"))
    spec = RingSpec(1, 1, 0)
    from braid.attention import ring_attention

    def layer(cache, q, k, v):
        out, _ = ring_attention(q * 2, k.sin(), v, spec, causal=True, scale=0.25, kernel=kern, cache=cache)
        return out.exp()

    inputs = [torch.randn(1, 4, 16, 8, dtype=torch.float64) for _ in range(3)]
    results = []
    for use_ckpt in (False, True):
        leaves = [t.clone().requires_grad_() for t in inputs]
        kern.fwd_calls = 0
        y = checkpoint_with_attention_cache(layer, *leaves) if use_ckpt else layer(None, *leaves)
        y.sum().backward()
        assert kern.fwd_calls == 1
        results.append([y.detach()] + [t.grad for t in leaves])
    for a, b in zip(*results):
        assert torch.equal(a, b)
