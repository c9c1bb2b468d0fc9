"""``--memory-snapshot``: the attribution of torch's memory snapshot (a dict built here in torch's
format: segments with blocks, a device trace of alloc/free entries with Python frames), its
command line, and the refusals on CPU. One GPU test records a real bench step."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from braid.measure.snapshot import (BACKWARD, BEFORE, BEFORE_STEP, EXPANDABLE, GRAPH_POOL, OTHER, SEGMENT_BEFORE, STATE,
                                    attribute, by_stack, classify, format_attribution, idle_reserve, main, rank_path)

ROOT = Path(__file__).resolve().parent.parent
MODELS, RUNTIME = str(ROOT / "braid" / "models"), str(ROOT / "braid" / "runtime")
TORCH = str(Path(torch.__file__).parent)


def _fr(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


# Innermost frame first, as torch records them.
QKV = [_fr(f"{TORCH}/nn/functional.py", 10, "linear"), _fr(f"{MODELS}/qwen2.py", 266, "project_qkv"),
       _fr(f"{MODELS}/qwen2.py", 262, "qkv"), _fr(f"{MODELS}/chunk.py", 393, "_forward"),
       _fr(f"{RUNTIME}/executor.py", 420, "_run_steps")]
LOSS = [_fr(f"{MODELS}/chunk.py", 362, "_loss"), _fr(f"{MODELS}/chunk.py", 390, "_forward"),
        _fr(f"{RUNTIME}/executor.py", 420, "_run_steps")]
RECV = [_fr(f"{TORCH}/functional.py", 5, "empty"), _fr(f"{RUNTIME}/p2p.py", 77, "recv_buffer"),
        _fr(f"{RUNTIME}/executor.py", 300, "run")]
SCRIPT = [_fr(f"{TORCH}/nn/functional.py", 10, "linear"), _fr("/opt/jobs/my_script.py", 12, "main")]


def _snapshot() -> dict:
    """Before the trace: weights (1000 B, labelled) and a graph pool block (500 B) live throughout, and a
    100 B block the trace frees. Then: qkv 300, loss 200, the old block freed, a backward op 400, a
    receive buffer 50 (the peak: 2450 B at entry 5), qkv freed, a script's 100."""
    trace = [
        {"action": "alloc", "addr": 0x3000, "size": 300, "frames": QKV, "stream": 0},
        {"action": "alloc", "addr": 0x4000, "size": 200, "frames": LOSS, "stream": 0},
        {"action": "free_requested", "addr": 0x5000, "size": 100, "frames": LOSS, "stream": 0},
        {"action": "free_completed", "addr": 0x5000, "size": 100, "frames": [], "stream": 0},
        {"action": "alloc", "addr": 0x6000, "size": 400, "frames": [], "stream": 0},
        {"action": "alloc", "addr": 0x7000, "size": 50, "frames": RECV, "stream": 0},
        {"action": "free_requested", "addr": 0x3000, "size": 300, "frames": [], "stream": 0},
        {"action": "free_completed", "addr": 0x3000, "size": 300, "frames": [], "stream": 0},
        {"action": "segment_alloc", "addr": 0x9000, "size": 4096, "frames": SCRIPT, "stream": 0},
        {"action": "alloc", "addr": 0x8000, "size": 100, "frames": SCRIPT, "stream": 0},
    ]
    live = {"state": "active_allocated", "frames": []}
    segments = [
        {"device": 1, "address": 0x1000, "total_size": 1 << 20, "segment_pool_id": (0, 0),
         "blocks": [{"address": 0x1000, "size": 1000, **live}, {"address": 0x3000, "size": 300, "state": "inactive", "frames": []},
                    {"address": 0x4000, "size": 200, **live}]},
        {"device": 1, "address": 0x2000, "total_size": 1 << 20, "segment_pool_id": (1, 0),
         "blocks": [{"address": 0x2000, "size": 500, **live}]},
        {"device": 0, "address": 0xA000, "total_size": 1 << 20, "segment_pool_id": (0, 0),  # another device: not counted
         "blocks": [{"address": 0xA000, "size": 7777, **live}]},
    ]
    # 0x3000's label was read after the step, when the block held something else: it must not stick
    labels = {0x1000: "weights", 0x3000: "gradients"}
    return {"segments": segments, "device_traces": [[], trace], "braid_labels": labels}


