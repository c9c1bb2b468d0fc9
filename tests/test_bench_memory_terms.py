"""``benchmarks/bench_memory_terms.py`` and its helpers (:mod:`braid.measure.memory_terms`) on CPU,
driven by fake probes: the deltas, the peaks and fragmentation, the child-process context protocol,
NVML's device mapping, the layout checks, the table and the JSON. The CUDA measurements themselves
need GPUs (the script refuses without them: ``tests/test_benchmark_scripts.py``)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

bmt = importlib.import_module("bench_memory_terms")  # a script of benchmarks/, not a package
from braid.measure import memory_terms as mt  # noqa: E402

MIB = 2**20


class FakeDevice:
    """Counters the fake probes read; ``alloc`` moves them as an allocation of ``n`` bytes would."""

    def __init__(self) -> None:
        self.used, self.reserved, self.allocated = 1000 * MIB, 0, 0
        self.peak_alloc = self.peak_res = 0
        self.syncs = 0

    def probes(self):
        return {"used": lambda: self.used, "reserved": lambda: self.reserved, "allocated": lambda: self.allocated}

    def alloc(self, n: int, outside: int = 0) -> None:
        self.allocated += n
        self.reserved += n
        self.used += n + outside
        self.peak_alloc = max(self.peak_alloc, self.allocated)
        self.peak_res = max(self.peak_res, self.reserved)

    def free(self, n: int) -> None:
        self.allocated -= n  # cached: reserved and used stay

    def reset(self) -> None:
        self.peak_alloc, self.peak_res = self.allocated, self.reserved


def test_measure_delta_takes_every_probe_before_and_after_and_returns_fn_result() -> None:
    dev = FakeDevice()

    def fn():
        dev.alloc(4 * MIB, outside=64 * MIB)
        return "done"

    term, out = mt.measure_delta("nccl.x", fn, dev.probes(), how="around fn", sync=lambda: setattr(dev, "syncs", dev.syncs + 1))
    assert out == "done" and dev.syncs == 2
    assert term.value == 68 * MIB and term.unit == "B" and term.how == "around fn"  # default: the first probe (used)
    assert term.detail["used_before"] == 1000 * MIB and term.detail["used_after"] == 1068 * MIB
    assert term.detail["reserved_delta"] == term.detail["allocated_delta"] == 4 * MIB
    outside, _ = mt.measure_delta("nccl.y", lambda: dev.alloc(2 * MIB, outside=10 * MIB), dev.probes(), how="",
                                   value=lambda d: d["used"] - d["reserved"])
    assert outside.value == 10 * MIB


def test_run_peaks_reports_allocator_peaks_used_and_fragmentation() -> None:
    dev = FakeDevice()
    dev.alloc(100 * MIB)  # weights
    dev.alloc(50 * MIB)
    dev.free(50 * MIB)  # a cached block from before: reset keeps it in reserved
    steps = []

    def step():
        dev.alloc(30 * MIB, outside=2 * MIB if not steps else 0)  # the first step opens something outside the allocator
        dev.free(30 * MIB)
        steps.append(1)

    got = mt.run_peaks(step, 3, dev.probes(), reset=dev.reset, peak_allocated=lambda: dev.peak_alloc,
                        peak_reserved=lambda: dev.peak_res)
    assert len(steps) == 3
    assert got["allocated_peak"] == 130 * MIB
    assert got["reserved_peak"] == 150 * MIB + 3 * 30 * MIB  # the fake never reuses its cache
    assert got["fragmentation"] == pytest.approx(240 / 130)
    assert got["used_after_each_step"][0] < got["used_after_each_step"][-1] == got["used_peak"]
    outside = 1000 * MIB + 2 * MIB  # used - reserved after the first step: the start's, and what it opened
    assert got["used_peak_bound"] == outside + got["reserved_peak"]
    with pytest.raises(ValueError, match=">= 1 step"):
        mt.run_peaks(step, 0, dev.probes(), reset=dev.reset, peak_allocated=lambda: 0, peak_reserved=lambda: 0)


def test_run_peaks_leaves_fragmentation_undefined_when_nothing_was_allocated() -> None:
    dev = FakeDevice()
    got = mt.run_peaks(lambda: None, 1, dev.probes(), reset=dev.reset, peak_allocated=lambda: 0, peak_reserved=lambda: 0)
    assert got["fragmentation"] is None and got["used_peak"] == 1000 * MIB


def test_fragmentation_above_the_held_state() -> None:
    """(reserved - held) / (allocated - held): 3 MiB held, 5 allocated above it, 6 reserved above it; none above: None."""
    from braid.measure.memory_terms import above_held

    assert above_held(9 * MIB, 8 * MIB, 3 * MIB) == 6 / 5
    assert above_held(9 * MIB, 3 * MIB, 3 * MIB) is None


def test_child_context_reads_used_before_the_child_and_while_it_holds_on(tmp_path) -> None:
    flag = tmp_path / "started"
    child = ("import sys, pathlib\n"
             f"pathlib.Path({str(flag)!r}).write_text('x')\n"
             "print(2097152, flush=True); sys.stdin.readline()\n")

    def used() -> int:  # 1 GiB more while the child lives (it wrote its flag)
        return (1 << 30) + (300 * MIB if flag.exists() else 0)

    delta, reserve = mt.child_context(used, [sys.executable, "-c", child], os.environ)
    assert (delta, reserve) == (300 * MIB, 2 * MIB)


def test_child_context_says_when_the_child_never_reports() -> None:
    with pytest.raises(RuntimeError, match="did not report"):
        mt.child_context(lambda: 0, [sys.executable, "-c", "import sys; sys.exit(3)"], os.environ, timeout_s=30)


def _args(*argv: str) -> argparse.Namespace:
    return bmt._parser().parse_args(list(argv))


def test_profile_config_defaults_to_tp_over_the_ranks_with_7b_layers() -> None:
    pc = bmt.profile_config(_args(), world=2)
    assert (pc.tp, pc.pp, pc.v, pc.seq, pc.dtype) == (2, 1, 2, 4096, "bfloat16")
    assert pc.layers_per_stage == (1, 1) and pc.model.hidden == 3584 and pc.model.vocab_size == 152064
    assert bmt.profile_config(_args("--vocab", "32768"), world=1).model.vocab_size == 32768
    assert bmt.profile_config(_args("--pp", "2", "--layers", "4"), world=2).tp == 1


@pytest.mark.parametrize("argv, world, says", [
    (("--tp", "1"), 2, "tp x pp = 1 x 1 must equal the 2 ranks"),
    (("--layers", "1"), 1, "2 virtual stages need a layer each"),
    (("--schedule", "nope"), 2, "unknown schedule 'nope'"),
    (("--steps", "0"), 2, "--steps must be >= 1"),
    (("--tp", "3", "--pp", "1"), 3, "tp=3 must divide"),
])
def test_profile_config_refuses_bad_layouts_in_one_line(argv, world, says) -> None:
    with pytest.raises(ValueError, match=says.replace("(", r"\(")) as err:
        bmt.profile_config(_args(*argv), world=world)
    assert "\n" not in str(err.value)


def test_table_shows_bytes_ratios_and_deltas() -> None:
    terms = [mt.Term("nccl.default_group", 96 * MIB, "around init", detail={"used_delta": 100 * MIB, "reserved_delta": 4 * MIB}),
             mt.Term("step.zb_v.eager.fragmentation", 1.25, "reserved / allocated", unit="ratio"),
             mt.Term("nccl.p2p_pair", None, "one rank: no peer")]
    lines = mt.table(1, "H100, cuda:1", terms).splitlines()
    assert lines[0] == "rank 1 (H100, cuda:1)" and "how" in lines[1]
    assert "96.0 MiB" in lines[2] and "100.0 MiB" in lines[2] and "4.0 MiB" in lines[2] and lines[2].endswith("around init")
    assert "1.250" in lines[3] and "n/a" in lines[4]


def test_document_orders_ranks_and_survives_json() -> None:
    every = [{"rank": r, "device": "H100", "device_index": r, "terms": [mt.Term("context.lazy", r * MIB, "child")]} for r in (1, 0)]
    doc = mt.document(every, command="torchrun --nproc-per-node 2 benchmarks/bench_memory_terms.py", versions={"torch": "x"},
                       env=mt.env_vars({"NCCL_BUFFSIZE": "4194304", "HOME": "h", "CUDA_MODULE_LOADING": "EAGER"}),
                       config={"seq": 4096}, partial=True)
    back = json.loads(json.dumps(doc))
    assert back["bench"] == "memory_terms" and back["partial"] is True
    assert [r["rank"] for r in back["ranks"]] == [0, 1]
    assert back["ranks"][1]["terms"] == [{"term": "context.lazy", "value": MIB, "how": "child", "unit": "B", "detail": {}}]
    assert back["env"] == {"CUDA_MODULE_LOADING": "EAGER", "NCCL_BUFFSIZE": "4194304"}


def test_inductor_terms_are_compiled_less_uncompiled() -> None:
    plain = [mt.Term("step.b.eager.uncompiled.reserved_peak", 100, ""), mt.Term("step.b.eager.uncompiled.allocated_peak", 80, ""),
             mt.Term("step.b.eager.uncompiled.nonallocator", 10, "")]
    comp = [mt.Term("step.b.eager.reserved_peak", 130, ""), mt.Term("step.b.eager.allocated_peak", 70, "")]
    got = {t.term: t.value for t in mt.inductor_terms(plain, comp)}
    assert got == {"inductor.reserved_peak_delta": 30, "inductor.allocated_peak_delta": -10, "inductor.nonallocator_delta": None}


def test_main_asks_for_torchrun_when_the_variables_are_missing(monkeypatch, capsys) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for var in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert bmt.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "launch it with torchrun" in err


class FakeNvml:
    """The few pynvml calls the script makes, on a node of GPUs by NVML index."""

    def __init__(self) -> None:
        self.inits = 0

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlDeviceGetHandleByIndex(self, i: int):
        return ("index", i)

    def nvmlDeviceGetHandleByUUID(self, uuid: str):
        return ("uuid", uuid)

    def nvmlDeviceGetPciInfo(self, handle):
        return type("Pci", (), {"busId": b"00000000:1B:00.0"})()


def test_nvml_handle_maps_cuda_numbers_through_cuda_visible_devices(monkeypatch) -> None:
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert mt.nvml_handle(1, {}) == ("index", 1)
    assert mt.nvml_handle(1, {"CUDA_VISIBLE_DEVICES": "3, 5"}) == ("index", 5)
    assert mt.nvml_handle(0, {"CUDA_VISIBLE_DEVICES": "GPU-abc,GPU-def"}) == ("uuid", "GPU-abc")
    assert mt.nvml_handle(2, {"CUDA_VISIBLE_DEVICES": "3,5"}) is None  # not visible: no NVML reading, no error
    assert mt.nvml_bus(("index", 1)) == 0x1B
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert mt.nvml_handle(0, {}) is None
