"""Python commands without an interpreter start-up each: a server that imported torch once forks a child per command.

``ForkServer(bin_dir, env, cwd)`` starts the server (``python forkserver.py SOCKET``, with ``env``
and ``cwd``) and writes two executables into ``bin_dir``: ``python`` and ``torchrun``. Put
``bin_dir`` first on ``PATH`` and a shell runs ``python -m braid.simulate ...``, ``python
script.py ...`` or ``torchrun ...`` as usual, except that each is a child forked from the server
(torch, its distributed package and Dynamo already imported) instead of a new interpreter. The
child is a process of its own: it takes the caller's arguments, working directory, environment
and open file descriptors, runs the module, script, code or torchrun's ``main`` as ``__main__``,
and its exit code (or the signal that ended it) becomes the caller's; a signal sent to the
caller is passed on to it. ``sys.executable`` is the ``python`` shim in the child, so the
workers torchrun starts are forked from the server too. Anything the shim does not understand
(another interpreter option, no server) runs in the real interpreter instead.

:func:`shared_bin` is the session's server. The docs test runs its commands this way, and the example
tests their training runs where the launch is not what they check (``test_examples.forked``): on a
2-core CI machine an interpreter that imports torch takes seconds, and those tests start many.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

# What the server imports before it forks: the start-up every command would pay (torch imports
# Dynamo lazily on the first optimizer or meta-device initialisation).
# (Not a module a command runs as ``__main__``, e.g. torch.distributed.run: runpy would warn that it was imported.)
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.elastic.agent.server.api", "torch.optim",
           "numpy")

SHIM = r'''#!{python} -S
import json, os, signal, socket, sys

REAL, SOCK, KIND = {python!r}, {sock!r}, {kind!r}


def fallback():
    argv = [REAL, *sys.argv[1:]] if KIND == "python" else [REAL, "-m", "torch.distributed.run", *sys.argv[1:]]
    os.execv(REAL, argv)


args = sys.argv[1:]
if KIND == "python":
    i, ok = 0, True
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-", "-m", "-c"):
        if args[i] not in ("-u", "-B"):
            ok = False  # another option: the real interpreter
        i += 1
    if not ok or (i == len(args) and sys.stdin.isatty()):
        fallback()
fds = []
for name in os.listdir("/proc/self/fd"):
    fd = int(name)
    try:
        if fd <= 2 or os.get_inheritable(fd):
            os.fstat(fd)
            fds.append(fd)
    except OSError:
        pass
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(SOCK)
except OSError:
    fallback()
msg = json.dumps({{"kind": KIND, "argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ), "fds": fds}}).encode()
socket.send_fds(s, [len(msg).to_bytes(8, "big") + msg], fds)
f = s.makefile("rb")
pid = int(f.readline())


def forward(n):
    try:
        os.kill(pid, n)
    except OSError:  # it has ended
        pass


for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, lambda n, _f: forward(n))
line = f.readline()
code = int(line) if line else 1
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
'''


class ForkServer:
    """The server process and the shims in ``bin_dir`` that send it commands (see the module doc)."""

    def __init__(self, bin_dir: Path, env: dict[str, str], cwd: Path) -> None:
        bin_dir.mkdir(parents=True, exist_ok=True)
        self.bin_dir = bin_dir
        self.sock = str(bin_dir / "forkserver.sock")
        for stale in (self.sock, self.sock + ".tmp"):
            if os.path.exists(stale):
                os.unlink(stale)
        for kind in ("python", "torchrun"):
            shim = bin_dir / kind
            shim.write_text(SHIM.format(python=sys.executable, sock=self.sock, kind=kind))
            shim.chmod(0o755)
        log = bin_dir / "forkserver.log"  # the server's own output (a pipe nobody reads could fill and stop it)
        with open(log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, __file__, self.sock, str(bin_dir / "python")], env=env, cwd=cwd,
                                         stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.sock):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the fork server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_SHARED: list[ForkServer] = []


def shared_bin() -> Path:
    """The ``bin`` folder (``python``, ``torchrun``) of this test session's fork server, started on first use
    and stopped when the session's process exits. Each command brings its own directory and environment."""
    if not _SHARED or _SHARED[0].proc.poll() is not None:
        import atexit
        import shutil
        import tempfile

        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        home = Path(tempfile.mkdtemp(prefix="braid-fork-"))
        server = ForkServer(home / "bin", env, home)
        _SHARED[:] = [server]
        atexit.register(lambda: (server.close(), shutil.rmtree(home, ignore_errors=True)))
    return _SHARED[0].bin_dir


