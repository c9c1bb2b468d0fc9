"""The example training scripts, launched as a user would (torchrun or plain python, gloo on CPU).

Runs that check what training computes start their processes through the session's fork server
(``forkserver.py``: forked, not new interpreters); the launch itself -- exit codes and one-line errors
from a new interpreter, torchrun's summary -- is checked with real interpreters, here and in
``test_train_faults.py``.

* ``qwen2_vl.py`` under ``braided_v`` with tp=2, pp=2 (4 processes) gives the same per-step
  losses as one process (tp=1, pp=1), and writes metrics and a merged 4-rank trace;
* save after step 2 of 4 and resume: steps 3-4 reproduce the uninterrupted run's losses
  exactly (same layout, same arithmetic);
* bad flags and impossible layouts exit with code 2 and one line, also under torchrun;
* ``qwen2.py`` runs with pp=2.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from braid.io.trace import load_traces
from forkserver import shared_bin

ROOT = Path(__file__).resolve().parent.parent
VLM = str(ROOT / "examples" / "qwen2_vl.py")
LLM = str(ROOT / "examples" / "qwen2.py")
# Losses of a 4-rank TP/PP run vs one process: the same fp32 sums in another order
# (TP partial sums, gradient all-reduces) over 3 AdamW steps.
LOSS_RTOL = 1e-4
COMMON = ["--model", "tiny", "--mbs", "4", "--micro-batch-size", "2", "--seed", "1", "--device", "cpu"]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _python(*args: str, timeout: float = 180, forked: bool = False) -> subprocess.CompletedProcess:
    """``python ARGS`` in the checkout. ``forked``: a process forked from the session's fork server
    (``forkserver.py``: the same arguments, environment, output and exit code, without an interpreter
    start-up), for runs whose launch is not what the test checks."""
    exe = str(shared_bin() / "python") if forked else sys.executable
    return subprocess.run([exe, *args], env=_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _torchrun(n: int, *args: str, timeout: float = 240, forked: bool = False) -> subprocess.CompletedProcess:
    """``torchrun`` on ``n`` local ranks; ``forked``: the agent and its workers forked from the fork server."""
    if forked:
        return subprocess.run([str(shared_bin() / "torchrun"), "--nproc-per-node", str(n), "--standalone", *args], env=_env(),
                              capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return _python("-m", "torch.distributed.run", "--nproc-per-node", str(n), "--standalone", *args, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _in_process(script: str, args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """``script``'s main run in this process, as one process (no RANK/WORLD_SIZE): (exit code, stdout, stderr).
    For what the scripts check before any work; the subprocess cases show the exit path end to end."""
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    mod = importlib.import_module(Path(script).stem)
    capsys.readouterr()
    try:
        rc = mod.main(mod.TASK, list(args))
    except SystemExit as err:  # argparse's own errors and --help
        rc = err.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """One process, tp=1, pp=1, 4 steps: the run the others are compared with."""
    out = tmp_path_factory.mktemp("ref") / "m.jsonl"
    _ok(_python(VLM, *COMMON, "--schedule", "braided_v", "--steps", "4", "--metrics", str(out), forked=True))
    return _metrics(out)


def test_vlm_tp2_pp2_braided_matches_single_process(reference, tmp_path) -> None:
    metrics, trace = tmp_path / "m.jsonl", tmp_path / "t.json"
    _ok(_torchrun(4, VLM, *COMMON, "--schedule", "braided_v", "--tp", "2", "--pp", "2", "--steps", "3",
                  "--metrics", str(metrics), "--trace", str(trace), forked=True))
    got = _metrics(metrics)
    assert [m["step"] for m in got] == [1, 2, 3]
    for m, ref in zip(got, reference):
        assert math.isclose(m["loss"], ref["loss"], rel_tol=LOSS_RTOL), (m["step"], m["loss"], ref["loss"])
        assert m["samples_per_s"] > 0 and m["tokens_per_s"] == pytest.approx(m["samples_per_s"] * (6 + 16))  # image: start, 4 pads, end
        assert len(m["peak_memory_bytes"]) == 4 and min(m["peak_memory_bytes"]) > 0
        assert (m["tp"], m["pp"], m["dp"], m["schedule"]) == (2, 2, 1, "braided_v") and m["mfu"] == 0.0
    (tr,) = load_traces(trace)
    assert tr.ranks == [0, 1, 2, 3]
    assert {e.lane for e in tr.events} >= {"compute", "tp-comm", "p2p"}
    assert any(e.unit == "merge" for e in tr.events)  # the vision stage's merge unit ran
    assert sum(e.kind == "F" for e in tr.events) > 0 and all(tr.memory[r] for r in range(4))


def test_loss_falls(reference) -> None:
    losses = [m["loss"] for m in reference]
    assert losses[-1] < losses[0]


def test_resume_continues_with_the_same_losses(reference, tmp_path) -> None:
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _ok(_python(VLM, *COMMON, "--schedule", "braided_v", "--steps", "2", "--save", str(ckpt), "--metrics", str(first),
                forked=True))
    proc = _python(VLM, *COMMON, "--schedule", "braided_v", "--steps", "4", "--resume", str(ckpt), "--metrics", str(second),
                   forked=True)
    _ok(proc)
    assert "resumed" in proc.stderr and "at step 2" in proc.stderr
    got = _metrics(first) + _metrics(second)
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    assert [m["loss"] for m in got] == [m["loss"] for m in reference]  # exact: same layout, same arithmetic


BAD_FLAGS = [
    (["--tp", "3"], "world size 1 != dp*pp*cp*tp"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--schedule", "1f1b"], "at least 2 virtual stages"),
    (["--image-size", "18"], "multiple of patch"),
    (["--schedule", "braided_v", "pipedream"], "--schedule pipedream: unknown; valid:"),
    (["--schedule", "zb_v", "zb_v"], "names a schedule twice"),
    (["--schedule", "zb_v", "1f1b_i", "--trace", "t.json"], "take one --schedule"),
    (["--schedule", "torch_zb_v", "--dp", "1", "--cp", "1", "--save", "ckpt"], "checkpoint braid's schedules"),
    (["--last-stage-lighter", "0.5"], "the VLM's stages hold whole layers"),
    (["--image-sizes", "8,12"], "--image-sizes 12: every image side must be a positive multiple of patch*merge"),
]


def test_bad_flags_exit_2_with_one_line_from_the_script() -> None:
    """One bad flag (a check of braid's, then one of argparse's) through the script as a user runs it: exit
    code 2 and one line on stderr; the other flags' checks run in this process below, through the same main."""
    for args, message in BAD_FLAGS[:2]:
        proc = _python(VLM, *args)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("qwen2_vl.py: error:") and message in lines[0], proc.stderr


