"""Whole-step CUDA graphs (:mod:`braid.runtime.graphs`) on CPU: when a step cannot be captured and
why (one line), the switch's values, the cost file for graphed steps, and ``--cuda-graph`` on
every command line (bad input: one line, exit 2). Capture and replay themselves need CUDA:
``tests/test_graphs_gpu.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from braid.runtime import graphs

ROOT = Path(__file__).resolve().parent.parent


def _executor(**kw):
    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.runtime.executor import Executor
    from braid.models.build import build_rank_chunks

    plan = schedules.build("braided_v", 1, 3)
    cfg = Qwen2Config(layers=2, vocab_size=64, hidden=32, heads=4, kv_heads=2, ffn=64)
    torch.manual_seed(0)
    chunks = build_rank_chunks(Qwen2Model(cfg), plan, 0, (1, 1))
    return Executor(plan, compile_plan(plan)[0], chunks, pp_ranks=[0], act_shape=(2, 8, 32), record="off", **kw), cfg


def test_config_reasons_name_what_cannot_be_captured() -> None:
    assert "need a CUDA device" in graphs.config_reason("cpu")
    assert "symm-mem" in graphs.config_reason("cuda", tp=2, tp_backend="symm-mem")
    assert graphs.config_reason("cuda", tp=1, tp_backend="symm-mem") is None  # no TP all-reduce at tp=1
    assert graphs.config_reason("cuda", cp=2) is None  # 2D-Attention is captured (tests/test_graphs_gpu.py)
    assert graphs.config_reason("cuda", tp=2, tp_backend="nccl-capped") is None
    for reason in (graphs.config_reason("cpu"), graphs.config_reason("cuda", tp=2, tp_backend="symm-mem")):
        assert "\n" not in reason


def test_check_mode() -> None:
    assert graphs.check_mode("step") == "step" and graphs.check_mode("none") == "none" and graphs.check_mode(None) is None
    with pytest.raises(ValueError, match="choose one of none, step"):
        graphs.check_mode("full")


def test_a_cpu_step_runs_eager_and_says_why() -> None:
    ex, cfg = _executor()
    assert graphs.resolve(None, ex) == ("none", graphs.config_reason("cpu"))
    assert graphs.resolve("none", ex) == ("none", None)
    with pytest.raises(ValueError, match="rank 0 cannot capture its step: device cpu"):
        graphs.resolve("step", ex)
    with pytest.raises(ValueError, match="cannot capture this step: device cpu"):
        graphs.GraphedStep(ex)
    runner = graphs.step_runner(ex)
    assert isinstance(runner, graphs.EagerStep) and runner.reason == graphs.config_reason("cpu") and not runner.captured
    g = torch.Generator().manual_seed(1)
    toks = [torch.randint(0, cfg.vocab_size, (2, 8), generator=g) for _ in range(3)]
    labs = [torch.randint(0, cfg.vocab_size, (2, 8), generator=g) for _ in range(3)]
    params = [p for ch in ex.chunks.values() for p in ch.parameters()]
    got = runner.run(toks, labs)
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    want = ex.run(toks, labs)
    assert got.loss == want.loss and all(torch.equal(a, p.grad) for a, p in zip(grads, params))


def test_chunk_and_abort_reasons(monkeypatch) -> None:
    """What :func:`not_capturable` checks past the device (the device is made to read cuda)."""
    from braid.models.chunk import ModelChunk
    from braid.runtime.distributed import Abort

    ex, _ = _executor()
    ex.device = torch.device("cuda", 0)
    assert graphs.not_capturable(ex) is None
    ex.abort = Abort(store=None, rank=0, cuda=False)
    assert "read from the store" in graphs.not_capturable(ex)
    ex.abort = Abort(store=None, rank=0, cuda=True)
    assert graphs.not_capturable(ex) is None

    class HostBatch(ModelChunk):
        def set_batch(self, tokens, labels):  # reads its items on the host, as the VLM's chunks do
            super().set_batch(tokens, labels)

    ex.chunks[1].__class__ = HostBatch
    assert graphs.not_capturable(ex) == "chunk 1 (HostBatch) reads its micro-batches on the host every step; it runs eager"


def test_graphed_costs_drop_the_host_lane() -> None:
    def doc(device: str) -> dict:
        return {"host_task_s": 4e-4, "meta": {"config": {"device": device, "tp": 2}, "tp_backend": "nccl-capped"}}

    d = graphs.graphed_costs(doc("cuda"), None)
    assert d["host_task_s"] == 0.0 and d["meta"]["profiled_host_task_s"] == 4e-4 and d["meta"]["cuda_graph"] == "step"
    for device, mode in (("cuda", "none"), ("cpu", None)):
        d = graphs.graphed_costs(doc(device), mode)
        assert d["host_task_s"] == 4e-4 and d["meta"]["cuda_graph"] == "none"
    bad = doc("cuda")
    bad["meta"]["tp_backend"] = "symm-mem"
    assert graphs.graphed_costs(bad, None)["host_task_s"] == 4e-4


def test_host_pool_forgets_buffer_events() -> None:
    from braid.runtime.offload import HostPool

    pool = HostPool(pin=False)
    bufs = [pool.acquire(16), pool.acquire(16), pool.acquire(8)]
    for b in bufs:
        pool.release(b, ready=object())
    pool.forget_events()
    assert all(b.ready is None for b in bufs) and pool.in_use == 0 and pool.allocations == 3


@pytest.mark.parametrize("argv,fragment", [
    (["examples/qwen2.py", "--cuda-graph", "full"], "--cuda-graph"),
    (["examples/qwen2.py", "--cuda-graph", "step", "--device", "cpu"], "--cuda-graph step: device cpu"),
    (["examples/qwen2_vl.py", "--cuda-graph", "step", "--device", "cpu"], "--cuda-graph step: device cpu"),
    (["-m", "braid.bench", "--cuda-graph", "step", "--device", "cpu"], "--cuda-graph step: device cpu"),
    (["-m", "braid.profile", "--cuda-graph", "step", "--device", "cpu"], "--cuda-graph step: device cpu"),
    (["-m", "braid.bench", "--cuda-graph", "all"], "--cuda-graph"),
    (["benchmarks/bench_executor_limit.py", "--cuda-graph", "step", "--device", "cpu"], "--cuda-graph step: device cpu"),
])
def test_cuda_graph_flag_bad_input_is_one_line_exit_2(tmp_path, monkeypatch, capsys, argv: list[str], fragment: str) -> None:
    """Each command line run as ``python ARGV`` runs it, in this process (``runpy``: the script or module as
    ``__main__``, exit code from its ``sys.exit``), in an empty directory; the refusal comes before any work.
    test_cli_bad_input runs braid.bench's and braid.profile's refusals through a new interpreter, as test_examples
    and test_train_faults do the example scripts'."""
    import runpy

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(sys, "path", list(sys.path))  # a script puts its own folders first
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    module = argv[1] if argv[0] == "-m" else None
    script = None if module else str(ROOT / argv[0])
    monkeypatch.setattr(sys, "argv", [script or module, *argv[2 if module else 1:]])
    capsys.readouterr()
    if module:  # run as a new interpreter would: not the copy other tests imported (runpy would warn about it)
        monkeypatch.delitem(sys.modules, module, raising=False)
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as err:
        code = err.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    if "bench_executor_limit" in argv[0]:  # a plain argparse script: usage, then the one error line
        lines = lines[-1:]
    assert code == 2 and len(lines) == 1 and fragment in lines[0], (code, err[-2000:])
    assert list(tmp_path.iterdir()) == []


