"""The planner's pick shown to fit on the GPUs, and the faster layout it rejected shown not to.

Runs ``braid.plan`` for a job on this machine's GPUs under a memory cap (``--memory GiB``), then
trains its pick and the fastest configuration predicted over the cap itself (from the plan's ``over_cap`` list,
shown under "faster, over the planned memory": the plan keeps ``--memory-margin`` of the cap back) with the
example scripts under the cap (``--memory-cap``: device memory in
use, the allocator held to the cap less what CUDA, NCCL and the run's CUDA graph hold outside it, :mod:`examples.train_fit`),
while ``nvidia-smi`` samples what the job's GPUs have in use (only those: a job on the host's other GPUs
is not this one's).
Per configuration: predicted device memory in use (the planner's figure), the most in use measured,
the example's allocator peak, and whether it ran out::

    PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python benchmarks/plan_fits.py \\
        --model qwen2-small --gpus 2 --memory 7.75 --global-batch 16 --steps 6

(``benchmarks/results/plan_fits_h200x2_cap7.75.txt``: at 7 GiB nothing fits once the instantiated graph is priced.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def hardware_of(device_name: str) -> str:
    """The :mod:`braid.cost.hardware` preset a CUDA device's name names, the longest that fits (``"NVIDIA H200"`` is
    h200, not h20); h100 where none does."""
    from braid.cost.hardware import HARDWARE

    low = device_name.lower()
    return max((k for k in HARDWARE if k in low), key=len, default="h100")


def job_gpus(gpus: int, environ=os.environ) -> list[str]:
    """nvidia-smi's ids of the ``gpus`` devices the job's ranks take: the first of ``CUDA_VISIBLE_DEVICES``
    (indices or UUIDs), else the first indices. nvidia-smi lists every GPU of the host, and another job
    on the others is not this one's memory."""
    vis = environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in vis.split(",") if x.strip()] if vis is not None else [str(i) for i in range(gpus)]
    if len(ids) < gpus:
        raise ValueError(f"CUDA_VISIBLE_DEVICES={vis!r} names {len(ids)} devices, the job takes {gpus}")
    return ids[:gpus]