def test_attribute_finds_the_peak_and_groups_the_blocks_live_then() -> None:
    att = attribute(_snapshot(), top=10)
    assert (att.device, att.peak_bytes, att.peak_index, att.entries) == (1, 2450, 5, 10)
    got = {(r.kind, r.term): (r.bytes, r.count, r.unit) for r in att.rows}
    assert got == {
        (STATE, "weights"): (1000, 1, None),
        (BEFORE, "CUDA graph pool"): (500, 1, None),
        (BACKWARD, "autograd backward op (no Python frame)"): (400, 1, None),
        ("model", "qwen2.py:266 project_qkv"): (300, 1, "pre_attn"),  # the unit from the nearest model function naming one
        ("model", "chunk.py:362 _loss"): (200, 1, "head"),
        ("runtime", "p2p.py:77 recv_buffer"): (50, 1, None),
    }
    assert sum(r.bytes for r in att.rows) == att.peak_bytes
    assert [r.bytes for r in att.rows] == sorted((r.bytes for r in att.rows), reverse=True)
    assert att.by_kind == {STATE: 1000, "model": 500, BEFORE: 500, BACKWARD: 400, "runtime": 50}
    assert att.by_unit == {"pre_attn": 300, "head": 200}
    assert [r.term for r in attribute(_snapshot(), top=2).rows] == ["weights", "CUDA graph pool"]


def test_idle_reserve_charges_each_segments_free_bytes_to_the_allocation_that_made_it() -> None:
    """Segments of device 1 beside the ones above: the script's (made in the trace, 4096 B, 100 live), a second the
    script made and the trace freed again (gone), one a qkv allocation made (2048 B, none live), and an expandable
    one (6144 B, 1024 still used by another stream)."""
    snap = _snapshot()
    trace = snap["device_traces"][1]
    trace += [{"action": "segment_alloc", "addr": 0xB000, "size": 2048, "frames": QKV, "stream": 0},
              {"action": "segment_alloc", "addr": 0xC000, "size": 8192, "frames": SCRIPT, "stream": 0},
              {"action": "segment_free", "addr": 0xC000, "size": 8192, "frames": [], "stream": 0}]
    live = {"state": "active_allocated", "frames": []}
    snap["segments"] += [
        {"device": 1, "address": 0x9000, "total_size": 4096, "segment_pool_id": (0, 0),
         "blocks": [{"address": 0x8000, "size": 100, **live}, {"address": 0x8064, "size": 3996, "state": "inactive"}]},
        {"device": 1, "address": 0xB000, "total_size": 2048, "segment_pool_id": (0, 0),
         "blocks": [{"address": 0xB000, "size": 2048, "state": "inactive"}]},
        # expandable: no segment_alloc names it; a block another stream still uses is not free
        {"device": 1, "address": 0xD000, "total_size": 6144, "segment_pool_id": (0, 0), "is_expandable": True,
         "blocks": [{"address": 0xD000, "size": 1024, "state": "active_pending_free"},
                    {"address": 0xD400, "size": 5120, "state": "inactive"}]},
    ]
    reserved, idle, rows = idle_reserve(snap)
    got = {(r.kind, r.term): (r.reserved, r.idle, r.count) for r in rows}
    assert got == {
        (BEFORE, SEGMENT_BEFORE): (1 << 20, (1 << 20) - 1200, 1),  # weights 1000 and the loss's 200 live in it
        (BEFORE, GRAPH_POOL): (1 << 20, (1 << 20) - 500, 1),
        (OTHER, "my_script.py:12 main"): (4096, 3996, 1),
        ("model", "qwen2.py:266 project_qkv"): (2048, 2048, 1),
        (OTHER, EXPANDABLE): (6144, 5120, 1),
    }
    assert (reserved, idle) == (sum(v[0] for v in got.values()), sum(v[1] for v in got.values()))
    assert [r.idle for r in rows] == sorted((r.idle for r in rows), reverse=True)
    att = attribute(snap, top=2)
    assert (att.reserved_bytes, att.idle_bytes, len(att.idle)) == (reserved, idle, 2)
    text = "\n".join(format_attribution(att))
    assert f"reserve when the trace ends: {reserved / 2**20:,.1f} MiB" in text and SEGMENT_BEFORE in text
    from dataclasses import asdict

    assert format_attribution(asdict(att)) == format_attribution(att)  # the dict form a bench job gathers


def test_a_block_freed_first_by_the_trace_counts_from_its_start() -> None:
    snap = _snapshot()
    snap["device_traces"][1] = snap["device_traces"][1][2:4]  # only the free of the block allocated before
    att = attribute(snap)
    assert (att.peak_bytes, att.peak_index) == (1000 + 500 + 200 + 100, -1)
    assert {r.term: r.bytes for r in att.rows}["allocated before the step"] == 100 + 200  # 0x4000 untouched by this trace


