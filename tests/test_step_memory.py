"""The optimizer step's memory model (:mod:`braid.cost.step_memory`) and the eager loss's workspace
(:func:`braid.cost.runtime_act.eager_loss_workspace`) against the real code on CPU.

The parameter list follows the chunks' own parameters; the shards follow
:class:`~braid.training.optimizer.ShardedAdamW`'s pieces; the step's temporaries and the loss's
workspace are the bytes the real code allocates, counted by a dispatch mode that follows every
fresh tensor storage until it is freed (CPU's allocator keeps no peak counter). The stored 2-GPU
runs (``benchmarks/results/memory_dp2_*.json``, compiled units) are re-predicted from their config alone.
"""

from __future__ import annotations

import json
import weakref

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from braid.cost.step_memory import (Param, extra_state_bytes, norm_bytes, param_sizes, shard_pieces, step_transient_bytes,
                                    worst_step_transient_bytes)
from test_examples import ROOT


class _PeakBytes(TorchDispatchMode):
    """Peak bytes of the storages that ops allocate while active (in-place results and views excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.live, self.peak, self.ptrs = 0, 0, set()

    def _free(self, ptr: int, n: int) -> None:
        self.ptrs.discard(ptr)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
            if n == 0 or ptr in inputs or ptr in self.ptrs:
                continue
            self.ptrs.add(ptr)
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, ptr, n)
        return out


def _sizes() -> list[Param]:
    # two big matrices (embedding and head) dominate, as in a real LM
    return param_sizes(hidden=64, kv=16, ffn=128, vocab=3000, layers=2, embed=True, head=True)


def _tensors(params: list[Param], dtype: torch.dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(p.numel, generator=g).to(dtype)) for p in params]


@pytest.mark.parametrize("layout", [(2, 2), (1.5, 2.5)], ids=["whole", "half-cut"])
def test_param_sizes_follow_the_chunks_parameters(layout) -> None:
    from braid import schedules
    from braid.core.partition import chunk_specs
    from braid.cost.catalog import get_model
    from braid.models.build import build_rank_chunks, meta_model
    from braid.models.registry import get_family
    from braid.models.shapes import decoder_config

    preset = get_model("qwen2-tiny")
    cfg = decoder_config(preset, layers=4)
    model = meta_model(get_family(preset.family).model_cls, cfg, seed=1, std=0.02, device=torch.device("cpu"))
    plan = schedules.build("1f1b", 2, 2)
    for stage in range(2):
        chunks = build_rank_chunks(model, plan, stage, layout, tp_rank=0, tp_size=1, tp_group=None)
        real = [Param(p.numel()) for ch in chunks.values() for p in ch.parameters()]
        spec = chunk_specs(layout, 2, plan.placement)[(stage, 0)]
        assert real == param_sizes(preset.hidden, preset.kv_heads * preset.head_dim, preset.ffn, preset.vocab, spec.layers,
                                   embed=stage == 0, head=stage == 1, half_in=spec.half_in, half_out=spec.half_out)


@pytest.mark.parametrize("mode", ["zero1", "master", "plain"])
@pytest.mark.parametrize("ways", [1, 2, 3, 7, 40, 1000])  # 1000: shards inside the embedding after a partial one
def test_worst_rank_is_the_max_over_ranks(mode: str, ways: int) -> None:
    params = _sizes()
    want = max(step_transient_bytes(mode, params, ways, k) for k in range(ways))
    assert worst_step_transient_bytes(mode, params, ways) == want


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_shard_pieces_and_reduce_shard_match_sharded_adamw(monkeypatch, rank: int) -> None:
    from braid.training import optimizer as mod

    monkeypatch.setattr(mod.dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(mod.dist, "get_rank", lambda group=None: rank)
    params = _sizes()
    opt = mod.ShardedAdamW([(f"p{i}", p) for i, p in enumerate(_tensors(params, torch.float32))], group=object())
    assert [pc.hi - pc.lo for pc in opt.pieces] == [p.numel for p in shard_pieces(params, 3, rank)]
    assert extra_state_bytes("zero1", params, 3) == opt.grad_shard.numel() * opt.grad_shard.element_size()


@pytest.mark.parametrize("mode", ["master", "zero1"])
def test_sharded_step_temporaries_match_the_model(monkeypatch, mode: str) -> None:
    from braid.training import optimizer as mod

    ways = 2 if mode == "zero1" else 1
    if ways > 1:  # no collective runs below: reduce() is skipped, the norm is not all-reduced without a group
        monkeypatch.setattr(mod.dist, "get_world_size", lambda group=None: ways)
        monkeypatch.setattr(mod.dist, "get_rank", lambda group=None: 1)
    params = _sizes()
    opt = mod.ShardedAdamW([(f"p{i}", p) for i, p in enumerate(_tensors(params, torch.float32))], weight_decay=0.01,
                           group=object() if ways > 1 else None, shard=ways > 1)
    opt._group = None
    opt.main_grad.normal_()
    if opt.grad_shard is not None:
        opt.grad_shard.normal_()
    with _PeakBytes() as norm:
        opt.grad_norm()
    with _PeakBytes() as update:
        torch.optim.AdamW.step(opt)
    rank = 1 if ways > 1 else 0
    assert norm.peak == norm_bytes(mode, params, ways, rank) + 16  # + the fp64 sum and a piece's
    assert update.peak == 0
    assert all(g["fused"] for g in opt.param_groups)  # torch's fused kernel: the moments updated in place


@pytest.mark.parametrize("n", [1000, 1024, 3000])
def test_the_norm_squares_a_large_gradient_in_chunks_of_bounded_temporaries(monkeypatch, n: int) -> None:
    """Past ``NORM_CHUNK`` elements (256 here) the squares are summed chunk by chunk: the sum is the exact one
    up to float64 rounding, and the temporaries are one chunk's float64 copy, as the model says."""
    import math

    from braid.cost import step_memory
    from braid.training import grads as mod

    monkeypatch.setattr(mod, "NORM_CHUNK", 256)
    monkeypatch.setattr(step_memory, "NORM_CHUNK", 256)
    g = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float32).reshape(-1, 8)
    exact = math.fsum(float(x) ** 2 for x in g.reshape(-1).tolist())
    with _PeakBytes() as norm:
        got = mod.square_sum(g)
    assert got.dtype == torch.float64 and abs(float(got) - exact) <= 1e-12 * exact
    assert norm.peak <= norm_bytes("plain", [Param(n)], 1, 0) + 16 == 8 * 256 + 16  # + the sum and a chunk's
    gd = g.double()
    kept = gd.clone()
    assert float(mod.square_sum(gd)) == pytest.approx(exact, rel=1e-12) and torch.equal(gd, kept)  # squared in a copy


