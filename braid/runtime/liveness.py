"""Which ranks are still there: a roll call through the job's store, answered by a thread.

A rank whose connection to a peer closes knows only that *a* peer is gone (gloo names an
address, not a rank), and in a ring all-reduce only the dead rank's neighbours see the
close at once: the others wait on a neighbour that is alive. So the rank that sees the
close calls the roll (:func:`roll_call`): every live process answers from a daemon thread
(:func:`answer_roll_calls`, started with the process group) on a store connection of its
own, even while its main thread is blocked in a collective (the wait releases the GIL).
The ranks that do not answer within the grace time are the lost ones: killed, crashed or
stopped. The call and the answers are keys that stay in the store, so every survivor that
calls the roll afterwards reads the same answers and names the same ranks.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time

import torch.distributed as dist

log = logging.getLogger(__name__)

ROLL_CALL_KEY = "braid/roll_call"
HERE_PREFIX = "braid/here/"  # + rank: that rank's process answered the roll call
_IDLE_WAIT = datetime.timedelta(days=20)  # one store request per 20 days while nobody calls the roll (poll takes int ms)


def answer_roll_calls(store: dist.Store, rank: int) -> threading.Thread | None:
    """Start the daemon thread that answers a roll call for ``rank`` (once: a roll call is
    made at most once per job). None when the store cannot open a second connection (an
    in-process store: one process, nobody to ask)."""
    try:
        own = store.clone()  # a client of its own: a blocked wait here must not hold the main thread's requests
    except (AttributeError, RuntimeError, NotImplementedError):
        return None

    def answer() -> None:
        try:
            while True:
                try:
                    own.wait([ROLL_CALL_KEY], _IDLE_WAIT)
                    break
                except dist.DistStoreError as err:
                    if "timeout" not in str(err).lower():
                        return  # the store is gone (its host exited): nobody is left to call the roll
            own.set(f"{HERE_PREFIX}{rank}", "1")
        except Exception:  # noqa: BLE001 - the store may go away at any moment; the thread only ends
            log.debug("rank %d: the roll-call thread ends", rank, exc_info=True)

    thread = threading.Thread(target=answer, name=f"braid-roll-call-{rank}", daemon=True)
    thread.start()
    return thread


def roll_call(store: dist.Store, rank: int, world_size: int, grace_s: float) -> list[int] | None:
    """Call the roll (if no rank has yet) and return the ranks that did not answer within
    ``grace_s``, ``rank`` itself excluded; None when the store cannot be reached."""
    try:
        store.set(ROLL_CALL_KEY, str(rank))
        store.set(f"{HERE_PREFIX}{rank}", "1")  # this rank is here, whatever its thread is doing
        deadline = time.monotonic() + grace_s
        while True:
            missing = [r for r in range(world_size) if r != rank and not store.check([f"{HERE_PREFIX}{r}"])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.02)
    except Exception:  # noqa: BLE001 - DistNetworkError, DistStoreError, RuntimeError by version: the store is gone
        log.debug("rank %d: roll call failed", rank, exc_info=True)
        return None