@pytest.mark.parametrize("args,message", BAD_FLAGS)
def test_bad_flags_exit_2_with_one_line(args: list[str], message: str, monkeypatch, capsys) -> None:
    rc, out, err = _in_process(VLM, args, monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("qwen2_vl.py: error:") and message in lines[0], err


@pytest.mark.parametrize("args,message", [
    (["--image-sizes", ","], "--image-sizes is empty"),
    (["--image-sizes", "8,big"], "give image sides as integers"),
    (["--image-sizes", "8,32", "--visual-token-budget", "16"], "--visual-token-budget 16: micro-batch"),
    (["--image-sizes", "8,32", "--image-size", "16"], "give one of them"),
    (["--visual-token-budget", "9"], "it needs --image-sizes"),
])
def test_image_size_flags_exit_2_with_one_line(args: list[str], message: str, monkeypatch, capsys) -> None:
    """The rest of --image-sizes' checks, in this process (the subprocess case above shows the exit path end to end)."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import qwen2_vl

    try:
        rc = qwen2_vl.main(qwen2_vl.TASK, args)
    except SystemExit as err:  # argparse's own errors
        rc = err.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("qwen2_vl.py: error:") and message in lines[0], lines


def test_images_of_several_sizes_train_padded_as_the_unpadded_model(tmp_path) -> None:
    """--image-sizes: micro-batches padded to one visual-token budget under tp=2 x pp=2 give the unsplit,
    unpadded model's losses (--reference); the start-up line reports the budget and the padding share."""
    metrics = tmp_path / "m.jsonl"
    proc = _torchrun(4, VLM, *COMMON, "--model", "qwen2.5-vl-tiny", "--image-sizes", "16,24,32", "--tp", "2", "--pp", "2",
                     "--steps", "2", "--reference", "--metrics", str(metrics), forked=True)
    _ok(proc)
    line = next(x for x in proc.stderr.splitlines() if x.startswith("dynamic resolution:"))
    # budget: 2 samples x 16 tokens (32 px); images of 4, 9 or 16 tokens drawn with equal odds
    assert "3 image sizes (16, 24, 32 px)" in line and "visual-token budget 32 per micro-batch" in line
    share = float(line.split("padding ")[1].split("%")[0])
    assert 0.0 < share < 100.0 and "over the run's 8 micro-batches" in line
    assert [m["step"] for m in _metrics(metrics)] == [1, 2]


def test_schedules_side_by_side_with_torch_baselines_match_the_unsplit_model(tmp_path) -> None:
    """One invocation, tp=2 x pp=2: braid's schedules (offload included) and torch.distributed.pipelining's,
    each from the same weights and data, every per-step loss within 1e-4 of the unsplit model (--reference)."""
    names = ["braided_v_offload", "zb_v", "torch_1f1b_i", "torch_dualpipe_v"]
    metrics = tmp_path / "m.jsonl"
    proc = _torchrun(4, VLM, *COMMON, "--tp", "2", "--pp", "2", "--steps", "2", "--reference", "--metrics", str(metrics),
                     "--schedule", *names, forked=True)
    _ok(proc)
    got = _metrics(metrics)
    assert [m["schedule"] for m in got] == [n for n in names for _ in range(2)]
    table = proc.stdout
    assert "max rel diff" in table and "reference (unsplit model on one device)" in table
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line.split() and line.split()[0] in names}
    assert sorted(rows) == sorted(names)
    for name, row in rows.items():
        assert float(row[5]) <= 1e-4, (name, row)  # max relative loss difference vs the reference
    by_step = {}
    for m in got:
        by_step.setdefault(m["step"], []).append(m["loss"])
    for losses in by_step.values():
        assert max(losses) - min(losses) <= 1e-4 * max(losses)