def test_plain_step_temporaries_match_the_model() -> None:
    """``plain``: braid's Optimization over the parameters (torch's AdamW, fused), the norm on the group's first rank."""
    from braid.training.grads import clip_grads_
    from braid.training.step import OptimConfig, Optimization

    params = _sizes()
    ps = _tensors(params, torch.bfloat16)
    for p in ps:
        p.grad = torch.randn_like(p)
    cfg = OptimConfig.of_mode("plain")
    opt = Optimization(cfg, [(f"p{i}", p) for i, p in enumerate(ps)], [])
    assert not opt.sharded and all(g["fused"] for g in opt.optimizer.param_groups)
    opt.optimizer.step()  # the moments exist after the first step, as in a run's later steps
    with _PeakBytes() as norm:
        clip_grads_(ps, [True] * len(ps), None)
    with _PeakBytes() as update:
        opt.optimizer.step()
    assert norm.peak == norm_bytes("plain", params, 2, 0) + 16
    assert norm_bytes("plain", params, 2, 1) == 0  # the other replica counts nothing
    assert update.peak == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eager_loss_workspace_matches_the_loss(dtype: torch.dtype) -> None:
    """The head's logits and the eager loss: the peak above what stays for the backward (the logits), forward and backward."""
    from braid.cost.runtime_act import eager_loss_workspace
    from braid.tp.embedding import vocab_parallel_cross_entropy

    tokens, hidden, vocab = 64, 32, 1000
    g = torch.Generator().manual_seed(0)
    # 2-d: a 3-d linear returns a view of its matmul's output, whose first tensor object (the one
    # _PeakBytes follows) dies while the storage lives on
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = torch.randn(vocab, hidden, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    with _PeakBytes() as mem:
        loss = vocab_parallel_cross_entropy(torch.nn.functional.linear(x, w), labels).mean()
        kept = mem.live
        fwd_peak, mem.peak = mem.peak, mem.live
        loss.backward()
        bwd_peak = mem.peak
    d = torch.empty((), dtype=dtype).element_size()
    # besides the logits, the loss keeps per-token vectors (max, sum, labels, mask) for its backward
    assert 0 <= kept - d * tokens * vocab <= 64 * tokens  # the logits in their own dtype, no fp32 softmax
    for peak in (fwd_peak, bwd_peak):  # the workspace of either pass (the backward's: the linear's gradients too)
        extra = peak - kept - eager_loss_workspace(tokens, vocab, d)
        assert -64 * tokens <= extra <= 64 * tokens + d * vocab * hidden, (peak, kept, extra)  # per-token vectors come and go


def test_eager_loss_workspace_enters_the_simulated_peak() -> None:
    """Uncompiled the head's workspace is the eager loss's; at pp=1 it adds to the peak."""
    from braid.core.braiding import Unit
    from braid.cost.catalog import get_model
    from braid.cost.costs import Layout, analytic_costs
    from braid.cost.runtime_act import eager_loss_workspace
    from braid.cost.hardware import get_hardware
    from braid.simulator.fast import simulate_schedule

    model = get_model("qwen2-7b").with_(layers=2, seq=4096, micro_batch_size=1, dtype_bytes=2)
    hw = get_hardware("h100")

    def head_and_peak(tp: int, compiled: bool) -> tuple[float, float]:
        costs = analytic_costs(model, hw, Layout(tp, 1, 1), activations="runtime", compiled=compiled)
        return costs.chunks[(0, 0)].units[Unit.HEAD].tmp, simulate_schedule("1f1b", 1, 2, costs).report.ranks[0].peak_activation_bytes

    (tmp_c, peak_c), (tmp_e, peak_e) = head_and_peak(1, True), head_and_peak(1, False)
    assert tmp_c == 0 and tmp_e == eager_loss_workspace(4096, model.vocab, 2) == 8 * 4096 * model.vocab
    assert peak_e - peak_c == tmp_e  # charged in the head's backward, on top of everything the forward kept
    # vocab-parallel, compiled: its fused pieces' one vocabulary-sized tensor, the logits' gradient
    assert head_and_peak(2, True)[0] == 2 * 4096 * (model.vocab // 2) < eager_loss_workspace(4096, model.vocab // 2, 2)
    assert analytic_costs(model, hw, Layout(1, 1, 1), compiled=False).chunks[(0, 0)].units[Unit.HEAD].tmp == 0


@pytest.mark.parametrize("name", ["memory_dp2_h100.json"])
def test_stored_two_gpu_run_is_predicted_within_ten_percent(name: str) -> None:
    """The model (simulator activations + mode state + step temporaries), from the stored run's config only."""
    import argparse
    import importlib.util

    from braid import schedules

    spec = importlib.util.spec_from_file_location("bench_memory", ROOT / "benchmarks" / "bench_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    doc = json.loads((ROOT / "benchmarks" / "results" / name).read_text())
    args = argparse.Namespace(**doc["config"])
    plan = schedules.build(args.schedule, args.pp, args.mbs)
    # ranks of the stored run in global order: dp outermost at tp = pp = 1
    assert args.tp == args.pp == 1
    from braid.cost.cluster import Cluster, Parallel, dp_costs
    from braid.cost.catalog import get_model
    from braid.cost.costs import Layout, analytic_costs
    from braid.cost.hardware import get_hardware
    from braid.simulator.fast import simulate_schedule

    for run in doc["runs"]:
        pred = {at: p for at, (p, _) in bench.predicted(args, plan, run["optimizer"], run["recompute"], 2).items()}
        # the planner's and the simulator's peak (DpCosts.peak_bytes) is the worst data-parallel rank's
        model = get_model(args.model).with_(layers=args.layers, seq=args.seq, micro_batch_size=args.micro_batch_size)
        costs = analytic_costs(model, get_hardware(args.hardware), Layout(1, 1, 1, plan.placement), activations="runtime",
                               recompute=run["recompute"])
        act = simulate_schedule(args.schedule, 1, args.mbs, costs).report.ranks[0].peak_activation_bytes
        dc = dp_costs(model, costs, Cluster(get_hardware(args.hardware)), Parallel(1, 1, args.dp, optimizer=run["optimizer"]))
        assert dc.peak_bytes(0, act) == max(pred.values())
        for k, meas in enumerate(run["measured_bytes"]):
            assert abs(pred[(0, k)] - meas) <= 0.10 * meas, (run["optimizer"], run["recompute"], k, pred[(0, k)], meas)
