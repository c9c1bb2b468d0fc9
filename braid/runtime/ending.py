"""How a failed rank ends: one line for the user, once per job, and torchrun's summary reads it.

Under torchrun a worker that exits non-zero makes the elastic agent stop the others and
print its failure summary (``ChildFailedError``: per failed rank its exit code and the
message of its *error file*, ``TORCHELASTIC_ERROR_FILE``; without one, a link to the
docs). :func:`end_run` makes a failure that every rank meets (bad input found before any
work, a verdict reached together, a lost or failed peer) end the same way on every rank:

* the line is printed once per job: the first rank to get there claims it in torchrun's
  store (a ``compare_set`` on an absent key; without torchrun's store, rank 0 prints);
* every rank records the line as its error through torch elastic's error handler
  (:class:`OneLineErrorHandler`: the line instead of a traceback), so the summary's root
  cause reads it;
* the ranks leave together (a bounded count in the store, then at once, without the
  interpreter's shutdown), so that none is stopped by the agent before it printed; a rank
  the agent stops all the same (``SIGTERM``, sent to the ranks still running when the first
  one is gone) leaves with its own exit code, not as killed.

The agent's own traceback of ``ChildFailedError`` (the launcher process raising it) stays:
it is torchrun's, not the worker's, and ends with the summary whose root cause is the line.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import sys
import time

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

log = logging.getLogger(__name__)

LEAVE_WITHIN_S = 10.0  # how long a failed rank waits for the others before it leaves on its own


class OneLineErrorHandler(ErrorHandler):
    """torch elastic's error handler, writing the exception's message as the error (no
    traceback): torchrun's failure summary shows it in the rank's ``traceback`` field."""

    def record_exception(self, e: BaseException) -> None:
        path = self._get_error_file_path()
        if not path:
            return
        data = {"message": {"message": str(e), "extraInfo": {"timestamp": str(int(time.time()))}}}
        try:
            with open(path, "w", encoding="utf-8") as fp:
                json.dump(data, fp)
        except OSError:
            log.debug("could not write the error file %s", path, exc_info=True)


class _Reported(Exception):
    """The line a rank ends with, as the exception the error handler records."""


def _torchrun_store(timeout_s: float):
    """torchrun's store as a client, or None (not under torchrun, or unreachable)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in os.environ:
        return None
    import torch.distributed as dist

    try:
        return dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - DistNetworkError, RuntimeError by version: end without it
        log.debug("torchrun's store cannot be reached", exc_info=True)
        return None


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _leave_on_sigterm(code: int) -> None:
    """A ``SIGTERM`` (the agent stopping the ranks once one has exited) ends this rank with ``code``."""

    def leave(signum: int, frame: object) -> None:
        _flush()
        os._exit(code)

    try:
        signal.signal(signal.SIGTERM, leave)
    except ValueError:  # not the main thread: the default (killed by SIGTERM) stays
        log.debug("SIGTERM handler not installed (not the main thread)")


def end_run(line: str, code: int, rank: int, world: int, leaving: int | None = None, lost: list[int] = ()) -> int:
    """End this rank's part of a failed run with ``line`` (see the module doc); returns ``code``.

    Every rank that meets the failure calls it; the line is printed on stderr once per job.
    ``leaving``: how many ranks end this way (default ``world``; fewer when some are lost).
    ``lost``: the ranks known gone; without torchrun's store the lowest other rank prints.
    """
    store = _torchrun_store(LEAVE_WITHIN_S) if world > 1 else None
    if store is not None:
        _leave_on_sigterm(code)
    prefix = f"braid/end/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    printer = rank == min(set(range(max(world, rank + 1))) - set(lost), default=rank)
    if store is not None:
        try:
            printer = store.compare_set(prefix + "printed", "", str(rank)).decode() == str(rank)
        except Exception:  # noqa: BLE001 - the store went away: print from rank 0 only
            store = None
    if printer:
        print(line, file=sys.stderr, flush=True)
    OneLineErrorHandler().record_exception(_Reported(line))
    if store is not None:
        try:
            store.add(prefix + "leaving", 1)
            deadline = time.monotonic() + LEAVE_WITHIN_S
            while store.add(prefix + "leaving", 0) < (world if leaving is None else leaving) and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store went away with the agent: nothing to wait for
            log.debug("no store to leave together", exc_info=True)
        # leave now, all together: an interpreter's shutdown takes a while, and the agent stops the ranks
        # still running as soon as the first one is gone
        _flush()
        os._exit(code)
    return code
