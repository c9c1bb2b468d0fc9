"""Cases run inside the gloo processes of ``test_executor.py`` (module-level so they pickle by name)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from reference_error import adamw_amplify, adamw_cap, assert_matches_reference, loss_amplify

CFG_KW = dict(vocab_size=64, hidden=32, heads=4, kv_heads=2, ffn=64)
MBS, SEQ = 2, 8
LR = 1e-2
# A larger epsilon than the default keeps AdamW from blowing rounding noise in (near) zero
# gradients (e.g. of the K bias, which softmax nearly cancels) up to full-size updates.
EPS = 1e-4


def _data(cfg, m: int, seed: int, mbs: int = MBS):
    g = torch.Generator().manual_seed(seed)
    toks = [torch.randint(0, cfg.vocab_size, (mbs, SEQ), generator=g) for _ in range(m)]
    labs = [torch.randint(0, cfg.vocab_size, (mbs, SEQ), generator=g) for _ in range(m)]
    return toks, labs


def _reference(model, data_steps):
    """Single-process reference: per micro-batch loss/m, backward, AdamW; grads of step 1, losses, final params."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    losses, grads = [], None
    for toks, labs in data_steps:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for t, l in zip(toks, labs):
            loss = ref(t, l) / len(toks)
            loss.backward()
            total += loss.item()
        losses.append(total)
        if grads is None:
            grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        opt.step()
    return ref, losses, grads


def run_dtype(device, compile: bool | None = None) -> torch.dtype:
    """The dtype of an equivalence run: float64 on CPU (rounding ~1e-16, so the bound is tiny and no
    summation order can cross it), float32 on CUDA (checked against a float64 reference's error).
    Compiled units run in float32 too: inductor evaluates the float32 RoPE angles of the eager
    model at another precision (~1e-9 apart in float64), a difference no rounding bound of
    float64 covers."""
    return torch.float64 if torch.device(device).type == "cpu" and not compile else torch.float32


@dataclass
class Reference:
    """The single-process reference in the run's dtype and, when that is not float64, in float64
    too (its error is what :func:`reference_error.bound` allows). ``steps``: AdamW steps taken."""

    model: torch.nn.Module  # the initial model
    trained: torch.nn.Module
    losses: list[float]
    grads: dict[str, torch.Tensor]  # of the first step, before the optimizer
    steps: int
    trained64: torch.nn.Module | None = None
    losses64: list[float] | None = None
    grads64: dict[str, torch.Tensor] | None = None

    @staticmethod
    def run(model: torch.nn.Module, data_steps, fn=None) -> "Reference":
        fn = fn or _reference
        trained, losses, grads = fn(model, data_steps)
        out = Reference(model, trained, losses, grads, len(data_steps))
        if next(model.parameters()).dtype != torch.float64:
            out.trained64, out.losses64, out.grads64 = fn(copy.deepcopy(model).double(), data_steps)
        return out

    def grad_scale(self) -> float:
        return max(float(g.abs().max()) for g in self.grads.values())

    def check_loss(self, loss, step: int, where: str) -> None:
        amp = loss_amplify(self.grads.values(), lr=LR, eps=EPS, steps=step) if step else 0.0
        dtype = next(self.model.parameters()).dtype  # the loss was computed in the run's dtype
        assert_matches_reference(loss, torch.tensor(self.losses[step], dtype=dtype),
                                 None if self.losses64 is None else self.losses64[step],
                                 what=f"{where} step {step} loss", amplify=amp)

    def check_grads(self, chunks: dict, shard, where: str) -> None:
        """Every parameter of ``chunks`` has the reference's first-step gradient (before the optimizer).

        ``shard(model)``: this rank's chunks cut from a whole model (to shard the reference's grads)."""
        want = shard(_as_model(self.model, self.grads))
        want64 = None if self.grads64 is None else shard(_as_model(copy.deepcopy(self.model).double(), self.grads64))
        gscale = self.grad_scale()
        for ci, ch in chunks.items():
            w = dict(want[ci].named_parameters())
            w64 = None if want64 is None else dict(want64[ci].named_parameters())
            for n, p in ch.named_parameters():
                assert p.grad is not None, f"{where}: chunk {ci} {n} has no gradient"
                assert_matches_reference(p.grad, w[n], None if w64 is None else w64[n], what=f"{where} grad {ci}.{n}",
                                         scale=gscale)

    def check_params(self, chunks: dict, shard, where: str) -> None:
        """Every parameter of ``chunks`` equals the reference's after its AdamW steps."""
        final = shard(self.trained)
        final64 = None if self.trained64 is None else shard(self.trained64)
        pscale = max(float(p.detach().abs().max()) for p in self.trained.parameters())
        amp = adamw_amplify(self.grad_scale(), lr=LR, eps=EPS, steps=self.steps)
        cap = adamw_cap(lr=LR, steps=self.steps)
        for ci, ch in chunks.items():
            w = dict(final[ci].named_parameters())
            w64 = None if final64 is None else dict(final64[ci].named_parameters())
            for n, p in ch.named_parameters():
                assert_matches_reference(p, w[n], None if w64 is None else w64[n], what=f"{where} param {ci}.{n}",
                                         scale=pscale, amplify=amp, cap=cap)


