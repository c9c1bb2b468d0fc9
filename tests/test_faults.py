"""Failure reports between ranks, with real gloo processes on CPU that raise, get killed or stall.

Each scenario starts its own 2-3 processes (a killed rank cannot serve a shared pool) and
collects what every surviving rank reports: the class and text of the exception its
communication wait raised, and the job's failure record. The first failing rank must be
named with its own exception text by every other rank, whichever ranks fail after it; a
killed peer must be reported as a closed connection, not as a timeout; a peer that is
alive but silent must be reported as a timeout.
"""

from __future__ import annotations

import datetime
import os
import queue
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from braid.runtime.distributed import (
    ABORT_KEY,
    Abort,
    CommTimeout,
    PeerFailure,
    PeerLost,
    create_store,
    describe_exception,
)
from distributed_utils import free_port

FIRST_ERROR = "rank one exploded at step 3"


# ----------------------------------------------------------------------------------------
# Processes
# ----------------------------------------------------------------------------------------
def _report(err: BaseException) -> tuple[str, str]:
    return type(err).__name__, str(err)


def _recv_from(d, src: int) -> tuple[str, str] | None:
    """Post a receive from ``src`` and wait on it through the abort record; the exception it ends in."""
    t = torch.zeros(4)
    try:
        d.abort.wait(dist.irecv(t, src=src))
    except Exception as err:  # noqa: BLE001 - the report is what the test checks
        return _report(err)
    return None


def _scenario(rank: int, world: int, port: int, case: str, timeout_s: float, out) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from braid.runtime.distributed import Dist

    d = Dist.init(rank, world, master_port=port, timeout_s=timeout_s)
    dist.barrier()
    result: dict = {"rank": rank}
    if case == "raise":
        # rank 1 fails first; rank 2 fails later with its own error; 0 and 2 wait on rank 1.
        if rank == 1:
            try:
                with d.abort.on_failure():
                    time.sleep(0.3)
                    raise ValueError(FIRST_ERROR)
            except ValueError as err:
                result["own"] = _report(err)
            out.put(result)
            d.store.set("done/1", "1")
            d.close()
            return
        result["wait"] = _recv_from(d, 1)
        if rank == 2:
            result["later_kept"] = d.abort.fail(RuntimeError("a later failure on rank 2"))
        result["record"] = d.abort.first_failure()
    elif case == "kill":
        # rank 2 (not the store's host) is killed; 0 and 1 were waiting on it.
        if rank == 2:
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        result["wait"] = _recv_from(d, 2)
        try:
            d.abort.check()
            result["check"] = None
        except PeerFailure as err:
            result["check"] = _report(err)
    elif case in ("kill_in_all_reduce", "kill_in_gather_object"):
        # the last rank is killed in the loss all-reduce (or an object collective) of step 20: the
        # survivors next to it see the close at once, the others wait on a live neighbour
        try:
            for step in range(10**6):
                if rank == world - 1 and step == 20:
                    os.kill(os.getpid(), signal.SIGKILL)
                if case == "kill_in_all_reduce":
                    d.abort.all_reduce(torch.zeros(1 + 2 * world, dtype=torch.float64))
                else:
                    with d.abort.collective():
                        dist.all_gather_object([None] * world, (rank, step))
        except Exception as err:  # noqa: BLE001 - the report is what the test checks
            result["wait"] = _report(err)
            result["lost"] = getattr(err, "lost", None)
            d.abort.fail(err)
        try:
            d.abort.check()
        except PeerFailure as err:
            result["check"] = _report(err)
    elif case == "kill_store_host":
        if rank == 0:
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        result["wait"] = _recv_from(d, 0)
    elif case == "timeout":
        # rank 1 stays alive but never sends: rank 0's wait runs out of time.
        if rank == 1:
            d.store.wait(["rank0/done"], datetime.timedelta(seconds=120))
            out.put(result)
            d.close()
            return
        result["wait"] = _recv_from(d, 1)
        out.put(result)
        d.store.set("rank0/done", "1")
        d.close()
        return
    out.put(result)
    if rank == 0 and case != "kill_store_host":
        # rank 0 hosts the store: keep it until the other survivors have read the record.
        killed = {"kill": 2, "kill_in_all_reduce": world - 1, "kill_in_gather_object": world - 1}.get(case)
        others = [r for r in range(1, world) if r != killed]
        d.store.wait([f"done/{r}" for r in others], datetime.timedelta(seconds=120))
    else:
        try:
            d.store.set(f"done/{rank}", "1")
        except Exception:  # noqa: BLE001 - the store host may be gone (kill_store_host)
            pass
    out.close()
    out.join_thread()  # flush the report before the hard exit below
    os._exit(0)  # the peers are gone or failed: skip a destroy that would wait on them