def test_classify_names_other_code_by_its_innermost_frame_outside_torch() -> None:
    assert classify(SCRIPT)[:3] == (OTHER, "my_script.py:12 main", None)
    assert classify(RECV)[0] == "runtime"
    assert classify(QKV)[0] == "model"  # the model frame is inner to the executor's


def test_record_step_records_one_step_and_stops_recording_even_when_it_fails(tmp_path, monkeypatch) -> None:
    """The CUDA calls stood in for (this machine may have no GPU); the arguments are bound to torch's own
    signature of ``_record_memory_history``, so a keyword this torch does not take fails here."""
    import contextlib
    import inspect

    from braid.measure import snapshot as snapmod

    mem = torch.cuda.memory
    sig = inspect.signature(mem._record_memory_history)
    calls: list[dict] = []

    def record(*args, **kwargs):
        calls.append(sig.bind(*args, **kwargs).arguments)

    monkeypatch.setattr(mem, "_record_memory_history", record)
    monkeypatch.setattr(mem, "_snapshot", lambda *a, **k: {k2: v for k2, v in _snapshot().items() if k2 != "braid_labels"})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    steps = []
    f = tmp_path / "s.pickle"
    att = snapmod.record_step(lambda: steps.append(1), f, "cuda:1", labels=lambda: {0x1000: "weights"})
    assert steps == [1] and [c.get("enabled") for c in calls] == ["all", None]
    assert calls[0]["stacks"] == "python" and calls[0]["clear_history"] is True
    saved = pickle.loads(f.read_bytes())
    assert saved["braid_labels"] == {0x1000: "weights"} and saved["device_traces"][1]
    assert (att.device, att.peak_bytes) == (1, 2450)

    def fails():
        raise RuntimeError("out of memory")

    calls.clear()
    with pytest.raises(RuntimeError):
        snapmod.record_step(fails, tmp_path / "t.pickle", "cuda:1")
    assert [c.get("enabled") for c in calls] == ["all", None] and not (tmp_path / "t.pickle").exists()
    with pytest.raises(ValueError, match="not CUDA"):
        snapmod.record_step(fails, tmp_path / "t.pickle", "cpu")


def test_the_labels_find_an_optimizers_tensors_in_its_attributes_and_state() -> None:
    from braid.measure.snapshot import _tensors_in

    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w])
    w.grad = torch.ones(3)
    opt.step()

    class Wrapper:  # as an example loop's optimisation object holds a torch optimizer and buffers of its own
        def __init__(self) -> None:
            self.opt, self.master, self.names, self.model = opt, [torch.zeros(2)], "abc", torch.nn.Linear(2, 2)

    held = Wrapper()
    got = {id(t) for t in _tensors_in(held, torch, set(), 6)}
    assert {id(opt.state[w]["exp_avg"]), id(opt.state[w]["exp_avg_sq"]), id(held.master[0])} <= got
    assert not {id(p) for p in held.model.parameters()} & got  # modules are not walked


def test_rank_path_names_one_file_per_rank() -> None:
    assert rank_path("out/snap.pickle", 0, 1) == Path("out/snap.pickle")
    assert rank_path("out/snap.pickle", 1, 2) == Path("out/snap.rank1.pickle")
    assert rank_path("snap", 3, 4) == Path("snap.rank3.pickle")


