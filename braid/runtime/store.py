"""The job's store and the start of a job: every rank joins within seconds, or the others name it.

Stores. Without torchrun the job's store listens on the loopback interface only (or, for
one process, lives in the process); a job whose ``MASTER_ADDR`` is not a loopback address
asked for a multi-host rendezvous and gets a store on every interface. Under torchrun the
agent's store is joined as a client (:func:`create_store`).

Start-up. Ranks started as plain processes (``RANK``/``WORLD_SIZE``/``MASTER_*``, no agent to
notice a dead worker) meet in two steps, each bounded by a timeout of its own rather than the
job's communication timeout:

* :func:`join` -- early, before the slow preparation (model, data): reach the store (rank 0
  hosts it) within :data:`JOIN_TIMEOUT_S` and open this rank's liveness socket
  (:mod:`braid.runtime.liveness`);
* :func:`arrive` -- before the process group: wait for every rank. A rank that joined and then
  exited is named within a second (its liveness socket closed); one that never joined is named
  :data:`JOIN_TIMEOUT_S` after start-up; one that joined and is still preparing is waited for
  up to the job's timeout; a store that vanishes names rank 0. Each is one
  :class:`~braid.runtime.errors.PeerLost` or :class:`~braid.runtime.errors.CommTimeout` line,
  not a store's traceback.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import os
import socket
import time
from dataclasses import dataclass

import torch.distributed as dist

from braid.runtime.errors import CommTimeout, PeerLost, first_line, gone_text, ranks_text
from braid.runtime.liveness import attempt

log = logging.getLogger(__name__)

# How long a rank waits for the others to *start* (reach the store), from its own start: ranks of one job
# start within seconds of each other; BRAID_JOIN_TIMEOUT_S sets another bound (a slow shared file system).
JOIN_TIMEOUT_S = 60.0
JOINED_PREFIX = "braid/joined/"  # + attempt/rank: that rank reached the store
ARRIVED_PREFIX = "braid/arrived/"  # + attempt/rank: that rank is ready for the process group
_POLL_S = 0.1
_ASK_WITHIN_S = 3.0  # how long a joined rank's liveness socket has to accept


def _is_loopback(addr: str) -> bool:
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def _loopback_listener(addr: str, port: int) -> int:
    """A socket listening on ``addr`` (a loopback address) only; returns its file descriptor."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(512)
    except OSError as err:
        sock.close()
        raise OSError(f"cannot listen on {addr}:{port} for the job's store: {err.strerror or err}") from err
    return sock.detach()


def create_store(rank: int, world_size: int, addr: str, port: int, timeout: datetime.timedelta) -> dist.Store:
    """The job's store (see the module doc): torchrun's agent store as a client; one process:
    an in-process store; rank 0 of a local job: a TCPStore on the loopback interface only."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
    if world_size == 1:
        return dist.HashStore()
    if rank != 0:
        return dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
    if _is_loopback(addr):
        fd = _loopback_listener(addr, port)
        # the process group's own rendezvous waits for the ranks; the store need not
        kw = dict(is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=fd)
        try:
            return dist.TCPStore(addr, port, world_size, **kw)
        except (RuntimeError, ValueError):  # a libuv store that cannot adopt a socket: the classic one can
            log.debug("TCPStore(use_libuv=True) refused the loopback socket; using the classic backend", exc_info=True)
            return dist.TCPStore(addr, port, world_size, use_libuv=False, **kw)
    return dist.TCPStore(addr, port, world_size, is_master=True, timeout=timeout)


@dataclass(slots=True)
class Joined:
    """A rank that reached the job's store: the store, its liveness socket, when it started to join."""

    rank: int
    world_size: int
    store: dist.Store
    alive: socket.socket | None
    started: float  # time.monotonic() when the rank began to join
    join_timeout_s: float
    where: str  # "addr:port" of the store
    host: str | None = None  # the liveness address of rank 0, which hosts the store (None: rank 0, or torchrun's agent)


