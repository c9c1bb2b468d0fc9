"""megatron-core's MoE GPT model (:mod:`braid.baselines.megatron_moe`) computes what braid's Qwen3-MoE computes.

Its routing (``moe_router_pre_softmax`` picked from ``norm_topk_prob``) gives Qwen3's top-k
experts and weights; the weight conversion is exact both ways and per expert-parallel rank;
a megatron-core MoE ``GPTModel`` with converted weights gives braid's logits (MoE and dense
layers, QK-norm). On gloo ranks (``mcore_1f1b_i`` through :class:`braid.baselines.mcore.McorePipeline`,
alltoall dispatcher) at ep=2 (world 2, dp=2) and pp=2 x ep=2 (world 4, interleaved): the step's
loss and every gradient, reduced over the replicas, match the single-process model over the
whole batch. Skipped without megatron-core.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install -e '.[megatron]')")

from tests.conftest import GPU_RUN_S, GPU_TEST_S  # noqa: E402

M, B, SEQ = 2, 2, 8  # micro-batches per data-parallel replica, samples per micro-batch, tokens
RTOL, ATOL = 1e-4, 1e-5  # megatron-core's logits against braid's, as tests/test_baselines_mcore.py


def _cfg(norm_topk_prob: bool = True, layers: int = 4):
    from braid.models.qwen3_moe import Qwen3MoeConfig

    # qwen3-moe-tiny's shape (braid.cost.catalog), layer 1 dense (mlp_only_layers)
    return Qwen3MoeConfig(vocab_size=32, hidden=32, layers=layers, heads=4, kv_heads=2, ffn=64, experts=4, experts_per_token=2,
                          moe_ffn=16, norm_topk_prob=norm_topk_prob, mlp_only_layers=(1,))


def _model(norm_topk_prob: bool = True):
    from braid.models.qwen3_moe import Qwen3MoeModel

    return Qwen3MoeModel(_cfg(norm_topk_prob)).init_weights(7)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_routing_equals_qwen3(norm_topk_prob):
    """megatron-core's top-k routing with the mapped ``moe_router_pre_softmax`` picks Qwen3's experts with its weights."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from braid.baselines.megatron_moe import moe_fields
    from braid.models.moe import route

    cfg = _cfg(norm_topk_prob)
    fields = moe_fields(cfg)
    logits = torch.randn(64, cfg.experts, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
    probs, chosen = topk_routing_with_score_function(logits, fields["moe_router_topk"],
                                                     use_pre_softmax=fields["moe_router_pre_softmax"],
                                                     score_function=fields["moe_router_score_function"])
    weights, experts = route(logits, cfg.experts_per_token, norm_topk_prob)
    want = torch.zeros_like(logits).scatter(1, experts, weights)
    assert torch.equal(chosen, want > 0)
    # megatron-core takes its softmax in float32 whatever the logits (braid's route: float64 here): a few float32 ulps
    torch.testing.assert_close(probs, want, rtol=0, atol=8 * torch.finfo(torch.float32).eps)


def test_weight_conversion_round_trip_and_ep_shards():
    from braid.baselines import megatron_moe as mm

    model = _model()
    sd = model.state_dict()
    full = mm.to_mcore(sd, model.cfg)
    back = mm.from_mcore(full, model.cfg)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], v) for k, v in sd.items())
    assert full["decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"].equal(sd["layers.2.experts.gate_up.weight"][3])
    shards = [mm.ep_shard(full, r, 2, model.cfg.experts) for r in range(2)]
    assert shards[1]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"].equal(sd["layers.0.experts.down.weight"][2])
    experts = {k for k in full if mm.is_expert_param(k)}
    assert sum(len([k for k in s if mm.is_expert_param(k)]) for s in shards) == len(experts)
    assert all(s.keys() - experts == full.keys() - experts for s in shards)  # the rest on every rank


def _case_logits(ctx, norm_topk_prob: bool):
    """One process's megatron-core MoE model (ep=1) against braid's, from converted weights."""
    from braid.baselines import megatron_gpt as bm
    from braid.baselines import megatron_moe as mm

    bm.ensure_parallel_state(1, 1, None)
    model = _model(norm_topk_prob)
    cfg = model.cfg
    gpt = mm.gpt_model(cfg, bm.transformer_config(cfg, extra=mm.moe_fields(cfg)), seq_len=SEQ)
    gpt.load_state_dict(mm.to_mcore(model.state_dict(), cfg), strict=True)
    toks = torch.randint(0, cfg.vocab_size, (B, SEQ), generator=torch.Generator().manual_seed(ctx.rank))
    with torch.no_grad():
        got, want = gpt(toks, torch.arange(SEQ).expand(toks.shape), None).float(), model.logits(toks)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    return True