def test_the_cli_prints_the_attribution_of_a_saved_snapshot(tmp_path, capsys) -> None:
    f = tmp_path / "s.pickle"
    f.write_bytes(pickle.dumps(_snapshot()))
    assert main([str(f), "--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{f}: peak 0.0 MiB allocated on cuda:1, at entry 5 of 10")
    assert [line[47:] for line in out[4:7]] == ["weights", "CUDA graph pool", "autograd backward op (no Python frame)"]
    assert out[7].startswith("  reserve when the trace ends: 2.0 MiB") and [x[41:] for x in out[9:]] == [GRAPH_POOL, SEGMENT_BEFORE]
    assert format_attribution(attribute(_snapshot()))[1].startswith("  by kind: state 0.0 MiB (41%)")


def test_by_stack_groups_the_peaks_blocks_by_their_call_paths_in_braid(tmp_path, capsys) -> None:
    """The blocks live at the peak of :func:`_snapshot` by their innermost braid frames (torch's and a script's left out)."""
    assert by_stack(_snapshot(), 2) == [
        (1000, 1, BEFORE_STEP), (500, 1, GRAPH_POOL), (400, 1, "(no braid frame)"),
        (300, 1, "models/qwen2.py:266 project_qkv < models/qwen2.py:262 qkv"),
        (200, 1, "models/chunk.py:362 _loss < models/chunk.py:390 _forward"),
        (50, 1, "runtime/p2p.py:77 recv_buffer < runtime/executor.py:300 run")]
    assert by_stack(_snapshot(), 1, top=4)[3] == (300, 1, "models/qwen2.py:266 project_qkv")
    f = tmp_path / "s.pickle"
    f.write_bytes(pickle.dumps(_snapshot()))
    assert main([str(f), "--stacks", "1", "--top", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-5] == "live at the peak by braid's innermost 1 frames (MiB, blocks):"
    assert out[-1].endswith("1  models/qwen2.py:266 project_qkv")
    for bad in ("-1", "65"):
        with pytest.raises(SystemExit) as err:
            main([str(f), "--stacks", bad])
        assert err.value.code == 2 and f"--stacks {bad}: 0 to 64 frames" in capsys.readouterr().err


@pytest.mark.parametrize("content, fragment", [(None, "No such file"), (b"not a pickle", "not a snapshot pickle"),
                                               (pickle.dumps([1]), "not a torch memory snapshot"),
                                               (pickle.dumps({"segments": [], "device_traces": [[]]}), "no allocator trace")])
def test_the_cli_refuses_a_bad_file_in_one_line(tmp_path, content, fragment) -> None:
    f = tmp_path / "s.pickle"
    if content is not None:
        f.write_bytes(content)
    out = subprocess.run([sys.executable, "-m", "braid.measure.snapshot", str(f)], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1, out.stderr
    assert err[0].startswith("python -m braid.measure.snapshot: error: ") and fragment in err[0], err[0]


def test_bench_refuses_a_memory_snapshot_on_cpu(tmp_path, capsys) -> None:
    from braid.bench import main as bench

    with pytest.raises(SystemExit) as ex:
        bench(["--device", "cpu", "--memory-snapshot", str(tmp_path / "s.pickle")])
    assert ex.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--memory-snapshot records the CUDA caching allocator" in err[0], err
    assert not list(tmp_path.iterdir())


def test_the_training_script_refuses_a_memory_snapshot_on_cpu(tmp_path, qwen2_main, capsys) -> None:
    code = qwen2_main(["--device", "cpu", "--steps", "1", "--memory-snapshot", str(tmp_path / "s.pickle")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--memory-snapshot records the CUDA caching allocator" in err[0], err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("flags, fragment", [
    (["--steps", "2", "--profile-step", "3"],
     "--profile-step must be a step of the run (1..--steps=2) and needs --profile DIR or --memory-snapshot"),
    (["--schedule", "braided_v", "zb_v"], "--memory-snapshot take one --schedule"),
    (["--metrics", "SNAP"], "is also an input"),  # two outputs of one name
])
def test_the_training_script_checks_memory_snapshot_combinations_first(tmp_path, qwen2_main, capsys, monkeypatch, flags,
                                                                       fragment) -> None:
    """As on a CUDA machine (the device is only asked whether it exists): one line, exit 2, before any work."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    snap = str(tmp_path / "s.pickle")
    code = qwen2_main(["--device", "cuda", "--memory-snapshot", snap, *[snap if f == "SNAP" else f for f in flags]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and fragment in err[0], err
    assert not list(tmp_path.iterdir())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_recorded_bench_step_names_a_braid_unit(tmp_path) -> None:
    """One rank, one small run: the snapshot file is written and the live blocks at its peak include a model unit."""
    from braid.measure.config import BenchConfig, ProfileConfig, PRESETS
    from braid.measure.runs import run_bench

    pc = ProfileConfig(PRESETS["tiny"], (1, 1), seq=64, pp=1, v=2, device="cuda", dtype="bfloat16", compile=False)
    f = tmp_path / "s.pickle"
    bc = BenchConfig(pc, ("1f1b_i",), (2,), warmup=1, steps=1, external=False, calibrate=False, cuda_graph="none",
                     memory_snapshot=str(f))
    shot = run_bench(bc)["memory_snapshot"]
    assert f.stat().st_size > 0 and shot["schedule"] == "1f1b_i" and shot["m"] == 2
    (att,) = shot["ranks"]
    assert att["peak_bytes"] > 0 and att["by_kind"].get("model", 0) > 0
    assert any(r["unit"] in ("pre_attn", "attn", "pre_mlp", "mlp", "head", "embed") for r in att["rows"]), att["rows"]