def _run(case: str, world: int, timeout_s: float = 60.0) -> dict[int, dict]:
    """Run ``case`` on ``world`` spawned ranks; the results of the ranks that reported, by rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_scenario, args=(r, world, port, case, timeout_s, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    expected = world - (1 if case.startswith("kill") else 0)
    got: dict[int, dict] = {}
    try:
        while len(got) < expected:
            try:
                res = out.get(timeout=90)
            except queue.Empty:
                pytest.fail(f"{case}: ranks {sorted(set(range(world)) - set(got))} hung (no report in 90 s)")
            got[res["rank"]] = res
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return got


# ----------------------------------------------------------------------------------------
# Scenarios
# ----------------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_first_failing_rank_is_named_by_every_rank() -> None:
    got = _run("raise", 3)
    assert got[1]["own"] == ("ValueError", FIRST_ERROR)
    for r in (0, 2):
        kind, text = got[r]["wait"]
        assert kind == "PeerFailure", got[r]
        assert "rank 1 failed first" in text and f"ValueError: {FIRST_ERROR}" in text, text
        assert got[r]["record"] == (1, f"ValueError: {FIRST_ERROR}")
    # rank 2's own, later failure did not overwrite the record
    assert got[2]["later_kept"] is False


@pytest.mark.timeout(240)
def test_killed_rank_is_a_closed_peer_not_a_timeout() -> None:
    got = _run("kill", 3, timeout_s=60.0)
    assert set(got) == {0, 1}
    for r in (0, 1):
        kind, text = got[r]["wait"]
        assert kind == "PeerLost", got[r]
        assert "closed its connection" in text and "did not finish within" not in text, text
        assert text.startswith(f"rank {r} stops: rank 2 is gone"), text  # the roll call named it
        # nobody recorded a failure: no rank blames another
        assert got[r]["check"] is None


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["kill_in_all_reduce", "kill_in_gather_object"])
def test_a_rank_killed_in_a_collective_is_named_by_every_survivor(case: str) -> None:
    """Rank 3 of 4 killed inside the loss all-reduce (through Abort.all_reduce) or an object
    collective (inside Abort.collective): every survivor stops with one PeerLost naming rank 3
    -- not gloo's raw error, not a timeout -- and the record names it for the ranks that read it."""
    got = _run(case, 4, timeout_s=60.0)
    assert set(got) == {0, 1, 2}
    for r in (0, 1, 2):
        kind, text = got[r]["wait"]
        assert kind == "PeerLost" and got[r]["lost"] == [3], got[r]
        assert text.startswith(f"rank {r} stops: rank 3 is gone"), text
        assert "did not finish within" not in text and "pair.cc" not in text, text
        assert got[r]["check"][0] == "PeerLost" and got[r]["check"][1].startswith(f"rank {r} stops: rank 3 is gone"), got[r]


@pytest.mark.timeout(240)
def test_killed_store_host_is_a_lost_peer() -> None:
    got = _run("kill_store_host", 2, timeout_s=60.0)
    kind, text = got[1]["wait"]
    assert kind == "PeerLost", got[1]
    assert "did not finish within" not in text and ("closed its connection" in text or "store cannot be reached" in text)


@pytest.mark.timeout(240)
def test_silent_peer_is_a_timeout() -> None:
    got = _run("timeout", 2, timeout_s=2.0)
    kind, text = got[0]["wait"]
    assert kind == "CommTimeout", got[0]
    assert "did not finish within 2 s" in text, text
    assert "silent: rank 1 (alive" in text, text  # rank 1 never timed out itself: it is the one to look at