# The single-process reference depends only on the model (its layer count; seed, dtype and device fixed by the
# case) and the data (m, the replica's seeds): the schedules of one layout and m share it. Computed once per
# rank process and key (a pure function of those inputs), instead of once per schedule.
_REFERENCES: dict[tuple, Reference] = {}


def _reference_of(model, data_steps, key: tuple) -> Reference:
    """:meth:`Reference.run` of ``model`` on ``data_steps``, computed once per ``key`` (what they are made from);
    the returned reference holds ``model`` itself as its initial model."""
    hit = _REFERENCES.get(key)
    if hit is None:
        hit = _REFERENCES[key] = Reference.run(copy.deepcopy(model), data_steps)
    return dataclasses.replace(hit, model=model)


def _as_model(model, tensors: dict):
    """A copy of ``model`` whose parameters hold ``tensors`` (to shard reference grads like the weights)."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in out.named_parameters():
            p.copy_(tensors[n])
    return out


def _expected_counts(program, chunks):
    from braid.core.braiding import Phase, steps
    from braid.core.ir import Braided, Compute

    spec_of = lambda c: chunks[c].spec  # noqa: E731
    w = ar = braided = 0
    for ins in program.instructions:
        if isinstance(ins, (Compute, Braided)):
            braided += isinstance(ins, Braided)
            for st in steps(ins, spec_of):
                w += st.task.phase is Phase.W
                ar += st.task.ar
    return braided, w, ar


def _tp_comm(ctx, groups, backend: str):
    """A TPComm over a TP group created (once per backend) with that backend's options."""
    from braid.tp.comm import make_tp_comm

    key = ("tp_comm", backend, tuple(groups.tp_ranks))
    if key not in ctx.groups:
        ctx.groups[key] = make_tp_comm(groups, backend)
    return ctx.groups[key]


def _check_carried_overlap(program, chunks, trace, where: str, on_cpu: bool) -> None:
    """Every carried all-reduce is in flight, in the measured trace, while the next compute
    instruction's first unit task runs (:func:`braid.core.braiding.carries`) -- except, on CPU,
    one whose run is chained and read by that unit: there it has ended before the unit starts
    (on CUDA the run is posted from a side stream ordered after the all-reduce, and the compute
    stream waits for the all-reduce after that unit, as for any carry)."""
    from braid.core.braiding import carries, steps

    for i, carry in carries(program.instructions, lambda c: chunks[c].spec).items():
        last = steps(program.instructions[i], lambda c: chunks[c].spec)[-1]
        ar = [e for e in trace.events if e.kind == "AR" and e.op_index == i and e.unit == last.task.label.split(":", 1)[1]
              and e.mb == carry.op.mb and e.chunk == carry.op.chunk]
        head = [e for e in trace.events if e.lane == "compute" and e.op_index == carry.into]
        assert len(ar) == 1 and head, f"{where}: carried all-reduce of op {i} or the first unit of op {carry.into} not traced"
        first = min(head, key=lambda e: e.start)
        if on_cpu and carry.chained and carry.head_reads_run:
            assert ar[0].start + ar[0].dur <= first.start, f"{where}: op {carry.into} ran before the chained run of op {i} was posted"
            continue
        assert ar[0].start <= first.start and ar[0].start + ar[0].dur >= first.start + first.dur, (
            f"{where}: the carried all-reduce of op {i} ({ar[0]}) does not span op {carry.into}'s first unit ({first})")