def test_reference_beyond_tolerance_exits_1() -> None:
    """Unit-split backward sums gradients in another order than the unsplit model: ~1e-8 apart, not 0."""
    proc = _python(LLM, *COMMON, "--steps", "1", "--reference", "--reference-rtol", "0", "--schedule", "zb_v", "--seq", "16",
                   forked=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "losses differ from the unsplit model by more than 0e+00: zb_v" in proc.stderr


def _torchrun_summary_reads(out: str, line: str, world: int, code: int = 2) -> None:
    """What a user sees when every rank of a torchrun job meets the same failure: ``line`` printed
    once by the ranks, no worker traceback, every rank exiting with ``code`` (none stopped by the
    agent with a SIGTERM), and torchrun's summary giving ``line`` as the root cause (each rank's error file)."""
    printed = [ln for ln in out.splitlines() if ln.startswith(line.split(":")[0] + ": error:")]
    assert len(printed) == 1 and printed[0].startswith(line), out[-3000:]
    assert "[rank0]" not in out and "[rank1]" not in out and "(SIGTERM)" not in out, out[-3000:]
    assert out.count(f"exitcode  : {code} ") == world, out[-3000:]
    root = out.split("Root Cause (first observed failure):", 1)[1]
    assert f"traceback : {line}" in root and "To enable traceback" not in out, out[-3000:]


def test_impossible_layout_under_torchrun_stops_every_rank() -> None:
    proc = _torchrun(2, VLM, "--tp", "4", timeout=120)  # a hang would hit the timeout
    assert proc.returncode != 0
    _torchrun_summary_reads(proc.stdout + proc.stderr, "qwen2_vl.py: error: world size 2 != dp*pp*cp*tp", 2)


def test_help_reads_like_documentation(monkeypatch, capsys) -> None:
    rc, out, _ = _in_process(VLM, ["--help"], monkeypatch, capsys)
    assert rc == 0
    for flag in ("--schedule", "--tp", "--pp", "--dp", "--mbs", "--micro-batch-size", "--seq", "--image-size", "--steps",
                 "--model", "--lr", "--seed", "--device", "--metrics", "--trace", "--save", "--resume", "torchrun"):
        assert flag in out, flag


def test_llm_example_pp2(tmp_path) -> None:
    metrics = tmp_path / "m.jsonl"
    _ok(_torchrun(2, LLM, "--pp", "2", "--schedule", "zb_v", "--steps", "2", "--seq", "16", "--metrics", str(metrics),
                  forked=True))
    got = _metrics(metrics)
    assert [m["step"] for m in got] == [1, 2]
    assert all(math.isfinite(m["loss"]) and m["loss"] > 0 for m in got)
    assert len(got[0]["peak_memory_bytes"]) == 2


def test_llm_example_half_layer_cut_matches_single_process() -> None:
    # --last-stage-lighter 0.5: stage 2 ends with layer 3's attention, stage 3 starts with its MLP;
    # --reference exits 1 when a loss leaves the unsplit model's tolerance.
    proc = _torchrun(2, LLM, *COMMON, "--pp", "2", "--schedule", "zb_v", "braided_v", "--last-stage-lighter", "0.5",
                     "--steps", "2", "--seq", "16", "--reference", forked=True)
    _ok(proc)
    out = proc.stdout + proc.stderr
    assert out.count("4 virtual stages of [1, 1, 1.5, 0.5] layers") == 2, out[-3000:]


@pytest.mark.parametrize("args,message", [
    (["--last-stage-lighter", "0.3"], "not a whole or half number of layers >= 0: '0.3'"),
    (["--last-stage-lighter", "0.5", "--recompute", "full"], "re-runs whole layers"),
    (["--pp", "2", "--schedule", "torch_1f1b_i", "--last-stage-lighter", "0.5"], "split whole layers"),
])
def test_bad_half_layer_flags_exit_2(args: list[str], message: str, monkeypatch, capsys) -> None:
    """One process: in this process (checks made before any work); two: under torchrun."""
    if "--pp" in args:
        proc = _torchrun(2, LLM, "--model", "tiny", "--device", "cpu", "--steps", "1", *args)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
        return
    rc, _, err = _in_process(LLM, ["--model", "tiny", "--device", "cpu", "--steps", "1", *args], monkeypatch, capsys)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_llm_example_sequence_parallel_matches_single_process(tmp_path) -> None:
    """--cp 2 (LoongTrain 2D-Attention, here a context-parallel ring of 2) gives the single-process losses."""
    common = ["--steps", "2", "--seq", "16", "--mbs", "2", "--schedule", "1f1b"]
    ref, sp = tmp_path / "ref.jsonl", tmp_path / "sp.jsonl"
    _ok(_python(LLM, *common, "--metrics", str(ref), forked=True))
    _ok(_torchrun(2, LLM, *common, "--cp", "2", "--metrics", str(sp), forked=True))
    want, got = [m["loss"] for m in _metrics(ref)], [m["loss"] for m in _metrics(sp)]
    assert got == pytest.approx(want, rel=LOSS_RTOL)


@pytest.mark.parametrize("args,message", [
    (["--cp", "2", "--hp", "3"], "--hp 3 must divide --cp 2"),
    (["--hp", "2"], "--hp and --ring-size need --cp > 1"),
])
def test_bad_sequence_parallel_flags_exit_2(args: list[str], message: str, monkeypatch, capsys) -> None:
    rc, _, err = _in_process(LLM, args, monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and message in lines[0], err


def test_vlm_rejects_sequence_parallel_with_a_clear_error(monkeypatch, capsys) -> None:
    rc, _, err = _in_process(VLM, ["--cp", "2"], monkeypatch, capsys)
    assert rc == 2 and "not supported by the vision-language example" in err, err
