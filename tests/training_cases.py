"""Cases run inside the gloo processes of ``test_training.py`` (module-level so they pickle by name).

Each case trains the executor's split model for a few steps and the single-process model
beside it, with the same weights, data, AdamW settings, learning-rate schedule, weight
decay and clipping; it returns nothing and raises on the first difference.
"""

from __future__ import annotations

import copy

import torch

from reference_error import adamw_amplify, adamw_cap, assert_matches_reference, loss_amplify

CFG_KW = dict(vocab_size=64, hidden=32, heads=4, kv_heads=2, ffn=64)
MBS, SEQ = 2, 8
LR, EPS = 1e-2, 1e-4  # a larger epsilon keeps AdamW from amplifying rounding noise of near-zero gradients
STEPS = 3


def _steps_data(cfg, n_micro: int, steps: int, seed: int = 7) -> list[tuple[list, list]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        toks = [torch.randint(0, cfg.vocab_size, (MBS, SEQ), generator=g) for _ in range(n_micro)]
        labs = [torch.randint(0, cfg.vocab_size, (MBS, SEQ), generator=g) for _ in range(n_micro)]
        out.append((toks, labs))
    return out


def _reference(model, data, *, weight_decay: float, clip: float | None, warmup: int, decay: str, grad_mult: float = 1.0):
    """The unsplit model: per step losses, pre-clip gradient norms, the trained model and the
    first step's gradients; and the same in float64 when ``model`` is not (its error is what
    :func:`reference_error.bound` allows: the training runs keep float32 master weights)."""
    out = _reference_run(model, data, weight_decay=weight_decay, clip=clip, warmup=warmup, decay=decay, grad_mult=grad_mult)
    if next(model.parameters()).dtype == torch.float64:
        return out, None
    return out, _reference_run(copy.deepcopy(model).double(), data, weight_decay=weight_decay, clip=clip, warmup=warmup,
                               decay=decay, grad_mult=grad_mult)


def _reference_run(model, data, *, weight_decay: float, clip: float | None, warmup: int, decay: str, grad_mult: float):
    from braid.training.grads import param_groups
    from braid.training.lr import build_scheduler

    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(param_groups(ref.parameters(), weight_decay), lr=LR, eps=EPS)
    sched = build_scheduler(opt, total=STEPS, warmup=warmup, decay=decay, lr=LR, min_lr=LR / 10)
    losses, norms, grads = [], [], None
    for toks, labs in data:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for t, lab in zip(toks, labs):
            loss = ref(t, lab) / len(toks)
            (loss * grad_mult).backward()
            total += loss.item()
        if grads is None:
            grads = [p.grad.detach().clone() for p in ref.parameters()]
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip is not None else float("inf"))
        opt.step()
        sched.step()
        losses.append(total)
        norms.append(float(norm))
    return ref, losses, norms, grads


