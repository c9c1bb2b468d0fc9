"""Cases for whole-step CUDA graphs (:mod:`braid.runtime.graphs`), run inside the ranks of a
:class:`distributed_utils.DistPool` (module-level so they pickle by name); used by
``tests/test_graphs_gpu.py`` and ``benchmarks/graph_smoke.py``.

:func:`graphed_matches_eager` trains two copies of one model side by side on this rank --
one through the eager executor, one through a :class:`~braid.runtime.graphs.GraphedStep`
-- with new micro-batches every step, and compares the loss, every gradient and (after
AdamW) every parameter bitwise, naming the step, what the graphed step did there (eager
warm-up, capture, replay) and the first tensor that differs.
"""

from __future__ import annotations

import torch

from executor_cases import CFG_KW, EPS, LR, MBS, SEQ, _data


def _build(ctx, plan, pp: int, tp: int, layers, compile: bool | None, seed: int = 1234, seq_shard: bool = False,
           cp: int = 1, recompute: str = "none"):
    from braid.core.compiler import compile_plan
    from braid.core.topology import Topology
    from braid.models.build import build_rank_chunks
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.models.sequence_parallel import SequenceParallel, SPConfig
    from braid.runtime.executor import Executor

    topo = Topology(ctx.world_size, pp=pp, tp=tp, cp=cp)
    groups = ctx.process_groups(topo)
    sp = None
    if cp > 1:  # 2D-Attention over the cp ranks (one ring), built once per process like the groups
        key = ("sp", topo)
        if key not in ctx.groups:
            ctx.groups[key] = SequenceParallel.create(SPConfig(cp, 1), groups)
        sp = ctx.groups[key]
    c = groups.coords
    cfg = Qwen2Config(layers=int(sum(layers)), **CFG_KW)
    torch.manual_seed(seed)
    # 2D-Attention's CUDA block kernels (cuDNN, flash) take bf16/fp16 only
    dtype = torch.bfloat16 if cp > 1 and torch.device(ctx.dist.device).type == "cuda" else torch.float32
    model = Qwen2Model(cfg).to(ctx.dist.device, dtype)
    chunks = build_rank_chunks(model, plan, c.pp, layers, tp_rank=c.tp, tp_size=tp, tp_group=groups.tp, sp=sp, seq_len=SEQ,
                               seq_shard=seq_shard)
    for ch in chunks.values():
        ch.set_recompute(recompute)
    local = SEQ if sp is None else sp.local_len(SEQ)
    local = local // tp if seq_shard and tp > 1 else local
    ex = Executor.from_groups(plan, compile_plan(plan)[c.pp], chunks, groups, ctx.dist.abort, act_shape=(MBS, local, cfg.hidden),
                              device=ctx.dist.device, dtype=dtype, compile=compile, record="off")
    return cfg, chunks, ex


def _first_difference(a: dict, b: dict) -> str | None:
    for name, x in a.items():
        y = b[name]
        if (x is None) != (y is None):
            return f"{name}: eager {'None' if x is None else 'a tensor'}, graphed {'None' if y is None else 'a tensor'}"
        if x is not None and not torch.equal(x, y):
            return f"{name}: max |diff| {(x.float() - y.float()).abs().max().item():.3e} (of max |x| {x.float().abs().max().item():.3e})"
    return None


def _check_step(at: str, res_e, res_g, eager: tuple[dict, torch.optim.Optimizer], graphed: tuple[dict, torch.optim.Optimizer]) -> None:
    """One step of the eager and the graphed copy: the same loss and gradients, then (after each copy's
    optimizer step) the same parameters, bitwise; ``at`` names the step in the message."""
    (params_e, opt_e), (params_g, opt_g) = eager, graphed
    le, lg = res_e.loss_tensor, res_g.loss_tensor
    assert (le is None) == (lg is None), f"{at}: loss on one side only"
    if le is not None:
        assert torch.equal(le, lg), f"{at}: loss eager {le.item()!r} graphed {lg.item()!r}"
    diff = _first_difference({k: p.grad for k, p in params_e.items()}, {k: p.grad for k, p in params_g.items()})
    assert diff is None, f"{at}: gradient {diff}"
    opt_e.step()
    opt_g.step()
    diff = _first_difference({k: p.detach() for k, p in params_e.items()}, {k: p.detach() for k, p in params_g.items()})
    assert diff is None, f"{at}: parameter after AdamW {diff}"


