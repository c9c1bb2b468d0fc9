"""Every script under ``benchmarks/`` runs at its tiniest size on CPU, so none breaks unnoticed.

:data:`RUNS` names each script's smallest invocation, run here; a script another test already
runs end to end at its tiny size names that test instead (:data:`ELSEWHERE`); a script that
needs GPUs refuses in one line with exit code 2. A new script must be added to one of them.
Scripts that start process groups or spawn ranks run as a process of their own (forked from the
session's fork server, ``forkserver.py``), the rest in this process through their ``main(argv)``.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
RESULTS = "benchmarks/results/"

# script -> (argv, run as a subprocess?, a line its output must hold); {tmp}: the test's own directory
RUNS: dict[str, tuple[list[str], bool, str]] = {
    "bench_attention2d.py": (["--device", "cpu", "--tiny", "--seqs", "64", "--iters", "1", "--warmup", "0"], True, "HP2"),
    "bench_held_bytes.py": (["--preset", "tiny", "--seq", "16", "--mbs", "3", "--json", "{tmp}/held.json"], True,
                           "points where braided_v holds more than zb_v: 0"),
    "bench_executor_overhead.py": (["--m", "2", "--layers", "1", "--steps", "1", "--warmup", "0", "--json", "{tmp}/o.json"],
                                   True, "cut record=off"),
    "bench_compile.py": (["--tiny"], False, "braided_v"),
    "bench_simulator.py": (["--tiny"], False, "all schedules simulated"),
    "clocks_by_run.py": ([RESULTS + "bench_h200x2_tp1_pp2_graphed_probe2p_clocks.json",
                          RESULTS + "smi_h200x2_tp1_pp2_probe2p.csv.gz"], False, "zb_v"),
    "compare_kernels.py": ([RESULTS + "kernels_small_h200x2_tp1_pp2.json", "--m", "8", "--rows", "3"], False,
                           "sum of the kernels listed"),
    "recalibrate_stored.py": ([RESULTS + "bench_7b_h100x2_tp2_pp1_graphs.json"], False, "re-fitted: median |error|"),
    "render_results.py": (["--check"], False, ""),
    "resplit_search.py": ([RESULTS + "bench_7b_h100x4_tp2_pp2.json", "--top", "3"], False, "splits of 4 layers over 4 stages"),
}
# script -> the test that runs it at its tiny size (the test's file must name the script)
ELSEWHERE = {
    "bench_braided_overlap.py": "tests/test_acceptance.py",  # --cpu-smoke runs it with --tiny
    "bench_executor_limit.py": "tests/test_bench_executor_limit.py",
    "bench_memory.py": "tests/test_bench_memory.py",
    "bench_offload.py": "tests/test_offload_runtime.py",  # measure() and report() of --tiny
}
GPU_ONLY = {"graph_smoke.py": "needs 2 CUDA devices",
            "bench_attention_layout.py": "needs a CUDA device",
            "bench_memory_terms.py": "needs CUDA devices",
            "plan_fits.py": "needs 2 CUDA devices",
            "bench_p2p_capture.py": "needs 2 CUDA devices",
            "probe_capture_stream_reuse.py": "needs a CUDA device"}  # the one line it refuses with on CPU
HELPERS = {"_spawn.py"}  # imported by the scripts, not run


def test_every_script_is_run_somewhere() -> None:
    scripts = {p.name for p in BENCH.glob("*.py")} - HELPERS
    listed = [*RUNS, *ELSEWHERE, *GPU_ONLY]
    assert sorted(listed) == sorted(scripts), "add the new script's tiniest run to tests/test_benchmark_scripts.py"
    for script, test in ELSEWHERE.items():
        assert script.removesuffix(".py") in (ROOT / test).read_text(), (script, test)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", sorted(RUNS))
def test_script_runs_at_its_tiniest_size(script, monkeypatch, capsys, tmp_path) -> None:
    argv, subproc, says = RUNS[script]
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if subproc:
        from forkserver import shared_bin

        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        proc = subprocess.run([str(shared_bin() / "python"), str(BENCH / script), *argv], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=110)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        out = proc.stdout
    else:
        monkeypatch.chdir(ROOT)
        monkeypatch.syspath_prepend(str(BENCH))
        rc = importlib.import_module(script.removesuffix(".py")).main(argv)
        out = capsys.readouterr().out
        assert rc in (0, None), out
    assert says in out, out[-2000:]
    for written in (a for a in argv if a.startswith(str(tmp_path))):
        assert Path(written).stat().st_size > 0, written


@pytest.mark.parametrize("script", sorted(GPU_ONLY))
def test_gpu_only_script_refuses_in_one_line_without_gpus(script, monkeypatch, capsys) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # as on a CPU machine, whatever this one has
    monkeypatch.syspath_prepend(str(BENCH))
    assert importlib.import_module(script.removesuffix(".py")).main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and GPU_ONLY[script] in err, err


def test_plan_fits_samples_only_the_jobs_gpus(monkeypatch) -> None:
    """nvidia-smi lists every GPU of the host: plan_fits samples the job's (the first ``--gpus`` of
    CUDA_VISIBLE_DEVICES), so a job beside it on the other GPUs is not read as this one's memory."""
    monkeypatch.syspath_prepend(str(BENCH))
    plan_fits = importlib.import_module("plan_fits")
    assert plan_fits.job_gpus(2, {"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert plan_fits.job_gpus(1, {"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}) == ["GPU-aa"]
    assert plan_fits.job_gpus(2, {}) == ["0", "1"]
    with pytest.raises(ValueError, match="names 1 devices, the job takes 2"):
        plan_fits.job_gpus(2, {"CUDA_VISIBLE_DEVICES": "3"})


