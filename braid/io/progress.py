"""A one-line progress bar on stderr, for commands that run longer than a moment."""

from __future__ import annotations

import sys
import time


class Progress:
    """A one-line progress bar on stderr (only where ``enabled``): ``label [###...] done/total seconds what``
    (seconds since the bar was made).

    :meth:`step` advances it; :meth:`close` ends its line when the work stopped before ``total``
    (a search that proved its answer early). ``every_s``: redraw at most that often (many
    short steps).
    """

    def __init__(self, total: int, label: str, enabled: bool = True, every_s: float = 0.0) -> None:
        self.total, self.label, self.done, self.enabled = max(1, total), label, 0, enabled
        self.every_s, self._drawn, self._what = every_s, -float("inf"), ""
        self._t0 = time.monotonic()

    def step(self, what: str = "") -> None:
        self.done += 1
        self._what = what
        now = time.monotonic() if self.every_s else 0.0
        if self.enabled and (now - self._drawn >= self.every_s or self.done == self.total):
            self._drawn = now
            self._draw()

    def close(self) -> None:
        """End the bar's line (drawn as it stands) when the work stopped before ``total``."""
        if self.enabled and self._drawn > -float("inf") and self.done < self.total:
            self._draw()
            sys.stderr.write("\n")
            sys.stderr.flush()
        self.done = self.total

    def _draw(self) -> None:
        n = int(30 * min(self.done, self.total) / self.total)
        elapsed = time.monotonic() - self._t0  # where a long job spends its time, read off the log
        sys.stderr.write(f"\r{self.label} [{'#' * n}{'.' * (30 - n)}] {self.done}/{self.total} {elapsed:6.0f} s {self._what:<28}")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()
