"""Which ranks are still there: every rank holds a listening socket, and a closed one is a lost rank.

A rank whose connection to a peer closes knows only that *a* peer is gone (gloo names an
address, not a rank), and in a ring all-reduce only the dead rank's neighbours see the
close at once: the others wait on a neighbour that is alive. So every rank, when its
process group starts, opens a socket that listens for nothing but this question and
publishes its address in the job's store (:func:`announce`); the kernel keeps it open for
exactly as long as the process lives (a killed or crashed process's sockets close with
it). A rank that sees a close asks (:func:`lost_ranks`): a connection that is refused or
reset, or not accepted within the time given, is a lost rank; a process that is alive
accepts, even while its main thread is blocked in a collective. A thread of the rank
closes the connections it accepts, so the listen queue never fills.

The socket listens on the loopback interface when the job's store does (one host), and
on every interface otherwise, like the store (:func:`braid.runtime.store.create_store`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import torch.distributed as dist

log = logging.getLogger(__name__)

ALIVE_PREFIX = "braid/alive/"  # + rank: "host:port" of that rank's liveness socket
# + attempt + rank: set by a rank that stops because another one failed or was lost, before its process
# ends: its socket then closes too, and a survivor that asks later must not name it lost with the rank that was
LEFT_PREFIX = "braid/left/"


def attempt() -> str:
    """The key prefix of this attempt of the job (torchrun restarts a job in the same store)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/"


def left_key(rank: int) -> str:
    return f"{LEFT_PREFIX}{attempt()}{rank}"


def mark_left(store: dist.Store, rank: int) -> None:
    """Record that ``rank`` stops because of another rank (see :data:`LEFT_PREFIX`); nothing if the store fails."""
    try:
        store.set(left_key(rank), "1")
    except Exception:  # noqa: BLE001 - the store may have gone with the rank that hosted it
        log.debug("rank %d: could not record that it leaves", rank, exc_info=True)


def _own_address(master_addr: str) -> str:
    """The address of this host on the route to ``master_addr`` (what the other hosts reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((master_addr, 9))  # no packet is sent: this only picks the route
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def announce(store: dist.Store, rank: int, master_addr: str, loopback: bool) -> socket.socket | None:
    """Open this rank's liveness socket and publish its address under ``braid/alive/<rank>``.

    Returns the socket (it must live as long as the process); None when it cannot be opened
    (the other ranks then cannot tell whether this one is there, and name no rank).
    """
    host = "127.0.0.1" if loopback else _own_address(master_addr)
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1" if loopback else "", 0))
        sock.listen(64)
        store.set(f"{ALIVE_PREFIX}{rank}", f"{host}:{sock.getsockname()[1]}")
    except (OSError, RuntimeError) as err:
        log.debug("rank %d: no liveness socket: %s", rank, err)
        return None

    def drain() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=drain, name=f"braid-alive-{rank}", daemon=True).start()
    return sock


def lost_ranks(store: dist.Store, rank: int, world_size: int, within_s: float) -> list[int] | None:
    """The ranks other than ``rank`` whose liveness socket is closed or does not accept within
    ``within_s`` (all of them asked together), less those that left because of another rank
    (:func:`mark_left`); None when the store cannot be reached or a rank published no socket."""
    try:
        keys = [f"{ALIVE_PREFIX}{r}" for r in range(world_size) if r != rank]
        if not store.check(keys):
            return None
        addrs = {int(k.removeprefix(ALIVE_PREFIX)): v.decode() for k, v in zip(keys, store.multi_get(keys))}
        gone = closed(addrs, within_s)
        return [r for r in gone if not store.check([left_key(r)])]
    except Exception:  # noqa: BLE001 - DistNetworkError, DistStoreError, RuntimeError by version: the store is gone
        log.debug("rank %d: the liveness addresses cannot be read", rank, exc_info=True)
        return None


def closed(addrs: dict[int, str], within_s: float) -> list[int]:
    """The ranks of ``addrs`` (rank -> ``"host:port"`` of its liveness socket) whose socket is closed or does
    not accept within ``within_s`` (all asked together), sorted."""
    lost: list[int] = []
    deadline = time.monotonic() + within_s

    def ask(r: int, addr: str) -> None:
        host, _, port = addr.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.05, deadline - time.monotonic())):
                pass
        except (OSError, ValueError):
            lost.append(r)

    threads = [threading.Thread(target=ask, args=(r, a), daemon=True) for r, a in addrs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(lost)
