"""TP building blocks on one process: shards reassemble the full layer; split W equals full backward."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from braid.tp import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, split_weight_grads, vocab_parallel_cross_entropy
from braid.tp.layers import StashError
from braid.core.topology import Topology, TopologyError


def test_column_and_row_shards_reassemble_the_full_linear() -> None:
    torch.manual_seed(0)
    full = nn.Linear(8, 12, bias=True)
    x = torch.randn(3, 5, 8)
    cols = [ColumnParallelLinear.from_full(full, r, 2) for r in range(2)]
    torch.testing.assert_close(torch.cat([c(x) for c in cols], -1), full(x))
    rows = [RowParallelLinear.from_full(full, r, 2) for r in range(2)]
    partial = sum(r(x[..., i * 4 : (i + 1) * 4]) for i, r in enumerate(rows))
    torch.testing.assert_close(partial, full(x))


def test_split_weight_grad_accumulates_like_full_backward_in_any_order() -> None:
    torch.manual_seed(0)
    full = nn.Linear(6, 4, bias=True)
    a, b = ColumnParallelLinear.from_full(full, 0, 1), ColumnParallelLinear.from_full(full, 0, 1)
    xs = [torch.randn(2, 3, 6, requires_grad=True) for _ in range(3)]
    for x in xs:  # full mode
        a(x).square().sum().backward()
    gx = []
    for mb, x in enumerate(xs):  # split mode: B now, W later in reverse order
        with split_weight_grads([b], mb):
            (g,) = torch.autograd.grad(b(x).square().sum(), (x,))
        gx.append(g)
        assert b.weight.grad is None
    for mb in reversed(range(3)):
        b.weight_backward(mb)
    torch.testing.assert_close(b.weight.grad, a.weight.grad)
    torch.testing.assert_close(b.bias.grad, a.bias.grad)
    for x, g in zip(xs, gx):
        torch.testing.assert_close(g, x.grad)  # the input gradient is unchanged by the split
    with pytest.raises(StashError, match="no stashed activations for 0"):
        b.weight_backward(0)


def _group(bias: bool, dtype=torch.float64):
    from braid.tp.layers import ColumnParallelGroup

    torch.manual_seed(0)
    fulls = [nn.Linear(6, n, bias=bias).to(dtype) for n in (8, 2, 2)]
    parts = [ColumnParallelLinear.from_full(f, 0, 1) for f in fulls]
    return fulls, parts, ColumnParallelGroup(parts)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("mode", ["full", "split", "accumulate"])
def test_a_group_computes_what_its_linears_compute(bias: bool, mode: str) -> None:
    """One GEMM over Q/K/V-shaped parts: the joined output, the input gradient and every
    part's weight (and bias) gradient, summed over micro-batches, equal the separate
    linears' (fp64), in full mode, split (B now, W later) and accumulated in the GEMM."""
    fulls, parts, group = _group(bias)
    w = group.joined()[0]
    assert all(p.weight.untyped_storage().data_ptr() == w.untyped_storage().data_ptr() for p in parts)
    xs = [torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    dys = [torch.randn(2, 3, 12, dtype=torch.float64) for _ in range(3)]
    for x, dy in zip(xs, dys):
        torch.cat([f(x) for f in fulls], -1).backward(dy)
    want_x = [x.grad.clone() for x in xs]
    for mb, (x, dy) in enumerate(zip(xs, dys)):
        x.grad = None
        y = group(x)
        torch.testing.assert_close(y, torch.cat([f(x) for f in fulls], -1))
        if mode == "split":
            with split_weight_grads([group], mb):
                y.backward(dy)
            assert group.has_stash(mb) and all(p.weight.grad is None for p in parts)
        else:
            group.native.accumulate = mode == "accumulate"
            y.backward(dy)
        torch.testing.assert_close(x.grad, want_x[mb])
    for mb in range(3) if mode == "split" else ():
        group.weight_backward(mb)
    for f, p in zip(fulls, parts):
        torch.testing.assert_close(p.weight.grad, f.weight.grad)
        if bias:
            torch.testing.assert_close(p.bias.grad, f.bias.grad)
    if mode != "full":  # the grads it made lie back to back: later ones are added inside the GEMM
        assert group._joined_grads() is not None


def test_a_group_packs_its_parts_again_after_they_moved() -> None:
    """Parts re-allocated apart (as ``module.to`` does) are laid back to back again by the next
    call, with the values they had; a group refuses parts of different input widths."""
    from braid.tp.layers import ColumnParallelGroup

    fulls, parts, group = _group(True)
    for p in parts:
        p.weight.data = p.weight.data.clone()
    assert torch.equal(parts[1].weight, fulls[1].weight) and group.joined() is not None
    x = torch.randn(4, 6, dtype=torch.float64)
    torch.testing.assert_close(group(x), torch.cat([f(x) for f in fulls], -1))
    w, b = group.joined()
    assert parts[2].weight.data_ptr() == w.data_ptr() + (8 + 2) * 6 * w.element_size()
    with pytest.raises(ValueError, match="one input width"):
        ColumnParallelGroup([parts[0], ColumnParallelLinear.from_full(nn.Linear(5, 2).double(), 0, 1)])


def test_vocab_parallel_embedding_and_cross_entropy_match_full() -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4)
    tok = torch.randint(0, 10, (2, 5))
    shards = [VocabParallelEmbedding.from_full(emb, r, 2) for r in range(2)]
    torch.testing.assert_close(sum(s(tok) for s in shards), emb(tok))
    logits = torch.randn(2, 5, 10, requires_grad=True)
    labels = torch.randint(0, 10, (2, 5))
    ref = F.cross_entropy(logits.view(-1, 10), labels.view(-1), reduction="none").view(2, 5)
    ours = vocab_parallel_cross_entropy(logits, labels)
    torch.testing.assert_close(ours, ref)
    (g1,) = torch.autograd.grad(ours.sum(), logits)
    (g2,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(g1, g2)


def test_topology_grid_and_errors() -> None:
    t = Topology(8, pp=2, dp=2, tp=2)
    assert t.coords(5) == t.coords(t.rank_of(t.coords(5)))
    assert t.group_of("tp", 5) == [4, 5]
    assert t.group_of("pp", 5) == [5, 7]  # grid (dp, pp, cp, tp): rank = dp*4 + pp*2 + tp
    assert t.group_of("dp", 1) == [1, 5]
    assert t.groups("dp_cp")[0] == [0, 4]
    with pytest.raises(TopologyError, match="world size 6 != dp\\*pp\\*cp\\*tp"):
        Topology(6, pp=4)
    with pytest.raises(TopologyError, match="attention heads \\(6\\) not divisible by tp=4"):
        Topology(4, pp=1, tp=4).check_model(num_heads=6, num_kv_heads=2, vocab_size=64, num_layers=4, num_stages=1)
    with pytest.raises(TopologyError, match="KV heads \\(2\\) not divisible"):
        Topology(4, pp=1, tp=4).check_model(num_heads=8, num_kv_heads=2, vocab_size=64, num_layers=4, num_stages=1)
    with pytest.raises(TopologyError, match="vocab size \\(10\\)"):
        Topology(4, pp=1, tp=4).check_model(num_heads=8, num_kv_heads=4, vocab_size=10, num_layers=4, num_stages=1)
    with pytest.raises(TopologyError, match="3 layers cannot fill 4 virtual stages"):
        Topology(2, pp=2).check_model(num_heads=8, num_kv_heads=4, vocab_size=10, num_layers=3, num_stages=4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_the_fusible_logits_gradient_equals_the_in_place_one_bitwise(dtype: torch.dtype) -> None:
    from braid.tp.embedding import ce_logits_grad, ce_logits_grad_fused, ce_row_max, ce_row_stats

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(24, 40, generator=g).to(dtype)
    labels = torch.randint(-20, 60, (24,), generator=g)  # this shard holds [0, 40): the rest are other shards'
    mask = (labels < 0) | (labels >= 40)
    local = labels.masked_fill(mask, 0)
    lmax = ce_row_max(logits)
    _, sum_exp = ce_row_stats(logits, lmax, local, mask)
    grad_loss = torch.rand(24, generator=g, dtype=lmax.dtype)
    want = ce_logits_grad(logits, lmax, sum_exp, local, mask, grad_loss)
    got = ce_logits_grad_fused(logits, lmax, sum_exp, local, mask, grad_loss)
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)
    assert mask.any() and (~mask).any()  # both kinds of label are in the case


def _w_into_main_grad(dtype: torch.dtype, device: str, group: bool):
    """A column-parallel linear (or a group of two) whose weights have fp32 ``main_grad`` buffers, after one split
    W task: (the buffers, the fp64 expected sums, the largest allocation the W task made)."""
    from braid.tp.layers import ColumnParallelGroup

    torch.manual_seed(0)
    parts = [ColumnParallelLinear.from_full(nn.Linear(64, n, bias=False), 0, 1).to(device, dtype) for n in (48, 80)]
    mod = ColumnParallelGroup(parts) if group else parts[0]
    ws = [p.weight for p in parts] if group else [parts[0].weight]
    for w in ws:
        w.main_grad = torch.randn(w.shape, dtype=torch.float32, device=device)
    start = [w.main_grad.double() for w in ws]
    x = torch.randn(4, 16, 64, dtype=dtype, device=device, requires_grad=True)
    gy = torch.randn(4, 16, sum(w.shape[0] for w in ws), dtype=dtype, device=device)
    with split_weight_grads([mod], "k"):
        mod(x).backward(gy)
    g2, x2 = gy.reshape(-1, gy.shape[-1]).double(), x.detach().reshape(-1, 64).double()
    split = g2.split([w.shape[0] for w in ws], dim=1)
    want = [s + g.t() @ x2 for s, g in zip(start, split)]
    # fp32 accumulation of n exact products (bf16 x bf16 is exact in fp32) onto the start: |error| <= (n+1) eps32 sum|terms|
    bound = [(x2.shape[0] + 1) * torch.finfo(torch.float32).eps * (s.abs() + g.t().abs() @ x2.abs()) for s, g in zip(start, split)]
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    mod.weight_backward("k")
    made = torch.cuda.max_memory_allocated() - base if device == "cuda" else None
    return [w.main_grad for w in ws], want, bound, made


@pytest.mark.parametrize("group", [False, True])
def test_a_w_task_adds_into_an_fp32_main_grad_in_its_gemm(group: bool, monkeypatch) -> None:
    """fp32 weights (CPU): the W task's GEMM adds into ``main_grad`` (no product made apart and added: that path,
    accumulate_grad, is made to fail here), within fp32 rounding of the exact sum."""
    from braid.tp import layers

    def made_apart(p, g):
        raise AssertionError(f"a weight gradient {tuple(g.shape)} was made apart and added")

    monkeypatch.setattr(layers, "accumulate_grad", made_apart)
    got, want, bound, _ = _w_into_main_grad(torch.float32, "cpu", group)
    for g, w, b in zip(got, want, bound):
        assert bool(((g.double() - w).abs() <= b).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.addmm's out_dtype)")
@pytest.mark.parametrize("group", [False, True])
def test_a_bf16_w_task_accumulates_in_fp32_without_a_temporary(group: bool) -> None:
    """bf16 inputs into an fp32 ``main_grad`` on CUDA: the product is accumulated in fp32 in the GEMM (closer to the
    exact sum than a bf16 product would be: one bf16 rounding of a 64-term dot product is 2^-8 relative) and no
    weight-sized temporary is allocated."""
    got, want, bound, made = _w_into_main_grad(torch.bfloat16, "cuda", group)
    for g, w, b in zip(got, want, bound):
        assert bool(((g.double() - w).abs() <= b).all())
    assert made < min(g.numel() for g in got) * 2, made  # less than one bf16 weight-sized product


@pytest.mark.parametrize("joined", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_swiglu_down_keeps_gate_and_up_and_computes_the_unfused_mlp(joined: bool, split: bool) -> None:
    """``braid.tp.swiglu_down``: loss, the gradients of gate and up and the down-projection's weight gradient
    equal the unfused ``down(silu(gate) * up)`` bitwise (eager: autograd's own formulas), with the weight
    gradient computed at once or stashed for a W task; its backward keeps gate and up, not their product, and
    writes their gradients into their memory."""
    from braid.models.qwen2 import EAGER
    from braid.tp.swiglu_down import swiglu_down

    torch.manual_seed(0)
    b, s, f, h = 2, 5, 6, 4
    down = RowParallelLinear(torch.randn(h, f, dtype=torch.float64), None)
    ref = nn.Linear(f, h, bias=False, dtype=torch.float64)
    ref.weight.data.copy_(down.weight.data)
    gate_up = torch.randn(b, s, 2 * f, dtype=torch.float64)
    target = torch.randn(b, s, h, dtype=torch.float64)

    def inputs():
        x = gate_up.clone().requires_grad_()
        return x, ((x,) if joined else tuple(x.unflatten(-1, (2, -1)).unbind(-2)))

    x0, acts0 = inputs()
    y0 = ref(EAGER.swiglu_joined(*acts0) if joined else EAGER.swiglu(*acts0))
    ((y0 - target) ** 2).sum().backward()
    x1, acts1 = inputs()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fwd, bwd = (EAGER.swiglu_joined, EAGER.swiglu_joined_grad) if joined else (EAGER.swiglu, EAGER.swiglu_grad)
        y1 = swiglu_down(down, fwd, bwd, *acts1)
    assert sum(t.numel() for t in saved) == b * s * 2 * f  # gate and up; no product
    assert torch.equal(y1, y0)
    written: list[int] = []  # where the gradients of gate and up are: in their own memory (swiglu_grad works in place)
    for a in acts1:
        a.register_hook(lambda g: written.append(g.data_ptr()))
    with split_weight_grads([down], "mb") if split else nullcontext():
        ((y1 - target) ** 2).sum().backward()
    assert sorted(written) == sorted(a.data_ptr() for a in acts1)
    assert torch.equal(x1.grad, x0.grad)
    if split:
        assert down.weight.grad is None and down.has_stash("mb")
        down.weight_backward("mb")
    assert torch.equal(down.weight.grad, ref.weight.grad)