def test_plan_fits_plans_for_the_card_it_runs_on() -> None:
    plan_fits = importlib.import_module("plan_fits")
    assert plan_fits.hardware_of("NVIDIA H200") == "h200" and plan_fits.hardware_of("NVIDIA H20") == "h20"
    assert plan_fits.hardware_of("NVIDIA H100 80GB HBM3") == "h100" and plan_fits.hardware_of("NVIDIA A100-SXM4-80GB") == "h100"


def test_plan_fits_names_where_a_run_ran_out(monkeypatch) -> None:
    """A run that runs out keeps torch's OutOfMemoryError line and the braid frames above it, so the next
    look at a capped run says which allocation of which step did not fit."""
    monkeypatch.syspath_prepend(str(BENCH))
    plan_fits = importlib.import_module("plan_fits")
    text = "\n".join([
        "step    1/6 loss 11.9",
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "/x/examples/lm.py", line 40, in <module>',
        '[rank1]:   File "/x/braid/runtime/executor.py", line 300, in run',
        '[rank1]:   File "/x/torch/nn/modules/module.py", line 1775, in _call_impl',
        '[rank1]:   File "/x/braid/tp/layers.py", line 120, in forward',
        "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 594.00 MiB. GPU 1 has a total "
        "capacity of 79.19 GiB of which 73.4 GiB is free. Of the allocated memory 3.1 GiB is allocated by PyTorch",
        "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 MiB.",
    ])
    where = plan_fits.oom_where(text)
    assert where[-1].startswith("[rank1]: torch.OutOfMemoryError") and "594.00 MiB" in where[-1]
    assert [w.split('"')[1] for w in where[:-1]] == ["/x/examples/lm.py", "/x/braid/runtime/executor.py",
                                                     "/x/braid/tp/layers.py"]
    assert plan_fits.oom_where("step    1/6 loss 11.9\nrc 0") == []
    root = plan_fits.os.path.realpath(plan_fits.ROOT)
    assert plan_fits.machine_free(f'File "{root}/braid/tp/layers.py" and "{sys.prefix}/bin/torchrun"') == \
        'File "braid/tp/layers.py" and "<python env>/bin/torchrun"'  # stored results name no machine's paths


def test_plan_fits_ends_a_run_at_its_limit_with_every_process_of_it(monkeypatch) -> None:
    """A run past its limit goes with every process it started, those in sessions of their own included
    (torchrun's workers left behind held the GPUs the next measurement read), each after printing where it
    waited; and the run's own --timeout is set below the limit."""
    monkeypatch.syspath_prepend(str(BENCH))
    plan_fits = importlib.import_module("plan_fits")
    child = "import time\ndef child_waits(): time.sleep(120)\nchild_waits()"
    left = "import time\ndef left_waits(): time.sleep(120)\nleft_waits()"
    # a child in the run's session, and one in a session of its own (as torchrun's workers are)
    parent = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {child!r}]); "
              f"q = subprocess.Popen([sys.executable, '-c', {left!r}], start_new_session=True); "
              "print('child', p.pid, 'left', q.pid, 'argv', sys.argv[1:], flush=True); time.sleep(120)")
    got = plan_fits.run(f"{sys.executable} -c {shlex.quote(parent)}", 6.0, 2, 3.0, [])
    assert got["rc"] == 124 and got["seconds"] < 60, got
    # each printed its stack, the one in a session of its own too
    assert "Fatal Python error: Aborted" in got["tail"] and "in child_waits" in got["tail"] and "in left_waits" in got["tail"], \
        got["tail"]
    assert "'--timeout', '30'" in got["tail"], got["tail"]  # job_timeout(3 s): at least 30 s
    for pid in (int(re.search(rf"{what} (\d+)", got["tail"]).group(1)) for what in ("child", "left")):
        for _ in range(100):  # killed, the child is gone (or a zombie until whoever adopted it reaps it)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        break
            except OSError:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"the run's child {pid} outlived the run")
    assert plan_fits.job_timeout(240) == 120 and plan_fits.job_timeout(20) == 30
