"""The example training loop under faults, layout changes and bad input, with real processes (gloo, CPU).

Runs that check what training computes or reports (resharding, non-finite losses, run files, metrics, and the
reference and resumed runs of the kill tests) start their processes through the session's fork server
(``forkserver.py``); the killed runs, signals, file size limits, plain-rank start-ups, torchrun's summary and
``--help`` run in new interpreters.

* killed with SIGKILL at random moments and during saves, then resumed from its
  directory, a run continues where its last complete save stopped and ends with the
  uninterrupted run's losses (one process: exactly; a killed torchrun worker: to 1e-5);
* a checkpoint saved at tp=2 x pp=2 (braided_v) resumes at tp=1 x pp=2 (zb_v), at pp=4
  (1f1b) and, for the VLM, at tp=1 x pp=2 x dp=2 and in one process: the resumed losses
  equal the uninterrupted run's within 1e-5 relative;
* a non-finite loss stops the run before the update and any save (exit 1, one line naming
  the step and the rank), and the metrics stay strict JSON;
* plain-process ranks (no torchrun): a rank that dies or never comes, at start-up or mid-run, is named by
  the others in one line within seconds; a save past the file size limit is one line, the last checkpoint kept;
* bad flags, output paths, run files and damaged checkpoints: one line, exit 2, no
  traceback, nothing written; ``--help`` under torchrun prints once.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forkserver import shared_bin
from test_examples import _env, _ok, _python, _torchrun  # launches: forked or real interpreters

ROOT = Path(__file__).resolve().parent.parent
LLM = str(ROOT / "examples" / "qwen2.py")
VLM = str(ROOT / "examples" / "qwen2_vl.py")
COMMON = ["--seq", "16", "--mbs", "4", "--seed", "1", "--device", "cpu"]
RESHARD_RTOL = 1e-5  # fp32; another TP/PP split sums the same terms in another order


def _strict(line: str) -> dict:
    def refuse(name: str) -> None:
        raise ValueError(f"non-JSON constant {name}")

    return json.loads(line, parse_constant=refuse)


def _losses(path: Path) -> list[float]:
    return [_strict(line)["loss"] for line in path.read_text().splitlines()]


def _close(got: list[float], want: list[float], rtol: float) -> bool:
    return len(got) == len(want) and all(math.isclose(a, b, rel_tol=rtol) for a, b in zip(got, want))


# -- killed runs ----------------------------------------------------------------------------------
def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _logged_step(metrics: Path) -> int:
    """The last step the metrics file records (0: none)."""
    try:
        lines = metrics.read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(x)["step"] for x in lines if x.endswith("}")]
    return max(steps, default=0)


def _kill_after(proc: subprocess.Popen, metrics: Path, ckpt: Path, step: int, during_save: bool, delay: float,
                pids: callable = None) -> bool:
    """SIGKILL the run (or the last of ``pids()``) once it has logged ``step``: during that step's save (a partial
    folder exists) or ``delay`` s later. False if the run ended first."""
    end = time.monotonic() + 300
    while proc.poll() is None and _logged_step(metrics) < step and time.monotonic() < end:
        time.sleep(0.005)
    t0 = time.monotonic()
    while proc.poll() is None:
        if during_save and any(ckpt.glob(".step_*.partial")):
            break
        if not during_save and time.monotonic() - t0 >= delay:
            break
        time.sleep(0.0005)
    if proc.poll() is not None:
        return False
    targets = pids() if pids is not None else [proc.pid]
    os.kill(targets[-1], signal.SIGKILL)
    proc.wait(timeout=60)
    return True


def test_single_process_killed_at_random_moments_and_during_saves_resumes_exactly(tmp_path: Path) -> None:
    from braid.training import checkpoint

    steps = 10
    ref = tmp_path / "ref.jsonl"
    _ok(_python(LLM, *COMMON, "--steps", str(steps), "--metrics", str(ref), forked=True))  # the reference: forked
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    # One command starts and restarts the run: --resume names the run's own --save directory.
    base = [LLM, *COMMON, "--steps", str(steps), "--save", str(ckpt), "--save-every", "1", "--metrics", str(metrics),
            "--resume", str(ckpt)]
    rng = random.Random(17)
    kills, saved = 0, 0
    for attempt in range(5):
        proc = _start(base)
        during_save = attempt % 2 == 0
        step = 1 if attempt == 0 else saved + rng.randint(1, 2)  # first: during the very first save
        if not _kill_after(proc, metrics, ckpt, step, during_save, delay=rng.uniform(0.0, 0.3)):
            break
        kills += 1
        if (ckpt / "latest").exists():  # whatever the moment, latest names a complete, sound checkpoint
            folder = checkpoint.resolve(ckpt)
            assert checkpoint.verify(folder) == [], attempt
            saved = checkpoint.read_layout(folder)["step"]
    assert kills >= 3 and saved > 0  # really interrupted, several times, saves included
    final = _python(*base, forked=True)  # the resumed run: forked (its launch is not what is killed)
    _ok(final)
    assert f"at step {saved} " in final.stderr  # continued where the last complete save stopped
    assert _losses(metrics) == _losses(ref)  # same layout, same arithmetic: exact
    assert [_strict(line)["step"] for line in metrics.read_text().splitlines()] == list(range(1, steps + 1))


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (torchrun's workers)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return sorted(out)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds torchrun's workers through /proc")
def test_torchrun_worker_killed_during_a_save_resumes_where_the_last_save_stopped(tmp_path: Path) -> None:
    steps = 5
    ref = tmp_path / "ref.jsonl"
    _ok(_python(LLM, *COMMON, "--steps", str(steps), "--metrics", str(ref), forked=True))  # the reference: forked
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    args = [LLM, *COMMON, "--pp", "2", "--schedule", "1f1b", "--steps", str(steps), "--save", str(ckpt), "--save-every", "1",
            "--metrics", str(metrics)]
    proc = _start(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", *args])
    assert _kill_after(proc, metrics, ckpt, 2, True, 0, pids=lambda: _children(proc.pid))  # during step 2's save
    assert proc.returncode != 0
    resumed = _torchrun(2, *args, "--resume", str(ckpt), forked=True)
    _ok(resumed)
    assert "at step 1 " in resumed.stderr
    assert _close(_losses(metrics), _losses(ref), RESHARD_RTOL), (_losses(metrics), _losses(ref))


# -- resharding -------------------------------------------------------------------------------------
def test_saved_at_tp2_pp2_resumes_at_tp1_pp2_and_at_pp4_with_the_uninterrupted_losses(tmp_path: Path) -> None:
    steps = ["--steps", "4"]
    full, first = tmp_path / "full.jsonl", tmp_path / "first.jsonl"
    ckpt = tmp_path / "ckpt"
    _ok(_torchrun(4, LLM, *COMMON, "--tp", "2", "--pp", "2", "--schedule", "braided_v", *steps, "--metrics", str(full),
                  forked=True))
    _ok(_torchrun(4, LLM, *COMMON, "--tp", "2", "--pp", "2", "--schedule", "braided_v", "--steps", "2", "--save", str(ckpt),
                  "--metrics", str(first), forked=True))
    want = _losses(full)
    assert _losses(first) == want[:2]
    for n, layout in ((2, ["--tp", "1", "--pp", "2", "--schedule", "zb_v"]), (4, ["--pp", "4", "--schedule", "1f1b"])):
        out = tmp_path / f"resumed_{n}.jsonl"
        proc = _torchrun(n, LLM, *COMMON, *layout, *steps, "--resume", str(ckpt), "--metrics", str(out), forked=True)
        _ok(proc)
        assert "resharded to" in proc.stderr
        assert _close(_losses(out), want[2:], RESHARD_RTOL), (layout, _losses(out), want[2:])


def test_vlm_saved_at_tp2_pp2_resumes_at_dp2_and_in_one_process(tmp_path: Path) -> None:
    common = ["--mbs", "4", "--seed", "1", "--device", "cpu"]
    full, ckpt = tmp_path / "full.jsonl", tmp_path / "ckpt"
    _ok(_python(VLM, *common, "--steps", "5", "--metrics", str(full), forked=True))
    _ok(_torchrun(4, VLM, *common, "--tp", "2", "--pp", "2", "--schedule", "braided_v", "--steps", "2", "--save", str(ckpt),
                  forked=True))
    mid = tmp_path / "mid.jsonl"
    _ok(_torchrun(4, VLM, "--seed", "1", "--device", "cpu", "--pp", "2", "--dp", "2", "--mbs", "2", "--schedule", "zb_v",
                  "--steps", "4", "--resume", str(ckpt), "--save", str(ckpt), "--metrics", str(mid), forked=True))
    last = tmp_path / "last.jsonl"
    _ok(_python(VLM, *common, "--steps", "5", "--resume", str(ckpt), "--metrics", str(last), forked=True))
    want = _losses(full)
    assert _close(_losses(mid) + _losses(last), want[2:], RESHARD_RTOL), (_losses(mid), _losses(last), want)


# -- non-finite loss -------------------------------------------------------------------------------
def test_non_finite_loss_stops_before_any_save_naming_step_and_rank(tmp_path: Path) -> None:
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    proc = _python(LLM, *COMMON, "--steps", "3", "--init-std", "1e30", "--save", str(ckpt), "--metrics", str(metrics),
                   forked=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == ["qwen2.py: error: non-finite loss at step 1 (first on rank 0); stopped before the optimizer update, "
                      "nothing saved from this step on -- lower --lr or --init-std"], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not list(ckpt.glob("step_*")) and metrics.read_text() == ""


def test_diverging_run_keeps_its_earlier_checkpoints_and_strict_metrics(tmp_path: Path) -> None:
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    proc = _python(LLM, *COMMON, "--steps", "8", "--lr", "1e6", "--save", str(ckpt), "--save-every", "1",
                   "--keep-checkpoints", "10", "--metrics", str(metrics), forked=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("qwen2.py: error: non-finite") and "(first on rank 0)" in line, line
    bad_step = int(line.split(" at step ")[1].split()[0])
    assert bad_step > 1
    assert (ckpt / "latest").read_text().strip() == f"step_{bad_step - 1:08d}"
    assert [_strict(x)["step"] for x in metrics.read_text().splitlines()] == list(range(1, bad_step))


def test_non_finite_loss_names_the_last_stage_rank_under_torchrun(tmp_path: Path) -> None:
    proc = _torchrun(2, LLM, *COMMON, "--pp", "2", "--schedule", "1f1b", "--steps", "2", "--init-std", "1e30")
    assert proc.returncode != 0
    from test_examples import _torchrun_summary_reads

    # 1f1b: the last stage is on rank 1; every rank stops with exit code 1 and the line
    _torchrun_summary_reads(proc.stdout + proc.stderr, "qwen2.py: error: non-finite loss at step 1 (first on rank 1)", 2, code=1)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plain_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    """A rank started as a launcher without an agent would start it (``RANK``/``WORLD_SIZE``/``MASTER_*``)."""
    return dict(_env(), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port), **extra)


@pytest.mark.parametrize("killed,line", [
    (2, "qwen2.py: error: rank 0 stops: rank 2 is gone: its process exited or was killed (it closed its connections; see "
        "that rank's log)"),
    # the store's host: the lowest survivor says so (no rank printed anything before)
    (0, "qwen2.py: error: rank 1 stops: the job's store cannot be reached (the rank that hosts it, rank 0, has exited or "
        "was killed)"),
], ids=["rank-2", "rank-0-the-store-host"])
def test_a_killed_rank_is_named_in_one_line_by_the_survivors(tmp_path: Path, killed: int, line: str) -> None:
    """Three ranks started as a launcher without an agent would (``RANK``/``WORLD_SIZE``/``MASTER_*``,
    rank 0 hosting the store); one is killed mid-run. The survivors stop at once (a closed connection,
    not a timeout) and the job says so in one line naming the killed rank -- no gloo error, no traceback --
    and each survivor exits 1."""
    port = _free_port()
    metrics = tmp_path / "m.jsonl"
    procs = []
    for r in range(3):
        procs.append(subprocess.Popen([sys.executable, LLM, *COMMON, "--pp", "3", "--schedule", "1f1b", "--steps", "10000",
                                       "--timeout", "120", *(["--metrics", str(metrics)] if r == 0 else [])],
                                      env=_plain_env(r, 3, port), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
    survivors = [p for r, p in enumerate(procs) if r != killed]
    try:
        end = time.monotonic() + 240
        while _logged_step(metrics) < 2 and all(p.poll() is None for p in procs) and time.monotonic() < end:
            time.sleep(0.05)
        assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
        procs[killed].kill()
        errs = [p.communicate(timeout=60)[1] for p in survivors]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    lines = [ln for e in errs for ln in e.splitlines() if ln.startswith("qwen2.py: error:")]
    assert len(lines) == 1 and lines[0].startswith(line), errs
    assert [p.returncode for p in survivors] == [1, 1], errs
    text = "".join(errs)
    assert "Traceback" not in text and "pair.cc" not in text and "did not finish within" not in text, text[-3000:]


# A rank that reaches the store and then ends, as one killed while preparing its model and data would;
# rank 0 waits for the other's arrival first (so that the other joined a store that was there).
_JOIN_AND_EXIT = """
import os, time
from braid.runtime.store import JOINED_PREFIX, join
joined = join(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
while joined.rank == 0 and not joined.store.check([JOINED_PREFIX + "0/1"]):
    time.sleep(0.01)
time.sleep(0.2)
os._exit(3)
"""


@pytest.mark.parametrize("case,line", [
    ("rank 1 ends while preparing", "qwen2.py: error: rank 0 stops: rank 1 is gone before the start: its process exited "
                                    "or was killed"),
    ("rank 0 ends while preparing", "qwen2.py: error: rank 1 stops: the job's store cannot be reached (the rank that "
                                    "hosts it, rank 0, has exited or was killed)"),
    ("rank 1 never starts", "qwen2.py: error: rank 0 stops: rank 1 did not join within 2 s of the start"),
    ("rank 0 never starts", "qwen2.py: error: rank 1 stops: the job's store at 127.0.0.1:{port} did not answer within 2 s"),
], ids=["rank-1-ends-while-preparing", "rank-0-ends-while-preparing", "rank-1-never-starts", "rank-0-never-starts"])
def test_plain_ranks_name_a_dead_or_missing_rank_at_start_up(case: str, line: str) -> None:
    """Ranks started as plain processes meet before the process group with a join timeout of their own (2 s
    here, BRAID_JOIN_TIMEOUT_S), not the step --timeout (120 s here): a rank that reached the store and ended
    is named as gone at once, one that never came after the join timeout, a store whose host ended names
    rank 0. The survivor says so in one line (exit 1): no store error, no traceback."""
    port = _free_port()
    other = 1 - int(case[5])  # the real rank: the one the case does not name
    fake = None
    if "ends" in case:
        fake = subprocess.Popen([sys.executable, "-c", _JOIN_AND_EXIT], env=_plain_env(1 - other, 2, port), cwd=ROOT)
    try:
        if other == 1:
            time.sleep(1.0 if fake else 0.0)  # the store's host first (it may also come later: the join waits)
        proc = subprocess.run([sys.executable, LLM, *COMMON, "--pp", "2", "--steps", "2", "--timeout", "120"],
                              env=_plain_env(other, 2, port, BRAID_JOIN_TIMEOUT_S="2"), cwd=ROOT, capture_output=True,
                              text=True, timeout=100)
    finally:
        if fake is not None:
            fake.kill()
            fake.wait()
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(line.format(port=port)), proc.stderr[-3000:]


def test_a_save_past_the_file_size_limit_is_one_line_and_keeps_the_last_checkpoint(saved: Path, tmp_path: Path) -> None:
    """Under ``ulimit -f`` (a file size limit below a checkpoint shard's size) the save fails with torch's
    CheckpointException, a BaseException: one line naming the directory and the cause, exit 1, the
    partial step removed and ``latest`` still naming the previous, sound checkpoint."""
    import resource
    import shutil

    from braid.training.checkpoint import verify

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    limit = 256 << 10
    assert max(f.stat().st_size for f in ckpt.rglob("*.distcp")) > limit
    proc = subprocess.run([sys.executable, LLM, *COMMON, "--steps", "2", "--resume", str(ckpt), "--save", str(ckpt)],
                          env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=180,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors == [f"qwen2.py: error: {ckpt}: file size limit reached (ulimit -f) while writing step_00000002 (nothing "
                      f"of it is kept; {ckpt}/latest still names step_00000001); raise the limit and resume"], proc.stderr[-3000:]
    assert (ckpt / "latest").read_text().strip() == "step_00000001" and not list(ckpt.glob(".step_*"))
    assert verify(ckpt / "step_00000001") == []


# -- bad input ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("saved") / "ckpt"
    _ok(_python(LLM, *COMMON, "--steps", "1", "--save", str(ckpt), forked=True))
    return ckpt


BAD_FLAGS = [
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--lr", "0"], "--lr must be a finite number > 0"),
    (["--lr=-1e-3"], "--lr must be a finite number > 0"),
    (["--init-std", "inf"], "--init-std must be a finite number > 0, got inf"),
    (["--timeout", "0"], "--timeout must be a finite number > 0"),
    (["--timeout", "nan"], "--timeout must be a finite number > 0"),
    (["--save-every", "-1"], "--save-every must be >= 0"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be >= 1"),
    (["--reference-rtol", "nan"], "--reference-rtol must be a finite number >= 0, got nan"),
    (["--reference-rtol", "-1"], "--reference-rtol must be a finite number >= 0"),
    (["--peak-tflops", "inf"], "--peak-tflops must be a finite number >= 0"),
    (["--mbs", "0"], "--mbs must be >= 1"),
    (["--dp", "0"], "--dp must be >= 1"),
    (["--metrics", "{tmp}/missing/m.jsonl"], "directory '{tmp}/missing' does not exist"),
    (["--metrics", "{tmp}"], "is a directory"),
    (["--trace", "{tmp}/missing/t.json"], "does not exist"),
    (["--metrics", "{tmp}/a.json", "--trace", "{tmp}/a.json"], "is also an input"),
    (["--save", "{tmp}/file"], "is a file; give a directory"),
    pytest.param(["--save", "{tmp}/ro/ckpt"], "is not writable",
                 marks=pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")),
    (["--tensorboard", "{tmp}/file"], "is a file; give a directory"),
    (["--resume", "{tmp}/missing"], "no such directory"),
    (["--resume", "{tmp}"], "no checkpoint there"),
    (["--config", "{tmp}/missing.toml"], "missing.toml: no such run file"),
    (["--config", "{tmp}/bad.toml"], "not valid TOML"),
    (["--config", "{tmp}/unknown.toml"], "unknown setting 'bogus'"),
    (["--config", "{tmp}/wrong.toml"], "argument --tp: invalid int value: 'two'"),
    (["--steps", str(10**20)], f"--steps {10**20}: at most 100,000,000"),
    (["--seq", str(10**12)], f"--seq {10**12}: at most 16,777,216"),
    (["--micro-batch-size", str(10**9)], "--micro-batch-size 1000000000: at most 65,536"),
    (["--last-stage-lighter", "1e308"], "1e308: at most 1024 layers"),
    (["--timeout", "1e308"], "--timeout 1e+308: at most 86,400 s"),
    (["--keep-checkpoints", str(10**12)], "--keep-checkpoints 1000000000000: at most 100,000"),
]


@pytest.mark.parametrize("args,message", BAD_FLAGS, ids=[" ".join(getattr(c, "values", c)[0]) for c in BAD_FLAGS])
def test_bad_input_is_one_line_exit_2_before_any_work(tmp_path: Path, capsys, monkeypatch, args: list[str], message: str) -> None:
    """In-process (the checks run before any process group; the subprocess cases above and below cover the launch)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import qwen2
    import train_loop

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    (tmp_path / "file").write_text("x")
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o500)
    (tmp_path / "bad.toml").write_text("steps = = 2\n")
    (tmp_path / "unknown.toml").write_text("bogus = 1\n")
    (tmp_path / "wrong.toml").write_text('tp = "two"\n')
    before = sorted(p.name for p in tmp_path.rglob("*"))
    try:
        code = train_loop.main(qwen2.TASK, [a.format(tmp=tmp_path) for a in args])
    finally:
        (tmp_path / "ro").chmod(0o700)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qwen2.py: error:") and message.format(tmp=tmp_path) in lines[0], err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written


def _flip(p: Path) -> None:
    b = bytearray(p.read_bytes())
    for i in range(8):
        b[(len(b) // 9) * (i + 1)] ^= 0xFF
    p.write_bytes(bytes(b))


DAMAGED = {
    "truncated": (lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:1000]), "truncated or damaged"),
    "empty": (lambda d: (d / "__0_0.distcp").write_bytes(b""), "has 0 bytes"),
    "flipped": (lambda d: _flip(d / "__0_0.distcp"), "does not match its checksum"),
    "missing": (lambda d: (d / ".metadata").unlink(), ".metadata is missing"),
}


def _in_process(args: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """qwen2.py's main in this process, as one process: (exit code, stderr). For checks made before any work."""
    from test_examples import _in_process as run

    rc, _, err = run(LLM, args, monkeypatch, capsys)
    return rc, err


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_damaged_checkpoint_is_one_line_exit_2(saved: Path, tmp_path: Path, case: str, monkeypatch, capsys) -> None:
    """The checksum case through the script as a user runs it; the others in this process (the same check, before
    any process group)."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    damage, message = DAMAGED[case]
    damage(ckpt / (ckpt / "latest").read_text().strip())
    if case == "flipped":
        proc = _python(LLM, *COMMON, "--steps", "2", "--resume", str(ckpt), forked=True)
        rc, err = proc.returncode, proc.stderr
    else:
        rc, err = _in_process([*COMMON, "--steps", "2", "--resume", str(ckpt)], monkeypatch, capsys)
    assert rc == 2, err[-2000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err, err[-2000:]


def test_resume_with_another_model_is_one_line(saved: Path, monkeypatch, capsys) -> None:
    rc, err = _in_process(["--model", "small", "--steps", "2", "--resume", str(saved)], monkeypatch, capsys)
    assert rc == 2
    assert err.strip().splitlines() == [line for line in err.strip().splitlines() if "saved for another model" in line]


def test_resume_of_the_own_save_directory_before_any_save_starts_fresh(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    (tmp_path / "ckpt").mkdir()
    (ckpt / ".step_00000001.partial").mkdir()  # a first save that was killed
    proc = _python(LLM, *COMMON, "--steps", "1", "--save", str(ckpt), "--resume", str(ckpt), forked=True)
    _ok(proc)
    assert "no complete checkpoint there yet" in proc.stderr
    assert (ckpt / "latest").read_text().strip() == "step_00000001" and not list(ckpt.glob(".step_*"))


def test_help_prints_once_under_torchrun() -> None:
    proc = _torchrun(2, LLM, "--help", timeout=120)
    _ok(proc)
    assert proc.stdout.count("usage: qwen2.py") == 1, proc.stdout[-2000:]


def test_run_file_with_command_line_override_and_replay(tmp_path: Path) -> None:
    run_file, first, again = tmp_path / "run.toml", tmp_path / "first.jsonl", tmp_path / "again.jsonl"
    run_file.write_text(f'seq = 16\nmbs = 4\nseed = 1\ndevice = "cpu"\nsteps = 3\nmetrics = "{first}"\n')
    _ok(_python(LLM, "--config", str(run_file), "--steps", "2", forked=True))
    assert [_strict(x)["step"] for x in first.read_text().splitlines()] == [1, 2]
    effective = first.with_suffix(".toml")
    assert "steps = 2" in effective.read_text()
    _ok(_python(LLM, "--config", str(effective), "--metrics", str(again), forked=True))
    assert _losses(again) == _losses(first)


def test_tensorboard_events_beside_the_metrics(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    tb = tmp_path / "tb"
    _ok(_python(LLM, *COMMON, "--steps", "2", "--tensorboard", str(tb), forked=True))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert [e.step for e in acc.Scalars("braided_v/loss")] == [1, 2]


def test_wandb_offline_run_holds_the_metrics(tmp_path: Path) -> None:
    """--wandb PROJECT with WANDB_MODE=offline: a local run folder (every wandb path in the test's
    directory) whose records carry the per-step metrics, under the names TensorBoard gets."""
    pytest.importorskip("wandb")
    env = {**_env(), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           **{k: str(tmp_path) for k in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR")}}
    proc = subprocess.run([str(shared_bin() / "python"), LLM, *COMMON, "--steps", "2", "--wandb", "braid-test"], env=env,
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)
    _ok(proc)
    (run,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    data = run.read_bytes()
    assert b"braided_v/loss" in data and b"braided_v/tokens_per_s" in data and b"braid-test" in data


@pytest.mark.gpu
@pytest.mark.timeout(300)  # three torchrun jobs of at most 90 s each
def test_gpu_bf16_saved_at_tp2_pp2_resumes_at_tp1_pp2(tmp_path: Path) -> None:
    """On 4 GPUs (NCCL, bf16): the same resharding as on CPU, within the bf16 tolerance of --reference."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 4:
        pytest.skip("needs 4 CUDA devices")
    common = ["--seq", "16", "--mbs", "4", "--seed", "1", "--device", "cuda", "--no-compile"]
    full, first, second, ckpt = tmp_path / "full.jsonl", tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "ckpt"
    _ok(_torchrun(4, LLM, *common, "--tp", "2", "--pp", "2", "--steps", "4", "--metrics", str(full), timeout=90))
    _ok(_torchrun(4, LLM, *common, "--tp", "2", "--pp", "2", "--steps", "2", "--save", str(ckpt), "--metrics", str(first), timeout=90))
    _ok(_torchrun(2, LLM, *common, "--pp", "2", "--schedule", "zb_v", "--steps", "4", "--resume", str(ckpt), "--metrics", str(second), timeout=90))
    assert _close(_losses(first) + _losses(second), _losses(full), 2e-2), (_losses(first), _losses(second), _losses(full))