def equivalence(ctx, pp: int, tp: int, schedules_ms: list[tuple[str, int]],
                compile: bool | None = None, tp_backend: str | None = None, recompute: str = "none",
                stage_layers: dict[int, tuple[float, ...]] | None = None, seq_shard: bool = False,
                stage_p2p: bool | None = None) -> list[tuple[str, int, dict]]:
    """Run each (schedule, m) for two AdamW steps and compare with the single-process reference:
    the loss of each step, every gradient before the first optimizer step and every parameter
    after the last, within :func:`reference_error.bound` (float64 on CPU, float32 against a
    float64 reference's error on CUDA). ``compile``: the executor's compiled-units switch;
    ``tp_backend``: run the TP all-reduces through this :mod:`braid.tp.comm` backend, over a TP
    group created with its options, instead of the groups' default; ``recompute``: the chunks'
    recomputation mode; ``stage_layers``: the layout per number of virtual stages (half layers
    allowed) instead of the default split; ``seq_shard``: sequence parallelism inside TP
    (:mod:`braid.tp.seq_shard`); ``stage_p2p``: the executor's staged transfers (:mod:`braid.runtime.p2p`) on
    or off (None: its default, on while a CUDA graph captures). The counts returned carry ``peak_bytes``: the rank's
    peak of the first step's memory series, and ``staging_made``: the staging buffers the executor allocated, ``sends_held``: the sends it still holds after the step."""
    from braid import schedules
    from braid.core.braiding import carries
    from braid.core.compiler import compile_plan
    from braid.core.ir import Plan
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.core.partition import split_layers
    from braid.runtime.distributed import reduce_gradients
    from braid.runtime.executor import Executor
    from braid.models.build import build_rank_chunks
    from braid.core.topology import Topology

    topo = Topology(ctx.world_size, pp=pp, tp=tp, dp=ctx.world_size // (pp * tp))
    groups = ctx.process_groups(topo)
    c = groups.coords
    ran = []
    for entry in schedules_ms:
        # (name, m), or (name, m, plan as JSON or None, seq_shard): a plan made elsewhere (e.g. tuned), sequence sharding per run
        name, m = entry[0], entry[1]
        plan_json = entry[2] if len(entry) > 2 else None
        sharded = entry[3] if len(entry) > 3 else seq_shard
        try:
            plan = schedules.build(name, pp, m) if plan_json is None else Plan.from_json(plan_json)
        except ValueError:
            continue
        stages = plan.num_stages
        layers = split_layers(2 * stages - 1, stages) if stages > 1 else (2,)
        if stage_layers is not None:
            layers = stage_layers[stages]
        cfg = Qwen2Config(layers=int(sum(layers)), **CFG_KW)
        topo.check_model(num_heads=cfg.heads, num_kv_heads=cfg.kv_heads, vocab_size=cfg.vocab_size, num_layers=cfg.layers, num_stages=stages)
        dev = ctx.dist.device
        dtype = run_dtype(dev, compile)
        torch.manual_seed(1234)
        model = Qwen2Model(cfg).to(dev, dtype)
        steps_data = [tuple([t.to(dev) for t in x] for x in _data(cfg, m, seed=s + 10 * c.dp)) for s in range(2)]
        if topo.dp > 1:
            raise AssertionError("cases use dp=1")
        ref = _reference_of(model, steps_data, ("qwen2", cfg.layers, m, dtype, str(dev), c.dp))
        program = compile_plan(plan)[c.pp]
        chunks = build_rank_chunks(model, plan, c.pp, layers, tp_rank=c.tp, tp_size=tp, tp_group=groups.tp, seq_shard=sharded)
        for ch in chunks.values():
            ch.set_recompute(recompute)
        shard = lambda whole: build_rank_chunks(whole, plan, c.pp, layers, tp_rank=c.tp, tp_size=tp)  # noqa: E731
        params = [p for ch in chunks.values() for p in ch.parameters()]
        opt = torch.optim.AdamW(params, lr=LR, eps=EPS)
        kw = {} if tp_backend is None else {"tp_comm": _tp_comm(ctx, groups, tp_backend)}
        seq = SEQ // tp if sharded else SEQ
        ex = Executor.from_groups(plan, program, chunks, groups, ctx.dist.abort, act_shape=(MBS, seq, cfg.hidden), device=dev,
                                  dtype=dtype, compile=compile, **kw)
        ex.stage_p2p = stage_p2p
        where = (f"{name} pp={pp} tp={tp} m={m} rank={ctx.rank} compile={ex.compiled} seq_shard={sharded} "
                 f"tp_backend={tp_backend or groups.tp_backend}")
        for step, (toks, labs) in enumerate(steps_data):
            opt.zero_grad(set_to_none=True)
            res = ex.run(toks, labs)
            reduce_gradients(params, groups, ctx.dist.abort)
            if res.loss is not None:
                ref.check_loss(res.loss, step, where)
            if step == 0:
                ref.check_grads(chunks, shard, where)
                braided, w, ar = _expected_counts(program, chunks)
                assert res.counts["braided"] == braided and res.counts["W"] == w, f"{where}: counts {res.counts}"
                assert res.counts["AR"] == (ar if tp > 1 else 0), f"{where}: {res.counts['AR']} all-reduces, expected {ar}"
                n_ar_events = sum(e.kind == "AR" for e in res.trace.events)
                assert n_ar_events == res.counts["AR"], where
                assert all(e.lane == "tp-comm" for e in res.trace.events if e.kind == "AR"), where
                assert res.trace.memory[c.pp], where
                peak = max(b for _, b in res.trace.memory[c.pp])
                if tp > 1:
                    _check_carried_overlap(program, chunks, res.trace, where, dev.type == "cpu")
                    chained = sum(c.chained for c in carries(program.instructions, lambda ci: chunks[ci].spec).values())
                    assert res.counts["chained"] == chained, f"{where}: {res.counts['chained']} chained runs, expected {chained}"
            opt.step()
        ref.check_params(chunks, shard, where)
        # all-gathers started as their instruction starts (braiding.early_heads; sequence sharding)
        early = sum(e.kind == "AG" and e.lane == "tp-comm" for e in res.trace.events)
        ran.append((name, m, dict(res.counts, peak_bytes=peak, seq_shard=sharded, early_AG=early, staging_made=ex.staging.made,
                                      sends_held=len(ex._sends))))
    return ran


def failing_rank(ctx, bad_rank: int) -> str:
    """pp=2 gpipe where ``bad_rank`` raises before its first instruction; the other must fail, not hang."""
    import time

    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.runtime.executor import Executor
    from braid.models.build import build_rank_chunks
    from braid.core.topology import Topology

    groups = ctx.process_groups(Topology(ctx.world_size, pp=2))
    plan = schedules.build("gpipe", 2, 2)
    cfg = Qwen2Config(layers=2, **CFG_KW)
    torch.manual_seed(0)
    chunks = build_rank_chunks(Qwen2Model(cfg), plan, groups.coords.pp, (1, 1))
    program = compile_plan(plan)[groups.coords.pp]
    ex = Executor.from_groups(plan, program, chunks, groups, ctx.dist.abort, act_shape=(MBS, SEQ, cfg.hidden))
    toks, labs = _data(cfg, 2, 0)
    if ctx.rank == bad_rank:
        labs = labs[:1]  # the loss of micro-batch 1 has no labels: an IndexError inside F1
    t0 = time.monotonic()
    try:
        ex.run(toks, labs)
    except Exception as err:  # noqa: BLE001 - the point is that every rank ends with an error
        return f"{type(err).__name__} after {time.monotonic() - t0:.1f}s: {err}"
    return "no error"


def bad_program(ctx, text: str) -> str:
    """Run a hand-written single-rank program and return the error text."""
    from braid.core.ir import Plan, Program, ScheduleConfig
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.runtime.executor import Executor
    from braid.models.build import build_rank_chunks

    cfg = Qwen2Config(layers=2, **CFG_KW)
    prog = Program.from_text(0, text)
    plan = Plan("hand", ScheduleConfig(1, 2), "loop", (tuple(i for i in prog.instructions),))
    torch.manual_seed(0)
    chunks = build_rank_chunks(Qwen2Model(cfg), plan, 0, (2,))
    ex = Executor(plan, prog, chunks, pp_ranks=[0], act_shape=(MBS, SEQ, cfg.hidden))
    try:
        ex.run(*_data(cfg, 2, 0))
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return "no error"


def wrong_world(ctx) -> str:
    from braid.runtime.distributed import ProcessGroups
    from braid.core.topology import Topology

    try:
        ProcessGroups.create(Topology(4, pp=2, tp=2))
    except ValueError as err:
        return str(err)
    return "no error"


def record_modes(ctx, tp: int) -> dict:
    """braided_v p=1 m=3 with TP ``tp``: one step per recording mode from the same weights.

    Returns, per mode, the loss, the gradients, the counts and what the trace holds, so the
    test can check that recording changes what is timed and never what is computed.
    """
    from braid import schedules
    from braid.core.braiding import steps
    from braid.core.compiler import compile_plan
    from braid.core.ir import Braided, Compute, compute_ops
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.runtime.executor import Executor
    from braid.models.build import build_rank_chunks
    from braid.core.topology import Topology

    groups = ctx.process_groups(Topology(ctx.world_size, pp=1, tp=tp))
    plan = schedules.build("braided_v", 1, 3)
    cfg = Qwen2Config(layers=2, **CFG_KW)
    torch.manual_seed(0)
    chunks = build_rank_chunks(Qwen2Model(cfg), plan, 0, (1, 1), tp_rank=groups.coords.tp, tp_size=tp, tp_group=groups.tp)
    program = compile_plan(plan)[0]
    ex = Executor.from_groups(plan, program, chunks, groups, ctx.dist.abort, act_shape=(MBS, SEQ, cfg.hidden), record="off")
    toks, labs = _data(cfg, 3, 0)
    compute = [i for i in program.instructions if isinstance(i, (Compute, Braided))]
    out: dict = {
        "n_units": sum(len(steps(i, lambda c: chunks[c].spec)) for i in compute),
        "ops": sum(len(compute_ops(i)) for i in compute),
    }
    for mode in ("units", "instructions", "off", None):  # None: the executor's own mode ("off")
        for ch in chunks.values():
            ch.zero_grad(set_to_none=True)
        res = ex.run(toks, labs, record=mode)
        ev = res.trace.events
        out[str(mode)] = {
            "loss": res.loss,
            "grads": {f"{c}.{n}": p.grad.detach().clone() for c, ch in chunks.items() for n, p in ch.named_parameters()},
            "counts": res.counts,
            "compute": sum(e.lane == "compute" for e in ev),
            "with_unit": sum(e.lane == "compute" and e.unit is not None for e in ev),
            "ar": sum(e.kind == "AR" for e in ev),
            "memory": len(res.trace.memory.get(0, [])),
            "meta_record": res.trace.meta["record"],
            "exposed": "exposed_ar_s" in res.trace.meta["summary"],
        }
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ex.run(toks, labs, record="units")
    out["ranges"] = {e.name for e in prof.events()}
    out["named"] = {str(i) for i in compute} | {f"{op} {st.task.label.split(':', 1)[1]}" for i in compute
                                                for st in steps(i, lambda c: chunks[c].spec) for op in [st.op]}
    try:
        ex.run(toks, labs, record="unit")
    except ValueError as err:
        out["bad"] = str(err)
    try:
        Executor.from_groups(plan, program, chunks, groups, ctx.dist.abort, act_shape=(MBS, SEQ, cfg.hidden), record="all")
    except ValueError as err:
        out["bad_init"] = str(err)
    return out


def seq_shard_saved_bytes(ctx, shard: bool) -> tuple[dict, dict]:
    """One layer's and the LM head's forward at tp=2 (fp32), unit by unit: the bytes each unit keeps (``live_bytes``)
    and what ``analytic_costs(..., activations="runtime")`` charges it, with or without sequence sharding."""
    from braid.core.braiding import LAYER_UNITS, AR_FORWARD, ChunkSpec, Comm, Phase, Unit, UnitTask
    from braid.cost.catalog import ModelConfig
    from braid.cost.costs import Layout, analytic_costs
    from braid.cost.hardware import get_hardware
    from braid.core.topology import Topology
    from braid.models.build import build_chunk
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.tp.seq_shard import reduce_now

    groups = ctx.process_groups(Topology(ctx.world_size, pp=1, tp=2))
    b, s, t = MBS, SEQ, 2
    cfg = Qwen2Config(layers=1, **CFG_KW)
    torch.manual_seed(0)
    ch = build_chunk(Qwen2Model(cfg), ChunkSpec(1, head=True), 0, tp_rank=groups.coords.tp, tp_size=t, tp_group=groups.tp, seq_shard=shard)
    toks, labs = _data(cfg, 1, 0)
    ch.set_batch(toks, labs)
    ch.set_input(0, torch.randn(b, s // t if shard else s, cfg.hidden))
    kept = {}
    for unit, layer in [(u, 0) for u in LAYER_UNITS] + [(Unit.HEAD, -1)]:
        before = ch.live_bytes()
        out = ch.run(0, UnitTask(Phase.F, unit, layer, Comm.AR if unit in AR_FORWARD else None))
        if out is not None:
            reduce_now(out, groups.tp)
        kept[unit.value] = ch.live_bytes() - before
    model = ModelConfig("t", layers=2, hidden=cfg.hidden, heads=cfg.heads, kv_heads=cfg.kv_heads, ffn=cfg.ffn, vocab=cfg.vocab_size,
                        seq=s, micro_batch_size=b, dtype_bytes=4)
    units = analytic_costs(model, get_hardware("h200"), Layout(t, 2, 1, "loop"), activations="runtime",
                           seq_shard=shard).chunks
    return kept, {**{u.value: units[(0, 0)].units[u].act for u in LAYER_UNITS}, "head": units[(1, 0)].units[Unit.HEAD].act}


def seq_shard_w_stash(ctx, shard: bool, joint: bool = False, mbs: int = MBS, head: bool = False) -> tuple[list, list, list, tuple, list]:
    """One layer at tp=2 (float64), forward then activation backward unit by unit (weight gradients split
    off): the shapes of the column-parallel linears' stashed inputs and the row-parallel ones' stashed output
    gradients after B, what the chunk still holds
    (:meth:`pending_work`) after every W, the weight gradients, and the saved-tensor boxes left after the
    B's with the shapes of the gathered slots they still hold, and per attn/mlp B whether the residual's gradient it
    keeps is a slot of a larger buffer (the all-gather's: :meth:`_finish_gathering`). ``joint``: the micro-batch marked as a
    full backward's (``set_joint``: its W comes right after its B). ``head``: the chunk ends with the LM head, whose
    loss gives the output gradient."""
    from braid.core.braiding import AR_BACKWARD, AR_FORWARD, LAYER_UNITS, ChunkSpec, Comm, Phase, Unit, UnitTask
    from braid.core.topology import Topology
    from braid.models.build import build_chunk
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.tp.seq_shard import reduce_now

    groups = ctx.process_groups(Topology(ctx.world_size, pp=1, tp=2))
    b, s, t = mbs, SEQ, 2
    cfg = Qwen2Config(layers=1, **CFG_KW)
    torch.manual_seed(0)
    ch = build_chunk(Qwen2Model(cfg).double(), ChunkSpec(1, head=head), 0, tp_rank=groups.coords.tp, tp_size=t, tp_group=groups.tp,
                     seq_shard=shard)
    toks, labs = _data(cfg, 1, 0, mbs)
    ch.set_batch(toks, labs)
    ch.set_joint({0} if joint else set())
    torch.manual_seed(1)
    x, g = (torch.randn(b, s, cfg.hidden, dtype=torch.float64) for _ in range(2))
    rank = groups.coords.tp
    part = (lambda v: v.chunk(t, dim=1)[rank].clone()) if shard else (lambda v: v)  # (a tensor of its own)
    ch.set_input(0, part(x))
    tasks = [(u, 0) for u in LAYER_UNITS] + ([(Unit.HEAD, -1)] if head else [])
    for unit, layer in tasks:
        out = ch.run(0, UnitTask(Phase.F, unit, layer, Comm.AR if unit in AR_FORWARD else None))
        if out is not None:
            reduce_now(out, groups.tp)
    ch.end_forward(0)
    if not head:
        ch.pop_output(0)
        ch.set_output_grad(0, part(g))
    slots = []
    for unit, layer in reversed(tasks):
        out = ch.run(0, UnitTask(Phase.B, unit, layer, Comm.AR if unit in AR_BACKWARD else None))
        if out is not None:
            reduce_now(out, groups.tp)
        if unit in (Unit.ATTN, Unit.MLP):
            res = ch._bwd[0].residual
            slots.append((unit.value, res.untyped_storage().nbytes() > res.numel() * res.element_size()))
    # after their activation backward the boxes hold none of the rank's tokens they stashed for W (the stash does)
    boxed = [tuple(box.tensors[i].shape) for box in ch._boxes.values() for i in box.gathered if box.tensors[i] is not None]
    # the whole-sequence slots: the column-parallel linears' inputs, the row-parallel ones' output gradients
    stashed = (sorted(tuple(x.shape) for u in LAYER_UNITS if u.value.startswith("pre_") for m in ch._deferred(u, 0)
                      for x in m.stashed_tensors(0)[::2]),
               sorted(tuple(x.shape) for u in LAYER_UNITS if not u.value.startswith("pre_") for m in ch._deferred(u, 0)
                      for x in m.stashed_tensors(0)[1::2]))
    held = []
    for unit, layer in reversed(tasks):
        ch.run(0, UnitTask(Phase.W, unit, layer))
        held.append(sorted(w for w in ch.pending_work() if w.startswith(("stash", "stashed"))))
    grads = [(n, p.grad.clone()) for n, p in ch.named_parameters() if p.grad is not None and p.dim() == 2]
    return stashed, held, grads, (len(ch._boxes), boxed), slots


def seq_shard_gathers(ctx, grouped: bool) -> tuple[int, list]:
    """:func:`equivalence` of braided_v and zb_v at tp=2 under sequence sharding, with Q/K/V and gate/up
    grouped into one GEMM each (the tiny model's default) or as separate linears (``grouped`` False: a
    7b-sized layer's), counting the all-gathers the ranks start (:func:`braid.tp.seq_shard.all_gather_into`)."""
    import braid.tp.layers as tp_layers
    import braid.tp.seq_shard as seq_shard

    calls = [0]
    gather, limit = seq_shard.all_gather_into, tp_layers.GROUP_MAX_WEIGHT

    def counted(*args, **kwargs):
        calls[0] += 1
        return gather(*args, **kwargs)

    seq_shard.all_gather_into = counted
    if not grouped:
        tp_layers.GROUP_MAX_WEIGHT = 0
    try:
        ran = equivalence(ctx, 1, 2, [("braided_v", 3), ("zb_v", 2)], seq_shard=True)
    finally:
        seq_shard.all_gather_into, tp_layers.GROUP_MAX_WEIGHT = gather, limit
    return calls[0], ran