def graphed_matches_eager(ctx, pp: int, tp: int, runs: list[tuple[str, int, dict]], replays: int = 3,
                          compile: bool | None = False, stage_layers: dict[int, tuple[float, ...]] | None = None,
                          seq_shard: bool = False, cp: int = 1, recompute: str = "none") -> list[dict]:
    """For each (schedule, m, schedule options): eager and graphed training from the same weights,
    ``WARMUP_STEPS + 1 + replays`` steps of different micro-batches, compared bitwise every step.
    ``stage_layers``: the layout per number of virtual stages (half layers allowed) instead of the default;
    ``seq_shard``: sequence parallelism inside TP (:mod:`braid.tp.seq_shard`); ``cp``: 2D-Attention over ``cp`` ranks;
    ``recompute``: the chunks' recomputation (:meth:`braid.models.chunk.ModelChunk.set_recompute`).

    Returns per run what the graphed step reported (its step-by-step events and memory figures)."""
    from braid import schedules
    from braid.core.partition import split_layers
    from braid.runtime.graphs import WARMUP_STEPS, GraphedStep

    out = []
    for name, m, opts in runs:
        plan = schedules.build(name, pp, m, **opts)
        stages = plan.num_stages
        layers = split_layers(2 * stages - 1, stages) if stages > 1 else (2,)
        if stage_layers is not None:
            layers = stage_layers[stages]
        cfg, chunks_e, ex_e = _build(ctx, plan, pp, tp, layers, compile, seq_shard=seq_shard, cp=cp, recompute=recompute)
        _, chunks_g, ex_g = _build(ctx, plan, pp, tp, layers, compile, seq_shard=seq_shard, cp=cp, recompute=recompute)
        runner = GraphedStep(ex_g)
        params_e = {f"{c}.{n}": p for c, ch in chunks_e.items() for n, p in ch.named_parameters()}
        params_g = {f"{c}.{n}": p for c, ch in chunks_g.items() for n, p in ch.named_parameters()}
        opt_e = torch.optim.AdamW(params_e.values(), lr=LR, eps=EPS)
        opt_g = torch.optim.AdamW(params_g.values(), lr=LR, eps=EPS)
        dev = ctx.dist.device
        where = f"rank {ctx.rank} {name} m={m} {opts or ''} pp={pp} tp={tp} cp={cp} recompute={recompute} compile={ex_g.compiled}"
        for step in range(WARMUP_STEPS + 1 + replays):
            toks, labs = (list(t.to(dev) for t in x) for x in _data(cfg, m, seed=100 + step))
            opt_e.zero_grad(set_to_none=True)
            opt_g.zero_grad(set_to_none=True)
            res_e = ex_e.run(toks, labs)
            res_g = runner.run(toks, labs)
            at = f"{where} step {step} ({runner.events[-1] if runner.events else 'nothing'})"
            assert res_g.counts == res_e.counts, f"{at}: counts eager {res_e.counts} graphed {res_g.counts}"
            _check_step(at, res_e, res_g, (params_e, opt_e), (params_g, opt_g))
        assert runner.captured, f"{where}: never captured ({runner.events})"
        try:  # another micro-batch count is refused before anything is launched
            runner.run(toks[:-1], labs[:-1])
            raise AssertionError(f"{where}: a step with {m - 1} micro-batches was replayed on a graph captured for {m}")
        except ValueError as err:
            assert "captured for" in str(err), f"{where}: {err}"
        out.append({"run": f"{name} m={m} {opts or ''}".strip(), "events": list(runner.events), **runner.memory(),
                    "capture_s": runner.capture_s,
                    "param_bytes": sum(p.numel() * p.element_size() for p in params_g.values() if p.requires_grad)})
        runner.release()
        del runner, ex_g, ex_e, chunks_e, chunks_g, opt_e, opt_g
        torch.cuda.empty_cache()
    return out


