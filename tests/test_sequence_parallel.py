"""Sequence parallelism (LoongTrain 2D-Attention inside the model) against the single-process model.

Real gloo processes, started once per world size (2 and 4): every case runs a Qwen2 model
whose sequence is split over d_sp = d_hp x d_cp ranks (zigzag) under a pipeline schedule,
two AdamW steps, and compares the summed loss, every gradient and every parameter after
the steps with the single-device reference (float64, within ``reference_error.bound``). Some labels are
``-100``, unevenly over the ranks, so the global loss normalisation is exercised. Invalid
degrees are rejected with one clear error each, at model-build time.
"""

from __future__ import annotations

import pytest
import torch

import executor_cases as ex_cases
from conftest import GPU_RUN_S, GPU_TEST_S
from distributed_utils import SHARED_POOL

SEQ = 16


def _data(cfg, m: int, seed: int):
    g = torch.Generator().manual_seed(seed + 99)
    toks = [torch.randint(0, cfg.vocab_size, (ex_cases.MBS, SEQ), generator=g) for _ in range(m)]
    labs = [torch.randint(0, cfg.vocab_size, (ex_cases.MBS, SEQ), generator=g) for _ in range(m)]
    for lab in labs:  # prompt-like positions without a target: counts differ per SP rank
        lab[0, : SEQ // 2 - 1] = -100
    return toks, labs


def _sp_context(ctx, topo, d_hp: int, w: int | None, placement: str):
    """This rank's SP context, built once per (topology, degrees) and process."""
    from braid.attention import GroupPool
    from braid.models.sequence_parallel import SequenceParallel, SPConfig

    groups = ctx.process_groups(topo)
    pool = ctx.groups.setdefault(SHARED_POOL, GroupPool())
    key = ("sp", topo, d_hp, w, placement)
    if key not in ctx.groups:
        ctx.groups[key] = SequenceParallel.create(SPConfig(topo.cp, d_hp, w, placement), groups, pool)
    return groups, ctx.groups[key]


def sp_equivalence(ctx, pp: int, tp: int, sp_cases: list[tuple[int, int | None, str]],
                   schedules_ms: list[tuple[str, int]]) -> list[tuple]:
    """Each (d_hp, w, placement) x (schedule, m): two AdamW steps equal the single-process model."""
    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.core.partition import split_layers
    from braid.runtime.distributed import reduce_gradients
    from braid.runtime.executor import Executor
    from braid.models.build import build_rank_chunks
    from braid.core.topology import Topology

    d_sp = ctx.world_size // (pp * tp)
    topo = Topology(ctx.world_size, pp=pp, tp=tp, cp=d_sp)
    ran = []
    for d_hp, w, placement in sp_cases:
        groups, sp = _sp_context(ctx, topo, d_hp, w, placement)
        c = groups.coords
        for name, m in schedules_ms:
            plan = schedules.build(name, pp, m)
            stages = plan.num_stages
            layers = split_layers(stages + 1, stages) if stages > 1 else (2,)
            cfg = Qwen2Config(layers=sum(layers), **ex_cases.CFG_KW)
            torch.manual_seed(4321)
            dtype = ex_cases.run_dtype(ctx.dist.device)
            model = Qwen2Model(cfg).to(dtype)
            steps_data = [_data(cfg, m, seed=s) for s in range(2)]
            ref = ex_cases.Reference.run(model, steps_data)
            chunks = build_rank_chunks(model, plan, c.pp, layers, tp_rank=c.tp, tp_size=tp, tp_group=groups.tp,
                                       sp=sp, seq_len=SEQ)
            shard = lambda whole: build_rank_chunks(whole, plan, c.pp, layers, tp_rank=c.tp, tp_size=tp)  # noqa: E731
            params = [p for ch in chunks.values() for p in ch.parameters()]
            opt = torch.optim.AdamW(params, lr=ex_cases.LR, eps=ex_cases.EPS)
            ex = Executor.from_groups(plan, compile_plan(plan)[c.pp], chunks, groups, ctx.dist.abort,
                                      act_shape=(ex_cases.MBS, sp.local_len(SEQ), cfg.hidden), dtype=dtype)
            where = f"{name} m={m} pp={pp} tp={tp} sp={d_sp} (hp={d_hp}, w={w}, {placement}) rank={ctx.rank}"
            losses = []
            for step, (toks, labs) in enumerate(steps_data):
                opt.zero_grad(set_to_none=True)
                res = ex.run(toks, labs)
                reduce_gradients(params, groups, ctx.dist.abort)
                losses.append(res.loss)
                if res.loss is not None:
                    ref.check_loss(res.loss, step, where)
                if step == 0:
                    ref.check_grads(chunks, shard, where)
                opt.step()
            ref.check_params(chunks, shard, where)
            ran.append((d_hp, w, placement, name, m, losses, res.counts["braided"]))
    return ran


def build_errors(ctx) -> list[str]:
    """Degrees that do not fit the model, the sequence or the topology, at build time (4 ranks, cp=4)."""
    from braid import schedules
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.models.sequence_parallel import SequenceParallel, SPConfig
    from braid.models.build import build_rank_chunks
    from braid.core.topology import Topology

    topo = Topology(ctx.world_size, pp=1, cp=4)
    groups, sp = _sp_context(ctx, topo, 4, None, "head_first")  # d_hp=4, d_cp=1
    plan = schedules.build("1f1b", 1, 2)
    msgs = []
    # 6 query heads cannot be split over d_hp=4; a 10-token sequence not over d_sp=4.
    for kw, seq in ((dict(hidden=48, heads=6, kv_heads=2), SEQ), (dict(hidden=32, heads=4, kv_heads=2), 10)):
        cfg = Qwen2Config(layers=2, vocab_size=64, ffn=64, **kw)
        try:
            build_rank_chunks(Qwen2Model(cfg), plan, 0, (2,), sp=sp, seq_len=seq)
            msgs.append("no error")
        except ValueError as err:
            msgs.append(str(err))
    try:
        SequenceParallel.create(SPConfig(2, 1), groups)
        msgs.append("no error")
    except ValueError as err:
        msgs.append(str(err))
    return msgs


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def bf16_accuracy(ctx, d_hp: int, seq: int = 512) -> dict[str, float]:
    """bf16 SP run (cp = world) vs an fp32 reference, relative to a bf16 single-device run; step 1.

    Returns, per gradient and for the loss, ``err(SP) - 2 * err(single-device bf16)``, the
    quantity that must stay under a small floor (as ``test_attention2d_gpu`` does).
    """
    import copy

    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.runtime.distributed import reduce_gradients
    from braid.runtime.executor import Executor
    from braid.models.build import build_rank_chunks
    from braid.core.topology import Topology

    dev = ctx.dist.device
    topo = Topology(ctx.world_size, pp=1, cp=ctx.world_size)
    groups, sp = _sp_context(ctx, topo, d_hp, None, "head_first")
    cfg = Qwen2Config(vocab_size=512, hidden=512, layers=2, heads=8, kv_heads=2, ffn=1024)
    torch.manual_seed(7)
    model = Qwen2Model(cfg).to(dev)
    model.reset_parameters(std=0.05)
    g = torch.Generator().manual_seed(8)
    toks = [torch.randint(0, cfg.vocab_size, (1, seq), generator=g).to(dev) for _ in range(2)]
    labs = [torch.randint(0, cfg.vocab_size, (1, seq), generator=g).to(dev) for _ in range(2)]
    _, (loss32,), grads32 = ex_cases._reference(model, [(toks, labs)])
    low = copy.deepcopy(model).to(torch.bfloat16)
    _, (loss16,), grads16 = ex_cases._reference(low, [(toks, labs)])
    plan = schedules.build("1f1b", 1, 2)
    chunks = build_rank_chunks(low, plan, 0, (2,), sp=sp, seq_len=seq)
    ex = Executor.from_groups(plan, compile_plan(plan)[0], chunks, groups, ctx.dist.abort,
                              act_shape=(1, sp.local_len(seq), cfg.hidden), dtype=torch.bfloat16, device=dev,
                              compile=False)  # eager: a cold compile cache costs minutes on a fresh GPU machine
    res = ex.run(toks, labs)
    params = [p for p in chunks[0].parameters()]
    reduce_gradients(params, groups, ctx.dist.abort)
    want32 = dict(build_rank_chunks(ex_cases._as_model(model, grads32), plan, 0, (2,))[0].named_parameters())
    want16 = dict(build_rank_chunks(ex_cases._as_model(model, grads16), plan, 0, (2,))[0].named_parameters())
    out = {"loss": abs(res.loss - loss32) / abs(loss32) - 2 * abs(loss16 - loss32) / abs(loss32)}
    for n, p in chunks[0].named_parameters():
        out[n] = _rel_err(p.grad, want32[n]) - 2 * _rel_err(want16[n], want32[n])
    return out


@pytest.mark.slow
def test_sp2_matches_reference(pools) -> None:
    ran = pools(2).run(sp_equivalence, 1, 1, [(2, None, "head_first"), (1, None, "head_first")],
                       [("1f1b", 2)], timeout_s=300)
    assert [r[:5] for r in ran[0]] == [(2, None, "head_first", "1f1b", 2), (1, None, "head_first", "1f1b", 2)]
    # Every SP rank holds the last stage and reports the same, summed loss.
    assert [r[5] for r in ran[0]] == [r[5] for r in ran[1]]


@pytest.mark.slow
def test_sp4_and_pp2_sp2_and_tp2_sp2_match_reference(pools) -> None:
    pool = pools(4)
    sp4 = [(2, None, "head_first"), (2, None, "context_first"), (1, 2, "head_first")]
    ran = pool.run(sp_equivalence, 1, 1, sp4, [("1f1b", 2)], timeout_s=300)
    assert [r[:3] for r in ran[0]] == sp4
    ran = pool.run(sp_equivalence, 2, 1, [(2, None, "head_first"), (1, None, "context_first")],
                   [("1f1b", 4), ("braided_v", 4)], timeout_s=300)
    for rank_ran in ran:
        assert {r[3] for r in rank_ran} == {"1f1b", "braided_v"}
        assert all(r[6] > 0 for r in rank_ran if r[3] == "braided_v"), "braided blocks were not executed"
    ran = pool.run(sp_equivalence, 1, 2, [(2, None, "head_first")], [("1f1b", 2)], timeout_s=300)
    assert len(ran[0]) == 1


@pytest.mark.slow
def test_invalid_degrees_fail_at_build_time(pools) -> None:
    heads, seq, topo = pools(4).run(build_errors)[0]
    assert "d_hp=4 must divide the 6 query heads" in heads, heads
    assert "sequence length 10 must be divisible by d_sp = 4" in seq, seq
    assert "d_sp=2 but the topology has cp=4" in topo, topo


def test_invalid_sp_configs_are_clear_errors() -> None:
    from braid.models.sequence_parallel import SequenceParallelError, SPConfig

    cases = [
        (dict(d_sp=4, d_hp=3), "d_hp=3 must divide the sequence-parallel size d_sp=4"),
        (dict(d_sp=6, d_hp=2, w=2), "inner ring size w=2 must divide d_cp=3"),
        (dict(d_sp=2, d_hp=1, placement="ring_first"), "placement 'ring_first' must be one of head_first, context_first"),
        (dict(d_sp=0), "positive integers"),
    ]
    for kw, text in cases:
        with pytest.raises(SequenceParallelError, match=text.replace("(", r"\(")):
            SPConfig(**kw)
    cfg = SPConfig(d_sp=8, d_hp=4, w=1)
    cfg.check_model(heads=8, kv_heads=2, seq_len=32)  # KV heads replicated 2x, 32 tokens over 2*d_cp=4 chunks
    with pytest.raises(SequenceParallelError, match="d_hp=4 exceeds the 3 key/value heads"):
        SPConfig(d_sp=4, d_hp=4).check_model(heads=12, kv_heads=3)
    with pytest.raises(SequenceParallelError, match="divisible by 2\\*d_cp = 4"):
        cfg.check_model(heads=8, kv_heads=2, seq_len=34)
    with pytest.raises(SequenceParallelError, match="2 query / 1 KV heads per TP rank.*d_hp=4 must divide the 2 query heads"):
        cfg.check_model(heads=8, kv_heads=4, tp=4)
    SPConfig().check_model(heads=3, kv_heads=1, seq_len=7)  # no SP: nothing to check


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.timeout(GPU_TEST_S)
@pytest.mark.parametrize("d_hp", [2, 1], ids=["hp2", "cp2"])
def test_two_gpus_bf16_sp_is_as_accurate_as_one_gpu(gpu_pools, d_hp: int) -> None:
    excess = gpu_pools(2).run(bf16_accuracy, d_hp, timeout_s=GPU_RUN_S)[0]
    worst = max(excess, key=excess.get)
    assert excess[worst] <= 2e-3, f"{worst}: SP error exceeds twice the single-GPU bf16 error by {excess[worst]:.2e}"