# ----------------------------------------------------------------------------------------
# The server
# ----------------------------------------------------------------------------------------
def _child(req: dict, shim: str) -> int:
    """Become the command ``req`` describes (in the forked child); returns its exit code."""
    import runpy

    import torch

    argv, kind = req["argv"], req["kind"]
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    # intra-op threads as a new interpreter would start with them (OpenMP read the server's environment)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else _THREADS)
    sys.executable = shim  # torchrun's workers: forked too (multiprocessing's spawn keeps the real interpreter)
    base = [p for p in sys.path[1:] if p not in _ZYGOTE_PYTHONPATH]
    extra = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    args = argv[1:]
    if kind == "torchrun":
        sys.argv = ["torchrun", *args]
        sys.path[:] = [os.path.dirname(shim), *extra, *base]
        from torch.distributed.run import main

        main()
        return 0
    unbuffered = False
    while args and args[0].startswith("-") and args[0] not in ("-", "-m", "-c"):
        unbuffered |= args[0] == "-u"
        args = args[1:]
    if unbuffered:
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    if not args or args[0] == "-":
        sys.argv = ["-", *args[1:]]
        sys.path[:] = ["", *extra, *base]
        code = compile(sys.stdin.read(), "<stdin>", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    elif args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[:] = ["", *extra, *base]
        exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    elif args[0] == "-m":
        sys.argv = [args[1], *args[2:]]  # runpy sets argv[0] to the module's file
        sys.path[:] = [os.getcwd(), *extra, *base]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(args[0])
        sys.argv = [args[0], *args[1:]]
        sys.path[:] = [os.path.dirname(script), *extra, *base]
        runpy.run_path(script, run_name="__main__")
    return 0


def _run_child(req: dict, fds: list[int], shim: str) -> None:
    """In the forked child: take the caller's descriptors, run, exit as an interpreter would."""
    import atexit
    import fcntl
    import signal
    import threading
    import traceback

    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in fds]  # out of the way of every target number
    for fd in fds:
        os.close(fd)
    for src, dst in zip(high, req["fds"]):
        os.dup2(src, dst)
        os.close(src)
    try:
        code = _child(req, shim)
    except SystemExit as err:
        if err.code is None or isinstance(err.code, int):
            code = err.code or 0
        else:
            print(err.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # non-daemon threads first, as at an interpreter's exit
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    finally:
        os._exit(code)


def _receive(conn: socket.socket) -> tuple[dict | None, list[int]]:
    """A caller's request (8 bytes of length, then JSON) and the descriptors sent with it; None if cut short."""
    import json

    head, fds, _, _ = socket.recv_fds(conn, 8, 1024)
    while head and len(head) < 8:
        more = conn.recv(8 - len(head))
        head = head + more if more else b""
    size = int.from_bytes(head, "big") if head else 0
    body = b""
    while head and len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            return None, fds
        body += more
    return (json.loads(body) if head else None), fds


def _serve(path: str, shim: str) -> None:
    import select
    import signal

    global _THREADS

    os.environ.pop("OMP_NUM_THREADS", None)  # the default thread count, for the commands that do not set one
    for name in PRELOAD:
        __import__(name)
    import torch

    _THREADS = torch.get_num_threads()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the caller waits for the name: it appears once the server listens
    running: dict[int, socket.socket] = {}  # child pid -> its caller's connection
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            ready, _, _ = select.select([listener, *running.values()], [], [], 0.05)
            for conn in ready:
                if conn is listener:
                    conn, _ = listener.accept()
                    req, fds = _receive(conn)
                    if req is None:  # the caller went away mid-request
                        for fd in fds:
                            os.close(fd)
                        conn.close()
                        continue
                    pid = os.fork()
                    if pid == 0:
                        listener.close()
                        for other in running.values():
                            other.close()
                        conn.close()
                        _run_child(req, fds, shim)
                    for fd in fds:
                        os.close(fd)
                    conn.sendall(f"{pid}\n".encode())
                    running[pid] = conn
                else:  # a caller went away before its child ended (killed): so does the child
                    if not conn.recv(1):
                        pid = next(p for p, c in running.items() if c is conn)
                        os.kill(pid, signal.SIGKILL)
            while running:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                conn = running.pop(pid, None)
                if conn is not None:
                    try:
                        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                    except OSError:
                        pass
                    conn.close()
    finally:
        os.unlink(path)
        for pid in running:
            os.kill(pid, signal.SIGKILL)


_THREADS = 1
_ZYGOTE_PYTHONPATH = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}

if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2])
