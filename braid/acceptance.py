"""One GPU acceptance command: the GPU tests and the headline benchmarks, within a time budget.

``python -m braid.acceptance --out DIR`` runs, on the GPUs it finds (1, 2 or 4), one after
the other and each as a subprocess with its share of the budget (default 820 s). braid runs
as its benches run it by default -- compiled units, whole-step CUDA graphs, the default TP
backend and schedules -- and every peer in its best mode (:func:`parts`):

* ``gpu-tests`` -- ``python -m pytest -m gpu tests/`` (per-test ``--timeout``), junit XML;
* ``executor-limit`` -- ``benchmarks/bench_executor_limit.py`` on one GPU (braid's schedules
  at pp=1 against the plain loop, eager and compiled, and torch's pipelining schedules on the
  same model);
* ``bench-tp1-pp2`` and ``bench-tp2-pp1`` -- ``python -m braid.bench`` (7b-layer shape,
  seq 4096, ``--mbs 4``, ``--rounds 3``; tp=1 x pp=2 with a half-layer cut,
  ``--layers-per-stage 1,1,1.5,0.5``) against torch's interleaved 1F1B in torch's best mode
  and megatron-core graphed (where installed): braid's best over the best external row and
  over each peer's, and the peak memory per rank of braid's fastest run, measured and
  predicted; the JSON is written after every round, so a part stopped early still reports the
  rounds it finished;
* ``braided-overlap`` -- ``benchmarks/bench_braided_overlap.py`` (braided vs plain at TP=2,
  its default CUDA backend ``nccl-capped``).

A part that needs more GPUs than there are is skipped with the reason. A part that runs
past its budget is interrupted (SIGINT, so pytest still writes its XML), then killed with
its process group. DIR gets each part's log and result file and ``summary.json``: device,
versions, every part's status, time and headline figures, every test's outcome, and the
table printed to stdout (``table``), so the one file says what the run said. Children run
with ``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``. Exit code: 0 when
every part that ran passed, 1 otherwise; without CUDA, 2 and one line -- except
``--cpu-smoke``, which runs every part at its tiniest size on CPU/gloo to check this plumbing
(and the summary) for real.
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

from braid.baselines.modes import BEST_MCORE_MODE, best_torch_mode
from braid.io.cli import Parser, check_output_dir, check_range, run_main
from braid.io.limits import MAX_TIMEOUT_S
from braid.io.files import atomic_write_text

ROOT = Path(__file__).resolve().parent.parent  # the checkout: tests/ and benchmarks/ live here
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# Each part's share of the budget, as seconds of the default 820 (scaled with --budget-s); a part's
# unused time goes to the parts after it. Each share is what the part took on 2 H100s, braid compiled
# and graphed against every peer at its best, with ~10% to spare (benchmarks/results/
# acceptance_h100x2_tests.json and acceptance_h100x2_bench.json): gpu-tests 346 s (one pytest, the
# session's ranks shared by the GPU cases), executor-limit 74 s, bench-tp1-pp2 120 s, bench-tp2-pp1
# 98 s, braided-overlap 34 s; the gpu-tests share adds ~60 s (an estimate) for the compiled A3B MoE case
# added after that run. A machine that allows a command less than the whole budget runs the
# parts in turns (--only) and keeps each turn's DIR. A bench part stopped early still leaves the JSON
# of the rounds it finished.
WEIGHTS = {"gpu-tests": 440, "executor-limit": 85, "bench-tp1-pp2": 135, "bench-tp2-pp1": 115, "braided-overlap": 45}
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
    """The parts, in the order they run, with the sizes of a GPU run or of ``--cpu-smoke``.

    On GPUs braid runs as ``braid.bench`` runs it by default -- compiled units, whole-step CUDA
    graphs where capturable, the default TP backend and schedules -- and each peer in its best
    mode. What departs from the benches' defaults sizes the measurement only (rounds, steps,
    profile iterations, no calibration probe: the headlines are measured ratios) or shrinks the
    shape (fewer layers for the executor-limit part, whose compiled plain loop compiles the whole
    model), never what braid or a peer runs.
    """
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
        # braid compiled and graphed (the defaults) on one GPU against the plain loop eager and
        # compiled and torch's schedules; braid's units have the tp=1 bench part's shapes, so that
        # part can read them from Inductor's on-disk cache, warmed here. One layer a chunk (the
        # script's default is 2): the compiled loop compiles the whole model, so the shape shrinks.
        limit = ("--preset", "7b-layer", "--layers-per-stage", "1", "--seq", "4096", "--m", "8",
                 "--skip", "braid_eager", "braid_nograph", "--warmup", "3", "--steps", "3")
        # m=4, every default schedule of braid, against the peers at their best (_peers)
        bench = ("--preset", "7b-layer", "--seq", "4096", "--mbs", "4", "--rounds", "3", "--steps", "3", "--iters", "3",
                 "--no-calibrate")
        overlap = ("--layers", "2", "--mbs", "6", "--warmup", "1", "--iters", "3")
    return [
        Part("gpu-tests", gpu, (*tests, "--junitxml", str(out / "gpu-tests.xml")), "gpu-tests.xml", None),
        Part("executor-limit", gpu, _py("benchmarks/bench_executor_limit.py", *limit, "--out", str(out / "executor_limit.json")),
             "executor_limit.json", _limit_headline, {} if smoke else {"CUDA_VISIBLE_DEVICES": first_visible_gpu()}),
        # tp=1 x pp=2 with the head's stage half a layer lighter (braid's best split; the baselines split whole layers)
        Part("bench-tp1-pp2", 2 * gpu, _py("-m", "braid.bench", *bench, *_peers(1, smoke), "--tp", "1", "--pp", "2",
                                           "--layers-per-stage", "1,1,1.5,0.5", "--json", str(out / "bench_tp1_pp2.json")),
             "bench_tp1_pp2.json", _bench_headline),
        Part("bench-tp2-pp1", 2 * gpu, _py("-m", "braid.bench", *bench, *_peers(2, smoke), "--tp", "2", "--pp", "1",
                                           "--json", str(out / "bench_tp2_pp1.json")),
             "bench_tp2_pp1.json", _bench_headline),
        Part("braided-overlap", 2 * gpu, _py("benchmarks/bench_braided_overlap.py", *overlap, "--json", str(out / "braided_overlap.json")),
             "braided_overlap.json", _overlap_headline),
    ]


def first_visible_gpu() -> str:
    """The first device of ``CUDA_VISIBLE_DEVICES`` (``0`` when unset): a one-GPU part stays on the
    devices the run was given (two runs side by side on one host's GPU pairs included)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"


def _peers(tp: int, smoke: bool) -> tuple[str, ...]:
    """The bench parts' external rows: each peer in its best mode -- torch's interleaved 1F1B (the one
    torch schedule that compiles) in torch's best, megatron-core graphed where it is installed; on
    CPU (``--cpu-smoke``) torch eager."""
    if smoke:
        return ("--baselines", "torch_1f1b_i", "--torch-modes", "eager")
    return ("--baselines", "torch_1f1b_i", *(("mcore_1f1b_i",) if _has_mcore() else ()), "--torch-modes", best_torch_mode(tp),
            "--mcore-modes", BEST_MCORE_MODE)


def _has_mcore() -> bool:
    from braid.baselines.megatron_gpt import available

    return available()


# -- headline figures from each part's result file -------------------------------------------
def _limit_headline(path: Path) -> dict[str, float]:
    """bench_executor_limit: each ratio's median (e.g. ``braid_best/eager``)."""
    return {k: v["median"] for k, v in json.loads(path.read_text())["ratios"].items()}


def _bench_headline(path: Path) -> dict[str, dict[str, Any]]:
    """braid.bench, per m: braid's best over the best external row, median [min, max] over the rounds
    it has (fewer than asked where the part was stopped after writing a round's JSON); over each
    peer's best row; how braid's fastest run ran (schedule, compiled units, CUDA graph); and that
    run's peak memory per rank, measured and predicted (MiB)."""
    doc = json.loads(path.read_text())
    out: dict[str, dict[str, Any]] = {}
    for m, r in doc.get("best_over_external", {}).items():
        fastest = min((x for x in doc["runs"] if str(x["m"]) == m), key=lambda x: x["step_s"])
        peers = doc.get("best_per_peer", {}).get(m, {})
        out[f"m={m}"] = {
            **{k: r[k] for k in ("median", "min", "max")}, "rounds": len(r["rounds"]),
            "braid": {"schedule": fastest["schedule"], "compiled": bool(doc["config"].get("compile")),
                      "cuda_graph": fastest.get("cuda_graph") == "step"},
            "peers": {p: {"median": b["median"], "best_row": max(b["best_rows"], key=b["best_rows"].count)}
                      for p, b in sorted(peers.items())},
            "memory": {"schedule": fastest["schedule"], "graph_capture": fastest.get("cuda_graph") == "step",
                       "measured_mib": [round(b / 2**20, 1) for b in fastest["peak_bytes"]],
                       "predicted_mib": [round(b / 2**20, 1) for b in fastest["predicted_peak_bytes"]],
                       "max_err": fastest["peak_err"]}}
    return out


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


def summarize(rows: list[dict[str, Any]]) -> list[str]:
    """The table printed at the end (and stored in ``summary.json``): a line per part, and a bench
    part's memory line under it."""
    lines = [f"{'part':<17}{'status':<9}{'time/budget s':>14}  headline"]
    for r in rows:
        t = f"{r['seconds']:.0f}/{r['budget_s']:.0f}" if r["status"] != "skipped" else "-"
        lines.append(f"{r['name']:<17}{r['status']:<9}{t:>14}  {_headline_text(r)}")
        if r["name"].startswith("bench-") and r.get("headline"):
            lines += [f"{'':<40}{_memory_text(m, v['memory'])}" for m, v in r["headline"].items()]
    return lines


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
        return "; ".join(_bench_text(m, v) for m, v in h.items())
    label = "braided/plain " if r["name"] == "braided-overlap" else ""
    return "; ".join(f"{label}{k} {v:.3f}" for k, v in h.items())


def _bench_text(m: str, v: dict[str, Any]) -> str:
    """``m=4 braid (braided_v, compiled units, CUDA graph) / best external 1.072x [1.060, 1.081] over 3 rounds;
    braid / mcore:interleaved 1F1B [graphed] 1.072x; braid / torch:... [titan+compile+async_tp] 1.301x``"""
    b = v["braid"]
    how = f"{b['schedule']}, {'compiled' if b['compiled'] else 'eager'} units, {'CUDA graph' if b['cuda_graph'] else 'no graph'}"
    rounds = f"{v['rounds']} round{'s' if v['rounds'] != 1 else ''}"
    return "; ".join([f"{m} braid ({how}) / best external {v['median']:.3f}x [{v['min']:.3f}, {v['max']:.3f}] over {rounds}",
                      *(f"braid / {p['best_row']} {p['median']:.3f}x" for p in v["peers"].values())])


def _memory_text(m: str, mem: dict[str, Any]) -> str:
    """``memory m=4 braided_v: peak MiB per rank measured/predicted 8154.6/7654.4 7257.3/7043.7 (worst error 6.5%)``"""
    pairs = " ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(mem["measured_mib"], mem["predicted_mib"]))
    what = "; measured: the CUDA graph's capture peak, with the gradients" if mem["graph_capture"] else ""
    return f"memory {m} {mem['schedule']}: peak MiB per rank measured/predicted {pairs} (worst error {mem['max_err']:.1%}{what})"


def main(argv: Sequence[str] | None = None) -> int:
    ap = Parser(prog="python -m braid.acceptance", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, metavar="DIR", help="directory for the logs, result files and summary.json")
    ap.add_argument("--budget-s", type=float, default=float(sum(WEIGHTS.values())),
                    help=f"total time budget in seconds, shared by the parts (default {sum(WEIGHTS.values())})")
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
    summary["table"] = [*summarize(summary["parts"]), f"total {summary['elapsed_s']:.0f} s of {args.budget_s:.0f}"]
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1))
    print("\n".join(summary["table"]))
    print(f"summary (with this table): {out / 'summary.json'}")
    ran = [r for r in summary["parts"] if r["status"] != "skipped"]
    return 0 if ran and all(r["status"] == "passed" for r in ran) else 1


if __name__ == "__main__":
    raise SystemExit(run_main(main))