def store_gone(rank: int, err: BaseException) -> PeerLost:
    """What a rank says when the job's store fails: its host (rank 0, unless torchrun's agent hosts it) is gone."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return PeerLost(f"rank {rank} stops: the job's store cannot be reached (the rank that hosts it, rank 0, has exited "
                    f"or was killed): {first_line(err)}", 0, "store gone", [] if agent else [0])


def join(rank: int, world_size: int, *, master_addr: str = "127.0.0.1", master_port: int | None = None,
         join_timeout_s: float | None = None) -> Joined:
    """Reach the job's store (:func:`create_store`) within the join timeout and, with several ranks, open this
    rank's liveness socket; a store that does not answer is a :class:`PeerLost` naming rank 0.

    ``master_port``/``master_addr`` default to ``MASTER_PORT``/``MASTER_ADDR``.
    """
    started = time.monotonic()
    wait = join_timeout_s if join_timeout_s is not None else float(os.environ.get("BRAID_JOIN_TIMEOUT_S", JOIN_TIMEOUT_S))
    port = int(master_port if master_port is not None else os.environ.get("MASTER_PORT", "29500"))
    addr = os.environ.get("MASTER_ADDR", master_addr) if master_port is None else master_addr
    try:
        if rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            _await_listener(addr, port, started + wait)  # before the client: TCPStore logs every failed try
        store = create_store(rank, world_size, addr, port, datetime.timedelta(seconds=wait))
    except (RuntimeError, ValueError, TimeoutError) as err:  # DistNetworkError, DistStoreError: a client that found no store
        if rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            raise
        raise PeerLost(f"rank {rank} stops: the job's store at {addr}:{port} did not answer within {wait:g} s: rank 0, "
                       "which hosts it, has not started or has exited (give every rank the same MASTER_ADDR and "
                       "MASTER_PORT)", 0, "store unreachable", [0]) from None
    alive, host = None, None
    if world_size > 1:  # announced before the process group: every rank's is there once it exists
        from braid.runtime.liveness import ALIVE_PREFIX, announce

        one_host = _is_loopback(addr) or os.environ.get("LOCAL_WORLD_SIZE") == str(world_size)
        alive = announce(store, rank, addr, loopback=one_host)
        try:
            store.set(f"{JOINED_PREFIX}{attempt()}{rank}", "1")
            if rank != 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # rank 0 announces as it opens the store
                store.wait([f"{ALIVE_PREFIX}0"], datetime.timedelta(seconds=wait))
                host = store.get(f"{ALIVE_PREFIX}0").decode()
        except (RuntimeError, ValueError) as err:
            raise store_gone(rank, err) from None
    return Joined(rank, world_size, store, alive, started, wait, f"{addr}:{port}", host)


def _await_listener(addr: str, port: int, deadline: float) -> None:
    """Return once ``addr:port`` accepts a connection; :class:`TimeoutError` at ``deadline``."""
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.05, min(1.0, deadline - time.monotonic()))):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nothing listens on {addr}:{port}") from None
            time.sleep(_POLL_S)


def arrive(joined: Joined, timeout_s: float) -> None:
    """Wait until every rank has arrived here (see the module doc); the first rank found missing or gone is
    raised as one line. ``timeout_s``: how long to wait for ranks that joined and are alive.

    Every rank polls one counter; rank 0 alone looks for the missing ones (a few store keys and a liveness
    socket per rank, at most every :data:`_SCAN_S`) and leaves its verdict in the store for the others, so the
    store's load does not grow with the square of the ranks.
    """
    from braid.runtime.liveness import closed

    store, rank, world = joined.store, joined.rank, joined.world_size
    if world == 1:
        return
    prefix = f"{ARRIVED_PREFIX}{attempt()}"
    poll = max(_POLL_S, world / 10_000)  # all ranks together: about 10,000 store reads a second
    since = time.monotonic()
    scanned = since
    host = {0: joined.host} if joined.host else {}
    try:
        if host and closed(host, _ASK_WITHIN_S):  # asked first: a store op on a dead host logs a C++ stack
            raise store_gone(rank, ConnectionError("rank 0 closed its connections"))
        store.set(f"{prefix}{rank}", "1")
        store.add(f"{prefix}count", 1)
        while True:
            if host and closed(host, _ASK_WITHIN_S):
                raise store_gone(rank, ConnectionError("rank 0 closed its connections"))
            if store.add(f"{prefix}count", 0) >= world:
                return
            now = time.monotonic()
            if rank == 0 and now - scanned >= _SCAN_S:
                scanned = now
                verdict = _missing(joined, timeout_s, since)
                if verdict is not None:
                    store.set(f"{prefix}verdict", json.dumps(verdict))
                    raise _verdict_error(rank, joined, timeout_s, *verdict)
            elif rank != 0 and store.check([f"{prefix}verdict"]):
                raise _verdict_error(rank, joined, timeout_s, *json.loads(store.get(f"{prefix}verdict")))
            elif rank != 0 and now > since + timeout_s + joined.join_timeout_s:  # rank 0 itself never got here
                raise _verdict_error(rank, joined, timeout_s, *(_missing(joined, 0.0, since) or ("slow", [0])))
            time.sleep(poll)
    except (PeerLost, CommTimeout):
        raise
    except (RuntimeError, ValueError) as err:  # DistNetworkError, DistStoreError by version: the store is gone
        raise store_gone(rank, err) from None


_SCAN_S = 0.5


def _missing(joined: Joined, timeout_s: float, since: float) -> tuple[str, list[int]] | None:
    """Rank 0's look at the ranks that have not arrived: ``("gone", ranks)`` (joined, then their process ended),
    ``("never", ranks)`` (not joined within the join timeout), ``("slow", ranks)`` (joined and alive, not here
    within ``timeout_s``), or None (wait on)."""
    from braid.runtime.liveness import ALIVE_PREFIX, closed

    store, prefix = joined.store, attempt()
    waiting = [r for r in range(joined.world_size) if r != joined.rank and not store.check([f"{ARRIVED_PREFIX}{prefix}{r}"])]
    never = [r for r in waiting if not store.check([f"{JOINED_PREFIX}{prefix}{r}"])]
    addrs = {r: store.get(f"{ALIVE_PREFIX}{r}").decode() for r in waiting
             if r not in never and store.check([f"{ALIVE_PREFIX}{r}"])}
    gone = closed(addrs, _ASK_WITHIN_S)
    now = time.monotonic()
    if gone:
        return "gone", gone
    if never and now > joined.started + joined.join_timeout_s:
        return "never", never
    if waiting and not never and now > since + timeout_s:
        return "slow", waiting
    return None


def _verdict_error(rank: int, joined: Joined, timeout_s: float, kind: str, ranks: list[int]) -> PeerLost | CommTimeout:
    """The line each rank stops with for rank 0's verdict (:func:`_missing`)."""
    if kind == "gone":
        return PeerLost(f"rank {rank} stops: {ranks_text(ranks)} {'is' if len(ranks) == 1 else 'are'} gone before the "
                        f"start: {gone_text(ranks)}", ranks[0], "lost at start-up", ranks)
    if kind == "never":
        return CommTimeout(f"rank {rank} stops: {ranks_text(ranks)} did not join within {joined.join_timeout_s:g} s of the "
                           f"start (not started, or ended before it reached the job's store at {joined.where}; give every "
                           "rank the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE)", ranks)
    return CommTimeout(f"rank {rank} stops: {ranks_text(ranks)} joined but did not get ready within {timeout_s:g} s "
                       "(alive: look there; raise --timeout if it is only slow)", ranks)