def _fails_on_rank_one(d) -> None:
    if d.rank == 1:
        raise ValueError(FIRST_ERROR)
    _raise_wait(d, 1)


def _raise_wait(d, src: int) -> None:
    d.abort.wait(dist.irecv(torch.zeros(4), src=src))


@pytest.mark.timeout(240)
def test_launch_report_leads_with_the_first_failure() -> None:
    from braid.measure.launch import JobFailed
    from braid.measure.launch import launch

    with pytest.raises(JobFailed) as info:
        launch(2, "cpu", _fails_on_rank_one)
    first_line = str(info.value).splitlines()[0]
    assert first_line == f"rank 1 failed first: ValueError: {FIRST_ERROR}"
    assert "--- rank 0 ---" in str(info.value) and "PeerFailure" in str(info.value)


def _killed_on_rank_one(d) -> None:
    if d.rank == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    _raise_wait(d, 1)


@pytest.mark.timeout(240)
def test_launch_names_a_killed_rank_and_does_not_wait_for_it() -> None:
    from braid.measure.launch import JobFailed
    from braid.measure.launch import launch

    with pytest.raises(JobFailed) as info:
        launch(2, "cpu", _killed_on_rank_one)
    text = str(info.value)
    assert text.splitlines()[0] == "rank 1 died first: its process was killed by SIGKILL without a report", text
    assert "PeerLost" in text and "closed its connection" in text  # rank 0's own report