def test_static_buffers_take_new_micro_batches_and_refuse_other_shapes() -> None:
    """:meth:`GraphedStep._copy_in` (what a replay reads): copies in place, refuses another count, shape or dtype."""
    ex, _ = _executor()
    step = object.__new__(graphs.GraphedStep)  # the buffer plumbing only: no CUDA stream, no capture
    step.ex = ex
    step._tokens = [torch.zeros(2, 8, dtype=torch.long) for _ in range(3)]
    step._labels = [torch.zeros(2, 8, dtype=torch.long) for _ in range(3)]
    held = [t.data_ptr() for t in step._tokens + step._labels]
    toks = [torch.full((2, 8), i, dtype=torch.long) for i in range(3)]
    labs = [torch.full((2, 8), 10 + i, dtype=torch.long) for i in range(3)]
    step._copy_in(toks, labs)
    assert [t.data_ptr() for t in step._tokens + step._labels] == held
    assert all(torch.equal(a, b) for a, b in zip(step._tokens + step._labels, toks + labs))
    with pytest.raises(ValueError, match="captured for 3 micro-batches, got 2"):
        step._copy_in(toks[:2], labs[:2])
    with pytest.raises(ValueError, match=r"captured for micro-batches \(2, 8\) torch.int64, got \(2, 16\)"):
        step._copy_in([torch.zeros(2, 16, dtype=torch.long)] * 3, labs)
    with pytest.raises(ValueError, match="another shape needs another graph"):
        step._copy_in([t.int() for t in toks], labs)