def _sample(stop: threading.Event, out: list[int], ids: list[str], every_s: float = 0.2) -> None:
    """The most memory in use on the job's GPUs ``ids`` (MiB), sampled until ``stop``."""
    while not stop.is_set():
        try:
            got = subprocess.run(["nvidia-smi", "--id=" + ",".join(ids), "--query-gpu=memory.used",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10).stdout.split()
            out.append(max(int(x) for x in got))
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        stop.wait(every_s)


def run(command: str, cap: float, steps: int, timeout_s: float, ids: list[str]) -> dict:
    """Train ``command`` (a plan's torchrun line) for ``steps`` under ``--memory-cap cap`` on GPUs ``ids``."""
    argv = shlex.split(command)
    # the job's own communication timeout (a stuck collective, a CUDA-graph replay whose peer never joins) ends it
    # with a message naming the rank before this script's limit does
    argv += ["--memory-cap", f"{cap:g}", "--steps", str(steps), "--skip-memory-check", "--timeout", f"{job_timeout(timeout_s):g}"]
    stop, used = threading.Event(), []
    sampler = threading.Thread(target=_sample, args=(stop, used, ids), daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    # output to a file, not a pipe: a process left behind that kept the pipe open would hold the read past the
    # limit; faulthandler on, so that a run stopped at its limit prints its stacks (end_tree)
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    # no core files from the aborted processes (GPU processes' cores run to gigabytes): inherited by the run
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = 124
            end_tree(proc)
        log.seek(0)
        text = log.read()
    text = machine_free(text)
    stop.set()
    sampler.join()
    peaks = [float(x.replace(",", "")) for x in re.findall(r"peak mem ([\d,.]+) MiB", text)]
    return {"rc": rc, "out_of_memory": "out of memory" in text.lower() or "OutOfMemoryError" in text,
            "oom_where": oom_where(text),
            "steps_done": len(re.findall(r"step +\d+/", text)), "allocator_peak_mib": max(peaks, default=0.0),
            "device_in_use_mib": max(used, default=0), "seconds": time.perf_counter() - t0, "tail": text[-(20000 if rc == 124 else 3000):]}


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``pid``'s state letter, parent pid and start time (clock ticks after boot; with the pid, one process's
    identity) from Linux's ``/proc``, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid``: torchrun's workers run in sessions of their own, so a signal to the
    run's process group does not reach them."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            children.setdefault(st[1], []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def end_tree(proc: subprocess.Popen, dump_s: float = 5.0) -> None:
    """End a run at its limit: every process of it (its session and whatever it started, torchrun's workers
    in their own sessions included) first prints its Python stacks (SIGABRT under faulthandler; up to
    ``dump_s`` for them all to end, one after the other so that the stacks do not interleave), then whatever is
    left is killed. A process is signalled only while its start time is the one listed (a pid freed and taken by
    another process in between is left alone)."""
    listed = {pid: st[2] for pid in [proc.pid] + descendants(proc.pid) if (st := _stat(pid)) is not None}

    def running() -> list[int]:
        return [pid for pid, start in listed.items() if (st := _stat(pid)) is not None and st[2] == start
                and st[0] not in ("Z", "X")]  # a zombie has ended: only its parent's wait is left

    deadline = time.monotonic() + dump_s
    for pid in reversed(running()):  # the workers before the launcher that would forward or restart
        _signal(pid, signal.SIGABRT)
        while pid in running() and time.monotonic() < deadline:  # one at a time: the stacks do not interleave
            time.sleep(0.02)
    for pid in running():
        _signal(pid, signal.SIGKILL)
    try:  # and whatever joined the run's session after the listing
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def job_timeout(limit_s: float) -> float:
    """The ``--timeout`` a run gets under a ``limit_s`` limit: half of it, at least 30 s."""
    return max(30.0, limit_s / 2)


def machine_free(text: str) -> str:
    """``text`` with this machine's paths left out: the repository's root (its files named as in the
    repository), the Python environment's prefix and Inductor's cache directory."""
    import getpass

    cache = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    for path, name in ((os.path.realpath(ROOT), ""), (sys.prefix, "<python env>/"), (cache, "<inductor cache>/")):
        text = text.replace(path.rstrip(os.sep) + os.sep, name)
    return text


def oom_where(text: str) -> list[str]:
    """Where a run ran out: the first rank's ``OutOfMemoryError`` line (what it tried to allocate, what the
    allocator held) and the braid and example frames of its traceback just above it; [] if none."""
    lines = text.splitlines()
    at = next((i for i, line in enumerate(lines) if "OutOfMemoryError" in line and "Tried to allocate" in line), None)
    if at is None:
        return []
    frames = [line.strip() for line in lines[max(0, at - 60):at]
              if (m := re.search(r'File "([^"]+)"', line)) and re.search(r"(^|/)(braid|examples)/", m.group(1))]
    return frames[-6:] + [lines[at].strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="plan_fits.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2-small")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--memory", type=float, default=7.0, help="the cap, GiB per GPU (plan and runs; the plan keeps "
                    "braid.plan's --memory-margin of it back)")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--hardware", default=None, help="braid.plan's hardware preset (default: the one the first GPU's name names)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    if torch.cuda.device_count() < args.gpus:
        print(f"plan_fits.py: needs {args.gpus} CUDA devices, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    ids = job_gpus(args.gpus)
    args.hardware = args.hardware or hardware_of(torch.cuda.get_device_name(0))
    from braid.plan import main as plan_main

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plan.json")
        rc = plan_main(["--model", args.model, "--gpus", str(args.gpus), "--hardware", args.hardware, "--memory", f"{args.memory:g}",
                        "--global-batch", str(args.global_batch), "--top", "3", "--json", path])
        if rc:
            return rc
        doc = json.loads(open(path).read())
    # the plan's over_cap list is over the planned memory (the cap less the margin): run one over the cap itself
    over = [cfg for cfg in doc["over_cap"] if cfg["peak_memory_gib"] > args.memory]
    rows = [("pick", doc["ranked"][0])] + [("over the cap", over[0])] * bool(over)
    report = []
    for what, cfg in rows:
        got = run(cfg["command"], args.memory, args.steps, args.timeout, ids)
        report.append({"what": what, "predicted_step_s": cfg["step_s"], "predicted_in_use_gib": cfg["peak_memory_gib"],
                       "command": cfg["command"], **got})
        err = (got["device_in_use_mib"] / 1024) / cfg["peak_memory_gib"] - 1
        print(f"{what:13s} predicted {cfg['peak_memory_gib']:.2f} GiB in use, step {cfg['step_s'] * 1e3:.1f} ms; "
              f"measured {got['device_in_use_mib'] / 1024:.2f} GiB in use ({100 * err:+.1f}%), allocator peak "
              f"{got['allocator_peak_mib'] / 1024:.2f} GiB, {got['steps_done']} steps, rc {got['rc']}"
              + (", ran out of memory" if got["out_of_memory"] else ""), flush=True)
        if got["oom_where"]:
            print("  " + "\n  ".join(got["oom_where"]), flush=True)
        elif got["rc"]:
            print(got["tail"], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cap_gib": args.memory, "plan": doc["problem"], "runs": report}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
