"""What a rank raises when another rank failed, vanished or stayed silent (:mod:`braid.runtime.distributed`).

Every message is one line that names the ranks; the words for lost ranks are written here
once, for the executor's waits, the collectives and the start-up (:mod:`braid.runtime.store`).
"""

from __future__ import annotations


class PeerFailure(RuntimeError):
    """Another rank failed; this rank stops instead of waiting forever.

    ``failed_rank`` and ``reason``: the rank that failed first and its exception text
    (None when unknown, e.g. the store is gone with the rank that hosted it).
    """

    def __init__(self, message: str, failed_rank: int | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.failed_rank, self.reason = failed_rank, reason


class PeerLost(PeerFailure):
    """A peer closed its connection (its process exited or was killed) before any rank recorded why.

    ``lost``: the ranks whose process is gone (:mod:`braid.runtime.liveness`); empty when
    unknown (no world size, or the store is gone).
    """

    def __init__(self, message: str, failed_rank: int | None = None, reason: str | None = None,
                 lost: list[int] | None = None) -> None:
        super().__init__(message, failed_rank, reason)
        self.lost = list(lost or [])


class CommTimeout(TimeoutError):
    """A communication did not finish within the job's timeout (peers alive but silent).

    ``silent``: the ranks that did not time out themselves (the ones to look at; empty when unknown).
    """

    def __init__(self, message: str, silent: list[int] | None = None) -> None:
        super().__init__(message)
        self.silent = list(silent or [])


def describe_exception(err: BaseException) -> str:
    """``"ValueError: the message"`` -- the text a failure record carries."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def gone_text(ranks: list[int]) -> str:
    """What a record of lost ranks says of them."""
    one = len(ranks) == 1
    return (f"{'its process' if one else 'their processes'} exited or {'was' if one else 'were'} killed "
            f"({'it' if one else 'they'} closed {'its' if one else 'their'} connections; "
            f"see {'that rank' if one else 'those ranks'}'s log)")


def lost_text(rank: int, lost: list[int]) -> str:
    """What a survivor ``rank`` says of ``lost`` ranks (the same words on every rank)."""
    return f"rank {rank} stops: {ranks_text(lost)} {'is' if len(lost) == 1 else 'are'} gone: {gone_text(lost)}"