class _Scripted(graphs.GraphedStep):
    """GraphedStep's step-by-step decisions without a GPU: warm-up, capture, replay and release only
    say what they would do; each step's micro-batch key is given."""

    def __init__(self, keyed: bool) -> None:  # noqa: D107 - no executor, no CUDA
        self.warmup, self.steps, self.events, self.graph, self.eager_reason = graphs.WARMUP_STEPS, 0, [], None, None
        self._keys = self._warm_keys = None
        self._keyed, self.captures, self.shape_changes, self.key = keyed, 0, 0, None
        self.ex = type("Ex", (), {"rank": 0, "run": lambda _s, *a, **k: self.events.append(f"step {self.steps}: eager")})()

    def _batch_keys(self, tokens):
        return [self.key]

    def _warm(self, tokens, labels):
        self.events.append(f"step {self.steps}: warm")
        self.steps += 1

    def _capture(self, tokens, labels):
        self.graph, self._keys, self.captures = object(), [self.key] if self._keyed else None, self.captures + 1
        self.events.append(f"step {self.steps}: capture")

    def _replay(self, tokens, labels, note):
        self.events.append(f"step {self.steps}: replay")
        self.steps += 1

    def release(self):
        self.graph = None


def _decisions(keyed: bool, keys: list) -> list[str]:
    runner = _Scripted(keyed)
    for k in keys:
        runner.key = k
        runner.run([], [])
    return [e.split(": ", 1)[1] for e in runner.events]


def test_a_graph_is_kept_for_inputs_without_a_key_and_recaptured_for_new_shapes() -> None:
    # A language model: two warm-up steps, one capture, then replays whatever the micro-batches hold.
    assert _decisions(False, [None] * 6) == ["warm", "warm", "capture", "replay", "replay", "replay", "replay"]
    # A VLM whose shapes change once: the graph is released, one eager step of the new shape, a new capture.
    got = _decisions(True, ["a"] * 4 + ["b"] * 3)
    assert got == ["warm", "warm", "capture", "replay", "replay", "new micro-batch shapes: graph released", "warm",
                   "capture", "replay", "replay"]
    # Shapes that never settle: never captured past the warm-up; shapes that keep changing: eager after MAX_CAPTURES.
    assert "capture" not in _decisions(True, list("abcdef"))
    got = _decisions(True, ["a"] * 3 + [k for k in "bcdefghij" for _ in range(2)])
    assert got.count("capture") == graphs.MAX_CAPTURES and any("changed shape 4 times" in e for e in got) and got[-1] == "eager"


class _Event:
    """A stand-in for a CUDA event: passed after ``after`` queries (never when None)."""

    def __init__(self, after: int | None) -> None:
        self.after, self.queries = after, 0

    def query(self) -> bool:
        self.queries += 1
        return self.after is not None and self.queries > self.after


def test_a_replay_wait_is_bounded_and_reads_the_failure_record(monkeypatch) -> None:
    from braid.runtime.errors import CommTimeout, PeerFailure

    ev = _Event(3)  # the replay ends: the wait returns
    graphs.bounded_wait(ev, 5.0, "rank 0: the replay of step 3", poll_s=0.0)
    assert ev.queries == 4
    # a replay that never ends (a captured collective whose peer never joins) ends in CommTimeout naming it
    with pytest.raises(CommTimeout, match="rank 1: the replay of step 7 did not finish within 0.05 s"):
        graphs.bounded_wait(_Event(None), 0.05, "rank 1: the replay of step 7", poll_s=0.001)
    # while it waits, another rank's recorded failure stops it (Abort.check raises PeerFailure)
    monkeypatch.setattr(graphs, "REPLAY_CHECK_S", 0.0)
    calls = []

    def check() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise PeerFailure("rank 0 stops: rank 1 failed first: boom", 1, "boom")

    with pytest.raises(PeerFailure, match="rank 1 failed first"):
        graphs.bounded_wait(_Event(None), None, "rank 0: the replay of step 2", check, poll_s=0.0)
    assert len(calls) == 2
