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


def _build(ctx, plan, pp: int, tp: int, layers, compile: bool | None, seed: int = 1234, seq_shard: bool = False):
    from braid.core.compiler import compile_plan
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.runtime.executor import Executor
    from braid.models.build import build_rank_chunks
    from braid.core.topology import Topology

    groups = ctx.process_groups(Topology(ctx.world_size, pp=pp, tp=tp))
    c = groups.coords
    cfg = Qwen2Config(layers=int(sum(layers)), **CFG_KW)
    torch.manual_seed(seed)
    model = Qwen2Model(cfg).to(ctx.dist.device)
    chunks = build_rank_chunks(model, plan, c.pp, layers, tp_rank=c.tp, tp_size=tp, tp_group=groups.tp, seq_shard=seq_shard)
    seq = SEQ // tp if seq_shard and tp > 1 else SEQ
    ex = Executor.from_groups(plan, compile_plan(plan)[c.pp], chunks, groups, ctx.dist.abort, act_shape=(MBS, seq, cfg.hidden),
                              device=ctx.dist.device, compile=compile, record="off")
    return cfg, chunks, ex


def _first_difference(a: dict, b: dict) -> str | None:
    for name, x in a.items():
        y = b[name]
        if (x is None) != (y is None):
            return f"{name}: eager {'None' if x is None else 'a tensor'}, graphed {'None' if y is None else 'a tensor'}"
        if x is not None and not torch.equal(x, y):
            return f"{name}: max |diff| {(x.float() - y.float()).abs().max().item():.3e} (of max |x| {x.float().abs().max().item():.3e})"
    return None


def graphed_matches_eager(ctx, pp: int, tp: int, runs: list[tuple[str, int, dict]], replays: int = 3,
                          compile: bool | None = False, stage_layers: dict[int, tuple[float, ...]] | None = None,
                          seq_shard: bool = False) -> list[dict]:
    """For each (schedule, m, schedule options): eager and graphed training from the same weights,
    ``WARMUP_STEPS + 1 + replays`` steps of different micro-batches, compared bitwise every step.
    ``stage_layers``: the layout per number of virtual stages (half layers allowed) instead of the default;
    ``seq_shard``: sequence parallelism inside TP (:mod:`braid.tp.seq_shard`).

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
        cfg, chunks_e, ex_e = _build(ctx, plan, pp, tp, layers, compile, seq_shard=seq_shard)
        _, chunks_g, ex_g = _build(ctx, plan, pp, tp, layers, compile, seq_shard=seq_shard)
        runner = GraphedStep(ex_g)
        params_e = {f"{c}.{n}": p for c, ch in chunks_e.items() for n, p in ch.named_parameters()}
        params_g = {f"{c}.{n}": p for c, ch in chunks_g.items() for n, p in ch.named_parameters()}
        opt_e = torch.optim.AdamW(params_e.values(), lr=LR, eps=EPS)
        opt_g = torch.optim.AdamW(params_g.values(), lr=LR, eps=EPS)
        dev = ctx.dist.device
        where = f"rank {ctx.rank} {name} m={m} {opts or ''} pp={pp} tp={tp} compile={ex_g.compiled}"
        for step in range(WARMUP_STEPS + 1 + replays):
            toks, labs = (list(t.to(dev) for t in x) for x in _data(cfg, m, seed=100 + step))
            opt_e.zero_grad(set_to_none=True)
            opt_g.zero_grad(set_to_none=True)
            res_e = ex_e.run(toks, labs)
            res_g = runner.run(toks, labs)
            what = runner.events[-1] if runner.events else "nothing"
            at = f"{where} step {step} ({what})"
            le, lg = res_e.loss_tensor, res_g.loss_tensor
            assert (le is None) == (lg is None), f"{at}: loss on one side only"
            if le is not None:
                assert torch.equal(le, lg), f"{at}: loss eager {le.item()!r} graphed {lg.item()!r}"
            assert res_g.counts == res_e.counts, f"{at}: counts eager {res_e.counts} graphed {res_g.counts}"
            diff = _first_difference({k: p.grad for k, p in params_e.items()}, {k: p.grad for k, p in params_g.items()})
            assert diff is None, f"{at}: gradient {diff}"
            opt_e.step()
            opt_g.step()
            diff = _first_difference({k: p.detach() for k, p in params_e.items()}, {k: p.detach() for k, p in params_g.items()})
            assert diff is None, f"{at}: parameter after AdamW {diff}"
        assert runner.captured, f"{where}: never captured ({runner.events})"
        try:  # another micro-batch count is refused before anything is launched
            runner.run(toks[:-1], labs[:-1])
            raise AssertionError(f"{where}: a step with {m - 1} micro-batches was replayed on a graph captured for {m}")
        except ValueError as err:
            assert "captured for" in str(err), f"{where}: {err}"
        out.append({"run": f"{name} m={m} {opts or ''}".strip(), "events": list(runner.events), **runner.memory(),
                    "capture_s": runner.capture_s})
        runner.release()
        del runner, ex_g, ex_e, chunks_e, chunks_g, opt_e, opt_g
        torch.cuda.empty_cache()
    return out


def smoke(ctx, case: str) -> list[str]:
    """One named case of ``benchmarks/graph_smoke.py``, as printable lines (raises on a mismatch)."""
    _, pp, tp, runs, compile = SMOKE_CASES[case]
    got = graphed_matches_eager(ctx, pp, tp, runs, compile=compile)
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
}