def _setup(ctx, pp: int, tp: int, schedule: str):
    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.core.partition import split_layers
    from braid.runtime.executor import Executor
    from braid.models.build import build_rank_chunks
    from braid.core.topology import Topology

    topo = Topology(ctx.world_size, pp=pp, tp=tp, dp=ctx.world_size // (pp * tp))
    groups = ctx.process_groups(topo)
    c = groups.coords
    m = 2 * pp
    plan = schedules.build(schedule, pp, m)
    stages = plan.num_stages
    layers = split_layers(2 * stages - 1, stages) if stages > 1 else (2,)
    cfg = Qwen2Config(layers=sum(layers), **CFG_KW)
    torch.manual_seed(1234)
    model = Qwen2Model(cfg)
    data = _steps_data(cfg, topo.dp * m, STEPS)
    chunks = build_rank_chunks(model, plan, c.pp, layers, tp_rank=c.tp, tp_size=tp, tp_group=groups.tp)
    ex = Executor.from_groups(plan, compile_plan(plan)[c.pp], chunks, groups, ctx.dist.abort, act_shape=(MBS, SEQ, cfg.hidden))
    mine = [(toks[c.dp * m:(c.dp + 1) * m], labs[c.dp * m:(c.dp + 1) * m]) for toks, labs in data]  # replica r: r*m .. r*m+m-1
    return topo, groups, plan, layers, model, data, chunks, ex, mine


def _named(chunks, c) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters keyed uniquely per (pp, tp) rank and identically over data-parallel replicas."""
    return [(f"pp{c.pp}.tp{c.tp}.{ci}.{n}", p) for ci, ch in chunks.items() for n, p in ch.named_parameters()]


def _expect_params(chunks, ref, ref64, plan, layers, c, tp: int, where: str) -> None:
    """The parameters after STEPS AdamW steps, within :func:`reference_error.bound` of the reference's."""
    from braid.models.build import build_rank_chunks

    trained, grads = ref[0], ref[3]
    final = build_rank_chunks(trained, plan, c.pp, layers, tp_rank=c.tp, tp_size=tp)
    final64 = None if ref64 is None else build_rank_chunks(ref64[0], plan, c.pp, layers, tp_rank=c.tp, tp_size=tp)
    scale = max(float(p.detach().abs().max()) for p in trained.parameters())
    g_max = max(float(g.abs().max()) for g in grads)  # clipping only shrinks later gradients
    amp, cap = adamw_amplify(g_max, lr=LR, eps=EPS, steps=STEPS), adamw_cap(lr=LR, steps=STEPS)
    for ci, ch in chunks.items():
        want = dict(final[ci].named_parameters())
        want64 = {} if final64 is None else dict(final64[ci].named_parameters())
        for n, p in ch.named_parameters():
            assert_matches_reference(p, want[n], want64.get(n), what=f"{where} param {ci}.{n}", scale=scale, amplify=amp, cap=cap)


def optimizer_matches_reference(ctx, pp: int, tp: int, schedule: str, mode: str, clip: float | None,
                                weight_decay: float, warmup: int, decay: str) -> list[float]:
    """``mode``: "zero1" (sharded fp32 masters), "master" (fp32 masters, not sharded) or "plain"
    (torch AdamW on the parameters after the data-parallel all-reduce). Returns the norms."""
    from braid.training.step import OptimConfig, Optimization

    topo, groups, plan, layers, model, data, chunks, ex, mine = _setup(ctx, pp, tp, schedule)
    c = groups.coords
    ref, ref64 = _reference(model, data, weight_decay=weight_decay, clip=clip, warmup=warmup, decay=decay)
    ref_losses, ref_norms, ref_grads = ref[1], ref[2], ref[3]
    cfg = OptimConfig(lr=LR, eps=EPS, total_steps=STEPS, warmup=warmup, decay=decay, min_lr=LR / 10, weight_decay=weight_decay,
                      clip=clip, master_fp32=mode == "master", zero1=mode == "zero1")
    opt = Optimization(cfg, _named(chunks, c), chunks.values(), groups=groups, abort=ctx.dist.abort)
    assert opt.sharded == (mode != "plain")
    where = f"{schedule} pp={pp} tp={tp} dp={topo.dp} {mode} rank={ctx.rank}"
    norms = []
    for step, (toks, labs) in enumerate(mine):
        opt.zero_grad()
        res = ex.run(toks, labs)
        norm = opt.step()
        norms.append(norm)
        # A scalar after ``step`` AdamW steps: first-order drift as for the loss (reference_error.loss_amplify).
        amp = loss_amplify(ref_grads, lr=LR, eps=EPS, steps=step)
        assert_matches_reference(torch.tensor(norm, dtype=torch.float32), torch.tensor(ref_norms[step], dtype=torch.float32),
                                 None if ref64 is None else ref64[2][step], what=f"{where} step {step} norm", amplify=amp)
        if res.loss is not None and topo.dp == 1:
            assert_matches_reference(torch.tensor(res.loss, dtype=torch.float32), torch.tensor(ref_losses[step], dtype=torch.float32),
                                     None if ref64 is None else ref64[1][step], what=f"{where} step {step} loss", amplify=amp)
    assert abs(opt.lr - _final_lr(decay)) <= 1e-12, where
    _expect_params(chunks, ref, ref64, plan, layers, c, tp, where)
    opt.close()
    return norms


def _final_lr(decay: str) -> float:
    """The learning rate after STEPS steps (the floor, or the peak without decay)."""
    return LR if decay == "constant" else LR / 10


def state_dict_resumes(ctx, pp: int, tp: int, schedule: str, path: str) -> None:
    """Save the sharded optimizer with ``torch.distributed.checkpoint`` after step 2, load it into an
    unsharded one (another layout of the optimizer state), run step 3: the same parameters. Small
    all-gather buckets, so the weights and the state are gathered in many pieces."""
    import torch.distributed.checkpoint as dcp

    from braid.training.grads import tp_norm_mask
    from braid.training.optimizer import ShardedAdamW

    import braid.training.optimizer as optimizer_module

    optimizer_module.BUCKET, bucket = 37, optimizer_module.BUCKET  # many odd-sized all-gather buckets
    topo, groups, plan, layers, model, data, chunks, ex, mine = _setup(ctx, pp, tp, schedule)
    c = groups.coords
    named = _named(chunks, c)
    params = [p for _, p in named]
    counted = tp_norm_mask(params, chunks.values(), c.tp)

    def make(shard: bool) -> ShardedAdamW:
        return ShardedAdamW(named, lr=LR, eps=EPS, weight_decay=0.1, group=groups.dp_cp, shard=shard, grad_scale=1 / topo.dp,
                            counted=counted, wait=ctx.dist.abort.wait)

    def step(opt, i: int) -> None:
        opt.zero_grad()
        ex.run(*mine[i])
        opt.step(max_norm=1.0)

    opt = make(True)
    for i in range(2):
        step(opt, i)
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=path)
    step(opt, 2)
    after = [p.detach().clone() for p in params]
    opt.remove_hooks()
    with torch.no_grad():
        for p in params:
            p.normal_()  # the checkpoint must restore the weights from the masters
    other = make(False)
    sd = {"optim": other.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    other.load_state_dict(sd["optim"])
    assert float(sd["optim"]["step"]) == 2.0
    step(other, 2)
    for (n, p), want in zip(named, after):
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7, msg=lambda s: f"rank {ctx.rank} {n}: {s}")
    other.remove_hooks()
    optimizer_module.BUCKET = bucket


def nonfinite_norm_skips_update(ctx) -> None:
    """An inf gradient: every rank gets an inf norm and no parameter changes."""
    from braid.training.optimizer import ShardedAdamW

    topo, groups, plan, layers, model, data, chunks, ex, mine = _setup(ctx, 1, 1, "1f1b")
    named = _named(chunks, groups.coords)
    opt = ShardedAdamW(named, lr=LR, group=groups.dp_cp, grad_scale=1 / topo.dp, wait=ctx.dist.abort.wait)
    before = [p.detach().clone() for _, p in named]
    opt.zero_grad()
    ex.run(*mine[0])
    if ctx.rank == 0:
        named[0][1].main_grad.view(-1)[0] = float("inf")
    norm = opt.step(max_norm=1.0)
    assert norm == float("inf"), norm
    for (n, p), b in zip(named, before):
        assert torch.equal(p.detach(), b), f"{n} changed although the norm was inf"
    opt.remove_hooks()