def _data(vocab: int, replicas: int):
    g = torch.Generator().manual_seed(5)
    toks = torch.randint(0, vocab, (replicas * M * B, SEQ), generator=g)
    labs = torch.randint(0, vocab, (replicas * M * B, SEQ), generator=g)
    labs[0, :2] = -100  # ignored positions count as in the reference
    return toks, labs


def _ref_loss(model, toks, labs, micro: int) -> torch.Tensor:
    from braid.baselines.torch_pp import cross_entropy

    return sum(cross_entropy(model.logits(t), y) for t, y in zip(toks.chunk(micro), labs.chunk(micro))) / micro


def _pipe(ctx, pp: int, ep: int, device: str, mode: str, dtype: torch.dtype):
    """``mcore_1f1b_i`` on the test's Qwen3-MoE model at pp x ep (dp = ep x the expert-data-parallel ranks)."""
    from braid.baselines.mcore import McorePipeline
    from braid.baselines.modes import McoreMode
    from braid.core.topology import Topology

    groups = ctx.process_groups(Topology(ctx.world_size, pp=pp, dp=ctx.world_size // pp))
    model = _model()
    layers = (model.cfg.layers // (2 * pp),) * (2 * pp)
    dev = torch.device(f"cuda:{ctx.rank}" if device == "cuda" else "cpu")
    pipe = McorePipeline("mcore_1f1b_i", model, layers, M, groups=groups, device=dev, dtype=dtype, seq_len=SEQ,
                         mode=McoreMode.parse(mode), ep=ep)
    return pipe, model, layers


def _step(pipe, toks, labs):
    """This rank's replica's micro-batches (megatron-core's replica index, not braid's), one step, reduced gradients."""
    mine = slice(pipe.dp_rank * M * B, (pipe.dp_rank + 1) * M * B)
    loss = pipe.step((toks[mine],), labs[mine])
    pipe.reduce_gradients()
    return loss


def _case_pipeline(ctx, pp: int, ep: int, device: str = "cpu"):
    """One step of ``mcore_1f1b_i`` on a Qwen3-MoE model at pp x ep (dp = ep): the mean loss over the replicas and
    every reduced gradient against the single-process model over the whole batch (float32 and float64
    references, :func:`tests.reference_error.assert_matches_reference`). Returns the loss the rank reports."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from braid.baselines import megatron_moe as mm
    from braid.core.ir import stage_of
    from braid.core.partition import layer_offset
    from tests.reference_error import assert_matches_reference

    dp = ctx.world_size // pp
    pipe, model, layers = _pipe(ctx, pp, ep, device, "eager", torch.float32)
    cfg = model.cfg
    toks, labs = _data(cfg.vocab_size, dp)
    loss = _step(pipe, toks, labs)
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    ref_loss, ref64_loss = (_ref_loss(m, toks, labs, dp * M) for m in (ref, ref64))
    ref_loss.backward()
    ref64_loss.backward()
    where = f"mcore MoE pp={pp} ep={ep} {device} rank={ctx.rank}"
    # the mean over the replicas of the last stage's losses (each rank of the last stage holds one)
    got = torch.tensor([loss if loss is not None else 0.0, float(loss is not None)], dtype=torch.float64,
                       device=ctx.dist.device)  # NCCL reduces device tensors only
    dist.all_reduce(got)
    got = got.cpu()
    assert_matches_reference(torch.tensor(float(got[0] / got[1]), dtype=torch.float32), ref_loss.detach(), ref64_loss.detach(),
                             what=f"{where} loss")

    def mcore_grads(m):
        return mm.ep_shard(mm.to_mcore({n: p.grad for n, p in m.named_parameters()}, cfg),
                           ps.get_expert_model_parallel_rank(), ep, cfg.experts)

    from braid.baselines.megatron_gpt import chunk_state

    grads, grads64 = mcore_grads(ref), mcore_grads(ref64)
    scale = max(float(p.grad.abs().max()) for p in ref.parameters())
    pp_rank = ps.get_pipeline_model_parallel_rank()
    stages = [0] if pp == 1 else [stage_of("loop", pp, pp_rank, c) for c in range(2)]
    for mod, s in zip(pipe.modules, stages):
        n = cfg.layers if pp == 1 else layers[s]
        first = 0 if pp == 1 else layer_offset(layers, s)
        want = chunk_state(grads, first, n, embed=mod.pre_process, head=mod.post_process)
        want64 = chunk_state(grads64, first, n, embed=mod.pre_process, head=mod.post_process)
        got_grads = {k: p.grad.cpu() for k, p in mod.named_parameters()}
        assert got_grads.keys() == want.keys(), sorted(got_grads.keys() ^ want.keys())[:4]
        for k in want:
            assert_matches_reference(got_grads[k], want[k], want64[k], what=f"{where} grad {k}", scale=scale)
    pipe.close()
    return loss


def test_mcore_moe_logits_equal_braid(pools):
    pool = pools(2)
    assert all(pool.run(_case_logits, True)) and all(pool.run(_case_logits, False))


def test_mcore_moe_ep2_matches_reference(pools):
    """ep=2 on 2 ranks (dp=2, megatron-core's no-pipelining schedule, alltoall over gloo): each rank holds
    2 of the 4 experts of every MoE layer; both replicas report a loss."""
    losses = pools(2).run(_case_pipeline, 1, 2, timeout_s=180)
    assert all(x is not None for x in losses)


def test_mcore_moe_pp2_ep2_matches_reference(pools):
    """pp=2 x ep=2 on 4 ranks: megatron-core's interleaved 1F1B (2 chunks a rank) with its experts split over
    the replicas; megatron-core's rank grid puts PP last (braid's puts DP last): the last stage's two ranks
    report their replica's loss."""
    losses = pools(4).run(_case_pipeline, 2, 2, timeout_s=240)
    assert sum(x is not None for x in losses) == 2


def test_mcore_moe_modes_say_why_not():
    """Graphed (the alltoall dispatcher's host reads), and a2a_overlap where megatron-core refuses it, are one-line reasons."""
    from braid.baselines import megatron_moe as mm
    from braid.baselines.modes import McoreMode
    from braid.models.qwen2 import Qwen2Config

    cfg = _cfg()
    why = lambda mode, **kw: mm.mode_refusal(McoreMode.parse(mode), kw.pop("model", cfg), **{"ep": 2, "dtype": torch.bfloat16,  # noqa: E731
                                                                                           "pp": 1, **kw})
    assert why("graphed") == mm.GRAPH_REFUSAL and why("eager") is None and why("a2a_overlap") is None
    assert "ep > 1" in why("a2a_overlap", ep=1) and "bf16 or fp16" in why("a2a_overlap", dtype=torch.float32)
    assert "no experts" in why("a2a_overlap", model=Qwen2Config(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64))
    assert "CUDA streams" in McoreMode.parse("a2a_overlap").unavailable("cpu")
    assert McoreMode.parse("a2a_overlap").label == "a2a_overlap"


def test_bench_rows_of_a_moe_model():
    """The default megatron-core rows of a MoE bench add the EP overlap; on CPU it and graphed say why not."""
    from types import SimpleNamespace

    from braid.baselines.modes import McoreMode
    from braid.measure.peers import peer_runs_default

    from braid.baselines.megatron_moe import GRAPH_REFUSAL

    for device, ep in (("cpu", 2), ("cuda", 1), ("cuda", 2)):  # ep: ProfileConfig.ep (absent: 1)
        pc = SimpleNamespace(model=_cfg(), tp=1, pp=1, device=device, dtype="bfloat16", **({"ep": ep} if ep > 1 else {}))
        runs = {r.mode.label: r.why for r in peer_runs_default(pc) if r.peer == "mcore"}
        assert list(runs) == ["eager", "graphed", "a2a_overlap"] and runs["eager"] is None
        assert runs["graphed"] == (GRAPH_REFUSAL if device == "cuda" else McoreMode.parse("graphed").unavailable("cpu"))
        assert (runs["a2a_overlap"] is None) == (device == "cuda" and ep == 2), runs["a2a_overlap"]


def _case_overlap_as_eager(ctx):
    """ep=2, bf16 (what megatron-core's EP overlap requires): ``a2a_overlap`` runs the eager step's kernels in
    another order (one micro-batch's forward beside another's backward), so its loss is the eager one's and its
    gradients agree to bf16 rounding."""
    toks, labs = _data(_cfg().vocab_size, ctx.world_size)
    out = []
    for mode in ("eager", "a2a_overlap"):
        pipe, _, _ = _pipe(ctx, 1, 2, "cuda", mode, torch.bfloat16)
        loss = _step(pipe, toks, labs)
        out.append((loss, {k: p.grad.float().cpu() for k, p in pipe.modules[0].named_parameters()}))
        pipe.close()
    (eager, g_eager), (overlap, g_overlap) = out
    assert abs(overlap - eager) <= 1e-6 * abs(eager), (overlap, eager)
    scale = max(float(g.abs().max()) for g in g_eager.values())
    eps = torch.finfo(torch.bfloat16).eps
    for k, g in g_eager.items():
        torch.testing.assert_close(g_overlap[k], g, rtol=4 * eps, atol=4 * eps * scale, msg=k)
    return overlap


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.timeout(GPU_TEST_S)
def test_mcore_moe_ep2_on_cuda_matches_reference(gpu_pools):
    """ep=2 on 2 GPUs over NCCL, float32: loss and every gradient as the single-process model's."""
    assert all(x is not None for x in gpu_pools(2).run(_case_pipeline, 1, 2, "cuda", timeout_s=GPU_RUN_S))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.timeout(GPU_TEST_S)
def test_mcore_moe_a2a_overlap_on_cuda_as_eager(gpu_pools):
    assert all(x is not None for x in gpu_pools(2).run(_case_overlap_as_eager, timeout_s=GPU_RUN_S))