# ----------------------------------------------------------------------------------------
# The record and the classification, in one process
# ----------------------------------------------------------------------------------------
def test_first_writer_wins_among_racing_ranks() -> None:
    store = create_store(0, 2, "127.0.0.1", free_port(), datetime.timedelta(seconds=10))
    aborts = [Abort(store, r, 5.0) for r in range(8)]
    won: list[int] = []
    barrier = threading.Barrier(len(aborts))

    def go(a: Abort) -> None:
        barrier.wait()
        if a.fail(ValueError(f"failure of rank {a.rank}")):
            won.append(a.rank)

    threads = [threading.Thread(target=go, args=(a,)) for a in aborts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1
    first = aborts[3].first_failure()
    assert first == (won[0], f"ValueError: failure of rank {won[0]}")
    with pytest.raises(PeerFailure, match=f"rank 5 stops: rank {won[0]} failed first: ValueError: failure of rank {won[0]}"):
        aborts[5].check()
    aborts[0].clear()
    assert not store.check([ABORT_KEY]) and aborts[0].first_failure() is None


def test_peer_failure_is_not_recorded_as_a_new_failure() -> None:
    a = Abort(dist.HashStore(), 2)
    assert a.fail(PeerFailure("rank 2 stops: rank 1 failed first: x", 1, "x")) is False
    assert a.first_failure() is None
    assert a.fail(PeerLost("rank 2: a peer closed its connection")) is True
    assert a.first_failure() == (2, "PeerLost: rank 2: a peer closed its connection")


def test_wait_reads_the_record_before_blocking_at_most_every_check_every_s(monkeypatch) -> None:
    """Each read of the record is a round trip to the store: a burst of waits reads it once,
    a wait after the interval reads it again, and a record already there stops the wait."""

    class Done:
        def wait(self, timeout=None) -> bool:
            return True

    a = Abort(dist.HashStore(), 0, check_every_s=60.0)
    reads = []
    real = Abort.check
    monkeypatch.setattr(Abort, "check", lambda self: (reads.append(1), real(self))[1])
    for _ in range(5):
        a.wait(Done())
    assert len(reads) == 1
    a.check_every_s = 0.0
    a.wait(Done())
    assert len(reads) == 2
    Abort(a.store, 1).fail(ValueError("boom"))
    with pytest.raises(PeerFailure, match="rank 1 failed first: ValueError: boom"):
        a.wait(Done())


def test_a_raw_closed_connection_is_recorded_as_a_lost_peer() -> None:
    a = Abort(dist.HashStore(), 3)
    assert a.fail(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234. This is typically ..."))
    rank, reason = a.first_failure()
    assert rank == 3 and reason.startswith("PeerLost: rank 3: a peer closed its connection (its process exited")


def test_a_lost_rank_still_answering_for_a_moment_is_asked_again(monkeypatch) -> None:
    """A killed rank's liveness socket can outlast the connection whose close told a survivor by
    a few milliseconds: every peer answers at first, and the survivor asks again until one does
    not, instead of blaming itself; where all keep answering past the settle time, it names none."""
    import braid.runtime.liveness as liveness

    answers = iter([[], [], [2]])
    asked = []
    monkeypatch.setattr(liveness, "lost_ranks", lambda *a: (asked.append(1), next(answers))[1])
    a = Abort(dist.HashStore(), 1, world_size=3)
    got = a.classify(RuntimeError("Connection reset by peer"), 0.0)
    assert isinstance(got, PeerLost) and got.lost == [2] and len(asked) == 3
    assert str(got).startswith("rank 1 stops: rank 2 is gone")
    monkeypatch.setattr(liveness, "lost_ranks", lambda *a: [])
    monkeypatch.setattr("braid.runtime.distributed.LOST_SETTLE_S", 0.1)
    got = a.classify(RuntimeError("Connection reset by peer"), 0.0)
    assert isinstance(got, PeerLost) and got.lost == [] and "a peer closed its connection" in str(got)


@pytest.mark.parametrize("text,elapsed,expected", [
    ("[pair.cc:553] Connection closed by peer [127.0.0.1]:18608. This is typically caused by a remote worker crashing.",
     0.6, PeerLost),
    ("Connection reset by peer", 0.6, PeerLost),
    ("Failed to recv, got 0 bytes. Connection was likely closed.", 0.1, PeerLost),
    ("[unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete", 3.0, CommTimeout),
    ("Application timeout caused pair closure", 3.0, CommTimeout),
    ("something else entirely", 5.0, CommTimeout),  # ran the whole timeout
    ("something else entirely", 0.2, RuntimeError),
])
def test_classify(text: str, elapsed: float, expected: type) -> None:
    got = Abort(dist.HashStore(), 0, timeout_s=5.0).classify(RuntimeError(text), elapsed)
    assert type(got) is expected
    if expected is PeerLost:
        assert "did not finish within" not in str(got) and f"after {elapsed:.1f} s" in str(got)
    if expected is CommTimeout:
        assert "did not finish within 5 s" in str(got)


def test_translate_reports_raw_communication_failures_only() -> None:
    """Abort.collective / translate: gloo's raw error becomes the report a wait would give; an
    exception of the program (its own type, even one whose text says "timeout") passes unchanged."""

    class OwnError(RuntimeError):
        pass

    a = Abort(dist.HashStore(), 0, timeout_s=5.0)
    raw = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234. This is typically ...")
    assert type(a.translate(raw)) is PeerLost
    for err in (OwnError("--timeout must be positive"), ValueError("Connection closed"), RuntimeError("shape mismatch")):
        assert a.translate(err) is err
    with pytest.raises(PeerLost) as info:
        with a.collective():
            raise raw
    assert info.value.__cause__ is raw
    Abort(a.store, 1).fail(ValueError("boom"))
    with pytest.raises(PeerFailure, match="rank 1 failed first: ValueError: boom"):  # the record is read first
        with a.collective():
            pass


def test_describe_exception() -> None:
    assert describe_exception(ValueError("bad thing")) == "ValueError: bad thing"
    assert describe_exception(KeyboardInterrupt()) == "KeyboardInterrupt"


# ----------------------------------------------------------------------------------------
# Stores stay on this machine
# ----------------------------------------------------------------------------------------
def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a socket listening on ``port`` (from /proc/net/tcp and tcp6)."""
    out = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                out.add(addr)
    return out


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs /proc/net/tcp (Linux)")
def test_local_store_listens_on_loopback_only() -> None:
    port = free_port()
    store = create_store(0, 2, "127.0.0.1", port, datetime.timedelta(seconds=10))
    addrs = _listening_addresses(port)
    assert addrs == {"0100007F"}, addrs  # 127.0.0.1, little-endian hex; not 0.0.0.0 or ::
    store.set("k", "v")
    client = create_store(1, 2, "127.0.0.1", port, datetime.timedelta(seconds=10))
    assert client.get("k") == b"v"


def test_single_process_store_opens_no_port() -> None:
    store = create_store(0, 1, "127.0.0.1", free_port(), datetime.timedelta(seconds=10))
    assert isinstance(store, dist.HashStore)


# ----------------------------------------------------------------------------------------
# The test harness's own pool: a dead or stuck rank ends the case with a report, not a wait
def _exit_on_rank_one(ctx) -> int:
    if ctx.rank == 1:
        os._exit(7)
    return ctx.rank


def _rank(ctx) -> int:
    return ctx.rank


def _stuck_on_rank_one(ctx) -> int:
    if ctx.rank == 1:
        time.sleep(8)  # past the case's 3 s and the 2 s the pool gives the stacks; then it ends (the pool's close
        # waits up to 10 s for a rank to exit before killing it: a 60 s sleep spent all 10 of them)
    return ctx.rank


def test_pool_reports_a_dead_rank_at_once() -> None:
    from distributed_utils import DistPool

    pool = DistPool(2, timeout_s=30)
    try:
        t0 = time.monotonic()
        with pytest.raises(AssertionError, match=r"ranks \[1\] did not answer: rank processes died \(exit codes \{1: 7\}\)"):
            pool.run(_exit_on_rank_one, timeout_s=120)
        assert time.monotonic() - t0 < 60, "the pool waited out its timeout for a rank that had died"
    finally:
        pool.close()


def test_pool_prints_a_stuck_ranks_stacks_on_timeout(capfd) -> None:
    from distributed_utils import DistPool

    pool = DistPool(2, timeout_s=30)
    try:
        assert pool.run(_rank, timeout_s=120) == [0, 1]  # started: the 3 s below are the case's alone
        with pytest.raises(AssertionError, match=r"ranks \[1\] did not answer: no answer within 3 s"):
            pool.run(_stuck_on_rank_one, timeout_s=3)
    finally:
        pool.close()
    err = capfd.readouterr().err
    assert "in _stuck_on_rank_one" in err, err[-2000:]


def _write_pid_and_sleep(d, folder: str) -> None:
    with open(os.path.join(folder, f"rank{d.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc (Linux)")
def test_ranks_of_a_killed_launcher_exit(tmp_path) -> None:
    """``launch``'s ranks end when the launcher is killed (SIGKILL skips its clean-up), instead
    of running their job to the end with their devices and ports held."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from braid.measure.launch import launch; import test_faults; "
            "launch(2, 'cpu', test_faults._write_pid_and_sleep, sys.argv[2])")
    launcher = subprocess.Popen([sys.executable, "-c", code, here, str(tmp_path)])
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("rank*.pid"))) < 2:
            assert launcher.poll() is None, f"the launcher ended early ({launcher.returncode})"
            assert time.monotonic() < deadline, "the ranks did not start within 120 s"
            time.sleep(0.2)
        time.sleep(0.5)  # let both pid files be written in full
        pids = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*.pid"))]
        assert all(_alive(p) for p in pids)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), f"ranks {[p for p in pids if _alive(p)]} outlived their launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in tmp_path.glob("rank*.pid"):
            try:
                os.kill(int(p.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


# ----------------------------------------------------------------------------------------
# How a failed rank ends (braid.runtime.ending): torchrun's summary reads the line
def test_the_error_file_gives_torchruns_summary_the_line(tmp_path, monkeypatch, capsys) -> None:
    """The file torch elastic's agent reads for its failure summary holds the line, not a
    traceback: torch's own ProcessFailure and ChildFailedError show it as the rank's error."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from braid.runtime.ending import end_run

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    line = "qwen2.py: error: no tokenizer.json in 'nope'"
    assert end_run(line, 2, rank=0, world=1) == 2
    assert capsys.readouterr().err == line + "\n"  # printed once, by the one rank
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    summary = ChildFailedError("qwen2.py", {0: failure}).format_msg()
    assert f"traceback : {line}" in summary and "To enable traceback" not in summary, summary
