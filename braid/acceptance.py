"""One GPU acceptance command: the GPU tests and the headline benchmarks, within a time budget.

``python -m braid.acceptance --out DIR`` runs, on the GPUs it finds (1, 2 or 4), one after
the other and each as a subprocess with its share of the budget (default 540 s):

* ``gpu-tests`` -- ``python -m pytest -m gpu tests/`` (per-test ``--timeout``), junit XML;
* ``executor-limit`` -- ``benchmarks/bench_executor_limit.py`` on one GPU (braid's braided_v
  at pp=1 against the plain loop and torch's pipelining schedules on the same model);
* ``bench-tp1-pp2`` and ``bench-tp2-pp1`` -- ``python -m braid.bench`` (7b-layer shape,
  seq 4096, ``--mbs 4``, ``--rounds 5``, one external row; tp=1 x pp=2 with a half-layer cut,
  ``--layers-per-stage 1,1,1.5,0.5``): braid's best over it; the JSON is
  written after every round, so a part stopped early still reports the rounds it finished;
* ``braided-overlap`` -- ``benchmarks/bench_braided_overlap.py`` (braided vs plain at TP=2,
  the default CUDA backend ``nccl-capped``).

A part that needs more GPUs than there are is skipped with the reason. A part that runs
past its budget is interrupted (SIGINT, so pytest still writes its XML), then killed with
its process group. DIR gets each part's log and result file and ``summary.json``: device,
versions, every part's status, time and headline figures, and every test's outcome; a
short table goes to stdout. Children run with ``NCCL_NVLS_ENABLE=0`` and
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``. Exit code: 0 when every part that ran passed, 1
otherwise; without CUDA, 2 and one line -- except ``--cpu-smoke``, which runs every part at
its tiniest size on CPU/gloo to check this plumbing (and the summary) for real.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from braid.io.cli import Parser, check_output_dir, check_range, run_main
from braid.io.limits import MAX_TIMEOUT_S
from braid.io.files import atomic_write_text

ROOT = Path(__file__).resolve().parent.parent  # the checkout: tests/ and benchmarks/ live here
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# Each part's share of the budget, as seconds of the default 540 (scaled with --budget-s); a part's
# unused time goes to the parts after it. Expected times on 2 H200s (torch 2.11, NCCL 2.28, fresh
# machine, cold Inductor cache), from the first full run there, whose parts were all cut (its logs
# say how far each got, its NCCL warnings when): expected time / share.
#   gpu-tests        ~185 s / 270: the tests' own times summed 254 s, + ~33 s for the test cut
#                    off, ~14 s for tests/test_vlm.py and ~20 s of collection = ~320 s; less
#                    ~105 s of rank processes started and closed per test or module (~9 s to
#                    start, ~3-5 s to close a pool there), which now run on the session's pool:
#                    tp_comm ~42 s, titan ~28 s, graphs ~14 s, calibration ~12 s, attention2d
#                    ~10 s. Of the rest, ~42 s are test_memory_gpu and test_training_gpu's one
#                    (23 s and 19 s measured there; the training file's 33 s memory test is
#                    now part of test_memory_gpu's job), so ~185 s.
#   executor-limit    ~35 s / 50: 5 contenders had taken ~45 s with 8 steps each, ~14 s of it
#                    start and model; now 5 contenders (braided_v; eager; torch's 3) of 6 steps,
#                    ~5 s each, and its model built in half the time.
#   bench-tp1-pp2     ~75 s / 110: ~44 s went before the first run: start, profile and two
#                    builds of the 1.17e9-parameter model on one thread (16-18 s each on a
#                    2-core VM; now one build of ~8 s), then ~3 s per run with megatron-core's:
#                    15 runs ~45 s; a rank hanging in its teardown is killed within 10 s.
#   bench-tp2-pp1     ~50 s / 70: its 15 runs had ended within 59 s (then lost to a rank hanging
#                    in destroy_process_group); its 0.7e9-parameter model now built once, faster.
#   braided-overlap   ~24 s / 40: start + model ~17 s (~-3 s now), then ~8 s per TP backend (one).
# Measured since on a fresh pair of H200s (benchmarks/results/acceptance_h200x2.txt): every part
# passed in 348 s of 530 -- gpu-tests 154 s (186 s alone with a cold Inductor cache, just before),
# executor-limit 36 s, bench-tp1-pp2 75 s, bench-tp2-pp1 57 s, braided-overlap 26 s.
# A bench part stopped early still leaves the JSON of the rounds it finished.
WEIGHTS = {"gpu-tests": 270, "executor-limit": 50, "bench-tp1-pp2": 110, "bench-tp2-pp1": 70, "braided-overlap": 40}
GRACE_S = 20.0  # after SIGINT: time to write what a part has before it is killed


@dataclass(frozen=True, slots=True)
class Part:
    """One subprocess of the acceptance run: what it needs, its command, where its result goes."""

    name: str
    gpus: int  # CUDA devices it needs (0 on CPU)
    argv: tuple[str, ...]
    result: str | None  # file in DIR the part writes (JSON or junit XML)
    headline: Callable[[Path], Any] | None = None  # figures read from ``result``
    env: dict[str, str] = field(default_factory=dict)


def _py(*args: str) -> tuple[str, ...]:
    return (sys.executable, *args)


def parts(out: Path, smoke: bool) -> list[Part]:
    """The parts, in the order they run, with the sizes of a GPU run or of ``--cpu-smoke``."""
    gpu = 0 if smoke else 1
    if smoke:  # a real CPU test through the same junit path (the GPU tests all skip on CPU)
        tests = _py("-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_reference_error.py", "--timeout", "60")
        limit = ("--preset", "tiny", "--device", "cpu", "--seq", "16", "--m", "2", "--layers-per-stage", "1",
                 "--schedule", "braided_v", "--skip", "eager_compiled", "torch_pp", "--warmup", "1", "--steps", "1")
        bench = ("--preset", "tiny", "--device", "cpu", "--seq", "16", "--mbs", "4", "--schedule", "braided_v", "--rounds", "1",
                 "--warmup", "1", "--steps", "1", "--iters", "1", "--no-calibrate")
        overlap = ("--tiny", "--layers", "1", "--mbs", "2", "--warmup", "1", "--iters", "1")
    else:
        tests = _py("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/", "--timeout", "120")
        # Eager units (--no-compile): a cold inductor cache alone would take the budget.
        # braided_v only, no graph-less rerun of it: the headline is braid's best over the plain
        # loop and over torch's schedules (warm-up 3: two eager steps and the graph's capture).
        limit = ("--preset", "7b-layer", "--seq", "4096", "--m", "8", "--schedule", "braided_v",
                 "--skip", "eager_compiled", "braid_nograph", "--no-compile", "--warmup", "3", "--steps", "3")
        # m=4, braided_v and zb_v, one external row (megatron-core graphed where installed, else
        # torch eager): 15 runs in five rounds fit the part's share (see WEIGHTS); the full
        # peers-at-their-best jobs (m=4 and 8, every peer's modes) are docs/bench.md's, minutes each.
        bench = ("--preset", "7b-layer", "--seq", "4096", "--mbs", "4", "--schedule", "braided_v", "zb_v", "--rounds", "5",
                 "--warmup", "2", "--steps", "2", "--iters", "3", "--no-calibrate", "--no-compile",
                 "--baselines", *(("mcore_1f1b_i",) if _has_mcore() else ("torch_1f1b_i",)),
                 "--torch-modes", "eager", "--mcore-modes", "graphed")
        overlap = ("--layers", "2", "--mbs", "6", "--warmup", "1", "--iters", "3", "--tp-backend", "nccl-capped")
    return [
        Part("gpu-tests", gpu, (*tests, "--junitxml", str(out / "gpu-tests.xml")), "gpu-tests.xml", None),
        Part("executor-limit", gpu, _py("benchmarks/bench_executor_limit.py", *limit, "--out", str(out / "executor_limit.json")),
             "executor_limit.json", _limit_headline, {} if smoke else {"CUDA_VISIBLE_DEVICES": "0"}),
        # tp=1 x pp=2 with the head's stage half a layer lighter (braid's best split; the baselines split whole layers)
        Part("bench-tp1-pp2", 2 * gpu, _py("-m", "braid.bench", *bench, "--tp", "1", "--pp", "2", "--layers-per-stage", "1,1,1.5,0.5",
                                           "--json", str(out / "bench_tp1_pp2.json")),
             "bench_tp1_pp2.json", _bench_headline),
        Part("bench-tp2-pp1", 2 * gpu, _py("-m", "braid.bench", *bench, "--tp", "2", "--pp", "1", "--json", str(out / "bench_tp2_pp1.json")),
             "bench_tp2_pp1.json", _bench_headline),
        Part("braided-overlap", 2 * gpu, _py("benchmarks/bench_braided_overlap.py", *overlap, "--json", str(out / "braided_overlap.json")),
             "braided_overlap.json", _overlap_headline),
    ]


def _has_mcore() -> bool:
    from braid.baselines.megatron_gpt import available

    return available()


# -- headline figures from each part's result file -------------------------------------------
def _limit_headline(path: Path) -> dict[str, float]:
    """bench_executor_limit: each ratio's median (e.g. ``braid_best/eager``)."""
    return {k: v["median"] for k, v in json.loads(path.read_text())["ratios"].items()}