def vlm_graphed_matches_eager(ctx, schedule: str, pp: int, tp: int, m: int, kind: str) -> list[str]:
    """A tiny Qwen2-VL (``kind``) trained eager and graphed side by side, compared bitwise every step: the
    vision tower, the merge unit and the M-RoPE chunks captured. After the first replays the images move
    in the text (another batch key, the same tensor shapes): the step is captured again. Returns the events."""
    from test_vlm import MB_SIZE, SEQ, _microbatches

    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.core.topology import Topology
    from braid.models.qwen2_vl import Qwen2VLModel, vlm_preset, vlm_stage_layers
    from braid.models.vision_chunk import build_vlm_rank_chunks
    from braid.runtime.executor import Executor
    from braid.runtime.graphs import WARMUP_STEPS, GraphedStep

    dev = ctx.dist.device
    groups = ctx.process_groups(Topology(ctx.world_size, pp=pp, tp=tp))
    c = groups.coords
    cfg = vlm_preset("tiny", kind=kind)
    plan = schedules.build(schedule, pp, m)
    layers = vlm_stage_layers(cfg, plan.num_stages, last_stage_lighter=1)

    def build():
        torch.manual_seed(7)
        model = Qwen2VLModel(cfg).to(dev)
        chunks = build_vlm_rank_chunks(model, plan, c.pp, layers, tp_rank=c.tp, tp_size=tp, tp_group=groups.tp if tp > 1 else None)
        ex = Executor.from_groups(plan, compile_plan(plan)[c.pp], chunks, groups, ctx.dist.abort,
                                  act_shape=(MB_SIZE, SEQ, cfg.lm.hidden), device=dev, compile=False, record="off")
        params = {f"{k}.{n}": p for k, ch in chunks.items() for n, p in ch.named_parameters()}
        return ex, params, torch.optim.AdamW(params.values(), lr=LR, eps=EPS)

    ex_e, params_e, opt_e = build()
    ex_g, params_g, opt_g = build()
    runner = GraphedStep(ex_g)
    where = f"rank {ctx.rank} {kind} {schedule} m={m} pp={pp} tp={tp}"
    steps = WARMUP_STEPS + 3
    for step in range(steps + 2):
        lead = 1 if step < steps else 3  # the last two steps: images further into the text (a new key)
        mbs = _microbatches(cfg, m, seed=100 + step, lead=lead)
        toks = [tuple(t.to(dev) for t in item) for item, _ in mbs]
        labs = [lab.to(dev) for _, lab in mbs]
        opt_e.zero_grad(set_to_none=True)
        opt_g.zero_grad(set_to_none=True)
        res_e, res_g = ex_e.run(toks, labs), runner.run(toks, labs)
        _check_step(f"{where} step {step} ({runner.events[-1] if runner.events else 'nothing'})", res_e, res_g,
                    (params_e, opt_e), (params_g, opt_g))
    events = list(runner.events)
    assert runner.captures == 2, f"{where}: {runner.captures} captures ({events})"
    runner.release()
    return events


def smoke(ctx, case: str) -> list[str]:
    """One named case of ``benchmarks/graph_smoke.py``, as printable lines (raises on a mismatch)."""
    _, pp, tp, runs, compile = SMOKE_CASES[case]
    got = graphed_matches_eager(ctx, pp, tp, runs, compile=compile, cp=SMOKE_CP.get(case, 1))
    lines = []
    for r in got:
        mib = lambda b: "?" if b is None else f"{b / 2**20:.1f} MiB"  # noqa: E731
        lines.append(f"  rank {ctx.rank} {r['run']}: replay == eager bitwise; capture peak {mib(r['capture_peak_bytes'])}, "
                     f"pool {mib(r['graph_pool_bytes'])}, capture {r['capture_s']:.2f} s")
        lines += [f"    {e}" for e in r["events"]]
    return lines


# name -> (what it adds, pp, tp, [(schedule, m, options)], compile); simplest first.
SMOKE_CASES: dict[str, tuple[str, int, int, list[tuple[str, int, dict]], bool | None]] = {
    "p2p": ("pp=2 1f1b: batched Send/Recv only", 2, 1, [("1f1b", 4, {})], False),
    "pp2": ("pp=2 braided_v, zb_v, dualpipe_v", 2, 1, [("braided_v", 5, {}), ("zb_v", 5, {}), ("dualpipe_v", 5, {})], False),
    "offload": ("pp=2 braided_v with offload: D2H/H2D copy streams", 2, 1,
                [("braided_v_offload", 5, {"offload_alpha": 0.5, "offload_alpha_warmup": 0.5})], False),
    "tp2": ("tp=2 braided_v, zb_v, dualpipe_v: async and carried all-reduces", 1, 2,
            [("braided_v", 3, {}), ("zb_v", 3, {}), ("dualpipe_v", 3, {})], False),
    "compiled": ("tp=2 braided_v with torch.compile'd units", 1, 2, [("braided_v", 3, {})], None),
    "cp2": ("cp=2 (2D-Attention: the ring's P2P, the loss over the SP group; bf16) 1f1b and braided_v", 1, 1,
            [("1f1b", 3, {}), ("braided_v", 3, {})], False),
}
SMOKE_CP = {"cp2": 2}  # cases run with 2D-Attention over this many ranks
