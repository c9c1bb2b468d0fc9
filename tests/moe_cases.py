"""Cases run inside the gloo processes of ``test_moe_pipeline.py`` (module-level so they pickle by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from executor_cases import EPS, LR, MBS, SEQ, _data, _reference_of, run_dtype
from braid.core.ir import Braided

# heads x head_dim != hidden; layer 1 dense (mlp_only_layers), the others mixtures of 4 experts, top-2
CFG_KW = dict(vocab_size=64, hidden=32, heads=4, kv_heads=2, head_dim=16, ffn=64, experts=4, experts_per_token=2,
              moe_ffn=16, mlp_only_layers=(1,))


def a2a_beside_partner(program, chunks, trace) -> int:
    """Check a measured step: in every braided block, each all-to-all that :func:`braid.core.braiding.steps`
    puts before a unit of the other member has that member's compute between its start (the unit's end)
    and the end of its wait; returns how many were checked."""
    from braid.core.braiding import Comm, steps
    from braid.core.ir import Braided

    checked = 0
    for idx, ins in enumerate(program.instructions):
        if not isinstance(ins, Braided):
            continue
        events = [e for e in trace.events if e.op_index == idx]
        st = steps(ins, lambda ch: chunks[ch].spec)
        for k, s in enumerate(st[:-1]):
            if s.task.comm is not Comm.A2A or st[k + 1].member == s.member:
                continue
            unit = s.task.label.split(":", 1)[1]
            (a2a,) = [e for e in events if e.lane == "ep-comm" and e.name == f"A2A {s.op}" and e.unit == unit]
            other = str(ins.ops[1 - s.member])
            beside = [e for e in events if e.lane == "compute" and e.name == other
                      and a2a.start <= e.start and e.start + e.dur <= a2a.start + a2a.dur]
            assert beside, f"{ins}: the all-to-all of {s.op} {unit} ran with no unit of {other} beside it"
            checked += 1
    return checked


def ep_equivalence(ctx, pp: int, ep: int, schedules_ms: list[tuple[str, int]], cfg_kw: dict | None = None,
                   init_std: float = 0.2, tp: int = 1, compiled: bool = False, dispatch: str = "splits",
                   ep_backend: str = "nccl", seq_shard: bool = False) -> list[str]:
    """Two AdamW steps of each (schedule, m) of a Qwen3-MoE model on ``pp`` pipeline ranks x ``dp``
    data-parallel ranks (the rest of the world over ``tp``), experts sharded over ``ep`` of them, against the
    single-process model trained on every DP rank's micro-batches: the step's mean loss, every
    gradient before the first optimizer step and every parameter after the last, within
    :func:`reference_error.bound` (float64 on CPU, float32 on CUDA against a float64 reference's
    error). ``cfg_kw``: the model's shape instead of :data:`CFG_KW`; ``init_std``: its weights' spread;
    ``compiled``: the distributed model's units call the compiled unit functions (:mod:`braid.runtime.compiled`);
    ``dispatch``: how the rows cross ranks (``--moe-dispatch``: splits or padded); ``ep_backend``: the EP
    group's exchanges (``--ep-backend``; ``nccl-ce`` must then have run every exchange through its staging);
    ``seq_shard``: sequence parallelism inside TP (:mod:`braid.tp.seq_shard`; tp > 1)."""
    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.core.partition import split_layers
    from braid.core.topology import Topology
    from braid.models.build import build_rank_chunks
    from braid.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeModel
    from braid.runtime.executor import Executor
    from braid.runtime.expert_parallel import (
        ExpertGroups, gather_experts, moe_layers, reduce_gradients_ep, shard_experts,
    )

    topo = Topology(ctx.world_size, pp=pp, tp=tp, dp=ctx.world_size // (pp * tp))
    groups = ctx.process_groups(topo)
    key = ("experts", topo, ep, ep_backend)
    if key not in ctx.groups:
        ctx.groups[key] = ExpertGroups.create(topo, ctx.rank, ep, backend=ep_backend)
    experts = ctx.groups[key]
    dev = ctx.dist.device
    c, dtype = groups.coords, run_dtype(dev)
    ran = []
    for name, m in schedules_ms:
        plan = schedules.build(name, pp, m)
        stages = plan.num_stages
        layers = split_layers(2 * stages - 1, stages) if stages > 1 else (3,)
        cfg = Qwen3MoeConfig(layers=sum(layers), **(CFG_KW if cfg_kw is None else cfg_kw))
        model = Qwen3MoeModel(cfg).to(dev).init_weights(seed=7, std=init_std).to(dtype)
        per_rank = [[tuple([t.to(dev) for t in x] for x in _data(cfg, m, seed=s + 10 * r)) for r in range(topo.dp)]
                    for s in range(2)]
        # the reference is the same for every schedule of one model, m and data (computed once per rank process)
        ref = _reference_of(model, [tuple(sum((d[i] for d in step), []) for i in (0, 1)) for step in per_rank],
                            ("qwen3_moe", repr(sorted((CFG_KW if cfg_kw is None else cfg_kw).items())), cfg.layers, init_std,
                             m, dtype, str(dev), topo.dp))

        def shard(whole, with_groups=None):
            chunks = build_rank_chunks(whole, plan, c.pp, layers, tp_rank=c.tp, tp_size=tp, tp_group=groups.tp, seq_shard=seq_shard)
            shard_experts(chunks.values(), experts.ep_rank, ep, with_groups, dispatch)
            return chunks

        where = f"qwen3_moe {name} pp={pp} tp={tp} dp={topo.dp} ep={ep} {dispatch} m={m} rank={ctx.rank}"
        chunks = shard(model, experts)
        assert all(ch.seq_shard == (seq_shard and tp > 1) for ch in chunks.values()), where
        host_free = tp == 1 and dispatch == "padded"  # (the harness gives ep=1 a dispatcher too: a group of one)
        assert all(ch.moe_host_free() == host_free for ch in chunks.values() if ch.spec.moe), where
        if compiled:
            from braid.runtime.compiled import set_compiled

            assert set_compiled(chunks.values(), True) > 0, "no unit of the MoE chunks calls the unit functions"
        params = [p for ch in chunks.values() for p in ch.parameters()]
        opt = torch.optim.AdamW(params, lr=LR, eps=EPS)
        ex = Executor.from_groups(plan, compile_plan(plan)[c.pp], chunks, groups, ctx.dist.abort,
                                  act_shape=(MBS, SEQ // tp if seq_shard else SEQ, cfg.hidden), dtype=dtype, device=dev)
        for step, data in enumerate(per_rank):
            opt.zero_grad(set_to_none=True)
            res = ex.run(*data[c.dp])
            if step == 0 and ep > 1 and any(isinstance(i, Braided) for i in ex.program.instructions):
                assert a2a_beside_partner(ex.program, chunks, res.trace) > 0, where
            reduce_gradients_ep(params, groups, experts, ctx.dist.abort)
            if res.loss is not None and c.tp == 0:  # this rank's mean: the step's is the mean over DP ranks
                loss = torch.as_tensor(res.loss, dtype=dtype, device=dev).clone()  # NCCL reduces device tensors only
                dist.all_reduce(loss, group=groups.dp)
                ref.check_loss(loss / topo.dp, step, where)
            if step == 0:
                ref.check_grads(chunks, shard, where)
            opt.step()
        ref.check_params(chunks, shard, where)
        # what a checkpoint of the run holds: every rank's experts, in order (ordering faults are ~0.1 apart;
        # the parameters themselves were checked within the reference's error above)
        whole = dict(ref.trained.named_parameters())
        gathered = gather_experts(chunks, experts, groups.tp if tp > 1 else None)
        assert len(gathered) == 2 * len(moe_layers(chunks.values())) > 0, where
        tol = 1e-8 if dtype == torch.float64 else 1e-3
        for n, t in gathered.items():
            torch.testing.assert_close(t, whole[n].detach(), rtol=tol, atol=tol, msg=lambda s: f"{where}: gathered {n}: {s}")
        if ep_backend == "nccl-ce":  # the row exchanges went through the staging: one set per size of block
            assert experts.ce is not None and experts.ce.sets, where
        ran.append(f"{name} m={m}")
    return ran



HOST_READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy")  # what a graph cannot replay


def padded_moe_reads_no_host(ctx, tokens: int = 12) -> int:
    """An MoE layer's forward and backward (:func:`braid.models.moe_dispatch.moe_forward`, fp32, ``torch._grouped_mm``)
    through :class:`braid.runtime.expert_parallel.PaddedAllToAllDispatch` over the world (``ep`` = world,
    dp = world) while every host read of a tensor raises; its output, input gradients and expert weight
    gradients equal the single-process layer's on both ranks' tokens within :func:`reference_error.bound`
    of its float64 run; under the same patch :class:`~braid.runtime.expert_parallel.AllToAllDispatch` raises.
    Returns the padding rows this rank received."""
    from unittest import mock

    from braid.core.topology import Topology
    from braid.models.moe import Experts, GroupedLinear, grouped_mm_runs
    from braid.models.moe_dispatch import moe_forward
    from braid.runtime.expert_parallel import ExpertGroups, PaddedAllToAllDispatch
    from reference_error import assert_matches_reference

    ep, r = ctx.world_size, ctx.rank
    topo = Topology(ep, pp=1, tp=1, dp=ep)
    key = ("experts", topo, ep)
    if key not in ctx.groups:
        ctx.groups[key] = ExpertGroups.create(topo, r, ep)
    groups = ctx.groups[key]
    E, k, hidden, ffn = 2 * ep, 2, 32, 16
    torch.manual_seed(3)
    whole = Experts(E, hidden, ffn)
    for lin in (whole.gate_up, whole.down):
        torch.nn.init.normal_(lin.weight, std=0.3)
    data = [(torch.randn(tokens, hidden), torch.randn(tokens, E), torch.randn(tokens, hidden)) for _ in range(ep)]
    kw = dict(top_k=k, norm_topk_prob=True, num_experts=E)

    def reference(dtype):
        ex = Experts(E, hidden, ffn).to(dtype)
        ex.load_state_dict(whole.state_dict())
        grads = []
        for h, logits, probe in data:
            h, logits = (t.detach().to(dtype).requires_grad_() for t in (h, logits))
            out = moe_forward(h, logits, ex, **kw)
            (out * probe.to(dtype)).sum().backward()
            grads.append((out.detach(), h.grad, logits.grad))
        return grads, ex

    (ref, ref_ex), (ref64, ref64_ex) = reference(torch.float32), reference(torch.float64)
    mine = Experts(E, hidden, ffn)
    per = E // ep
    mine.gate_up, mine.down = (GroupedLinear.from_weight(lin.weight[r * per:(r + 1) * per])
                               for lin in (whole.gate_up, whole.down))
    dispatch = PaddedAllToAllDispatch(groups, E, k)
    h, logits, probe = (t.detach().clone() for t in data[r])
    h.requires_grad_(), logits.requires_grad_()
    assert grouped_mm_runs(h, mine.gate_up.weight) and grouped_mm_runs(h.new_empty(1, ffn), mine.down.weight.transpose(1, 2))

    def refuse(name):
        def read(self, *a, **kw):
            raise AssertionError(f"host read: Tensor.{name} on the padded dispatcher's path")
        return read

    with mock.patch.multiple(torch.Tensor, **{n: refuse(n) for n in HOST_READS}):
        out = moe_forward(h, logits, mine, dispatcher=dispatch, **kw)
        (out * probe).sum().backward()
    where = f"padded ep={ep} rank={r}"
    for what, got, want, want64 in zip(("output", "d h", "d logits"), (out, h.grad, logits.grad), ref[r], ref64[r]):
        assert_matches_reference(got, want, want64, what=f"{where}: {what}")
    for name in ("gate_up", "down"):
        got = getattr(mine, name).weight.grad
        want, want64 = (getattr(ex, name).weight.grad[r * per:(r + 1) * per] for ex in (ref_ex, ref64_ex))
        assert_matches_reference(got, want, want64, what=f"{where}: experts.{name} weight gradient")
    # the same patch catches the splits dispatcher's read (both ranks exchange the counts, then raise)
    from braid.runtime.expert_parallel import AllToAllDispatch

    with mock.patch.multiple(torch.Tensor, **{n: refuse(n) for n in HOST_READS}):
        try:
            moe_forward(h.detach(), logits.detach(), mine, dispatcher=AllToAllDispatch(groups, E), **kw)
        except AssertionError as err:
            assert "host read: Tensor.tolist" in str(err), err
        else:
            raise AssertionError("the splits dispatcher ran without a host read: the patch misses it")
    _, chosen = torch.topk(torch.softmax(data[r][1], -1), k)
    plan = dispatch.plan(torch.bincount(chosen.reshape(-1), minlength=E), tokens * k)
    return int((~plan.real).sum())