def _bench_headline(path: Path) -> dict[str, dict[str, float]]:
    """braid.bench: braid's best over the best external baseline per m, median [min, max] over the
    rounds it has (fewer than asked where the part was stopped after writing a round's JSON)."""
    doc = json.loads(path.read_text())
    return {f"m={m}": {**{k: r[k] for k in ("median", "min", "max")}, "rounds": len(r["rounds"])}
            for m, r in doc.get("best_over_external", {}).items()}


def _overlap_headline(path: Path) -> dict[str, float]:
    """bench_braided_overlap: braided step time over plain step time per TP backend."""
    return {b: r["braided_over_plain"] for b, r in json.loads(path.read_text()).items() if "error" not in r}


def read_junit(path: Path) -> dict[str, Any]:
    """Counts and per-test outcomes (passed, failed, error, skipped) of a pytest junit XML file."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome, message = ("failed" if tag == "failure" else tag), (el.get("message") or "")[:300]
                break
        cases.append({"id": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": round(float(case.get("time") or 0.0), 2), "message": message})
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    return {**counts, "cases": cases}


# -- running -----------------------------------------------------------------------------
def run_part(part: Part, out: Path, budget_s: float, env: dict[str, str]) -> dict[str, Any]:
    """Run ``part`` with ``budget_s`` seconds; its stdout and stderr go to ``DIR/<name>.log``."""
    log = out / f"{part.name}.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write("$ " + " ".join(part.argv) + "\n")
        f.flush()
        proc = subprocess.Popen(part.argv, cwd=ROOT, env={**env, **part.env}, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group: ranks included in a kill
        timed_out = False
        try:
            rc = proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = _stop(proc)
    seconds = time.monotonic() - t0
    status = "timeout" if timed_out else ("passed" if rc == 0 else "failed")
    row: dict[str, Any] = {"name": part.name, "status": status, "returncode": rc, "seconds": round(seconds, 1),
                           "budget_s": round(budget_s, 1), "log": log.name, "result": None, "headline": None}
    res = out / part.result if part.result else None
    if res is not None and res.is_file():
        row["result"] = res.name
        if part.headline is not None:
            try:
                row["headline"] = part.headline(res)
            except (ValueError, KeyError, TypeError) as err:
                row["headline_error"] = f"{type(err).__name__}: {err}"
    return row


def _stop(proc: subprocess.Popen) -> int:
    """SIGINT to the part's process group (pytest then writes its report), SIGKILL after GRACE_S."""
    for sig, wait_s in ((signal.SIGINT, GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


def environment(smoke: bool, gpus: int) -> dict[str, Any]:
    """Device name and the versions a result depends on."""
    import torch

    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):
            nccl = None
    return {"device": "cpu" if smoke else torch.cuda.get_device_name(0), "gpus": gpus, "mode": "cpu-smoke" if smoke else "gpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl, "python": platform.python_version(),
            "host": platform.node()}


def summarize(rows: list[dict[str, Any]]) -> str:
    """The short table printed at the end."""
    lines = [f"{'part':<17}{'status':<9}{'time/budget s':>14}  headline"]
    for r in rows:
        t = f"{r['seconds']:.0f}/{r['budget_s']:.0f}" if r["status"] != "skipped" else "-"
        lines.append(f"{r['name']:<17}{r['status']:<9}{t:>14}  {_headline_text(r)}")
    return "\n".join(lines)


def _headline_text(r: dict[str, Any]) -> str:
    if r["status"] == "skipped":
        return r["reason"]
    h = r.get("headline")
    if r["name"] == "gpu-tests" and "tests" in r:
        t = r["tests"]
        bad = [c["id"] for c in t["cases"] if c["outcome"] in ("failed", "error")]
        return f"{t['passed']} passed, {t['failed']} failed, {t['error']} errors, {t['skipped']} skipped" + (
            f" (first failure: {bad[0]})" if bad else "")
    if not h:
        return f"no result (see {r['log']})"
    if r["name"].startswith("bench-"):
        return "; ".join(f"{m} braid/best external {v['median']:.3f}x [{v['min']:.3f}, {v['max']:.3f}] over {v['rounds']} "
                         f"round{'s' if v['rounds'] != 1 else ''}" for m, v in h.items())
    label = "braided/plain " if r["name"] == "braided-overlap" else ""
    return "; ".join(f"{label}{k} {v:.3f}" for k, v in h.items())


def main(argv: Sequence[str] | None = None) -> int:
    ap = Parser(prog="python -m braid.acceptance", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, metavar="DIR", help="directory for the logs, result files and summary.json")
    ap.add_argument("--budget-s", type=float, default=540.0, help="total time budget in seconds, shared by the parts (default 540)")
    ap.add_argument("--cpu-smoke", action="store_true", help="every part at its tiniest size on CPU/gloo (checks the plumbing)")
    ap.add_argument("--only", nargs="+", choices=list(WEIGHTS), metavar="PART", help=f"run only these parts ({', '.join(WEIGHTS)})")
    args = ap.parse_args(argv)
    check_output_dir(ap, "--out", args.out)
    check_range(ap, "--budget-s", args.budget_s, lo=1.0, hi=MAX_TIMEOUT_S, what="a number of seconds")
    import torch

    gpus = torch.cuda.device_count()
    if not args.cpu_smoke and gpus == 0:
        print("python -m braid.acceptance: no CUDA device found; run it on a GPU machine (or --cpu-smoke to check the "
              "plumbing on CPU)", file=sys.stderr)
        return 2
    if not (ROOT / "tests").is_dir() or not (ROOT / "benchmarks").is_dir():
        print(f"python -m braid.acceptance: needs the source checkout (tests/ and benchmarks/ beside braid/), not found in {ROOT}",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **CHILD_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    todo = [p for p in parts(out.resolve(), args.cpu_smoke) if args.only is None or p.name in args.only]
    summary: dict[str, Any] = {**environment(args.cpu_smoke, gpus), "budget_s": args.budget_s, "env": CHILD_ENV, "parts": []}
    t0 = time.monotonic()
    for i, p in enumerate(todo):
        # each part gets its weight's share of what is left: time a part did not use goes to the rest
        left_w = sum(WEIGHTS[q.name] for q in todo[i:])
        budget = max(args.budget_s - (time.monotonic() - t0), 0.0) * WEIGHTS[p.name] / left_w
        if p.gpus > gpus:
            row = {"name": p.name, "status": "skipped", "reason": f"needs {p.gpus} GPUs, found {gpus}", "seconds": 0.0,
                   "budget_s": round(budget, 1)}
        else:
            print(f"[acceptance] {p.name}: up to {budget:.0f} s ...", flush=True)
            row = run_part(p, out, budget, env)
            if p.name == "gpu-tests" and row["result"]:
                row["tests"] = read_junit(out / row["result"])
        summary["parts"].append(row)
    summary["elapsed_s"] = round(time.monotonic() - t0, 1)
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1))
    print(summarize(summary["parts"]))
    print(f"total {summary['elapsed_s']:.0f} s of {args.budget_s:.0f}; summary: {out / 'summary.json'}")
    ran = [r for r in summary["parts"] if r["status"] != "skipped"]
    return 0 if ran and all(r["status"] == "passed" for r in ran) else 1


if __name__ == "__main__":
    raise SystemExit(run_main(main))
