"""Pausing Python's cyclic garbage collector around allocation-heavy passes (simulation, compilation)."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a simulation run or a compile builds its many small objects.

    A simulation run at p=32, m=256 makes ~600k trace events that all live on. With the collector on,
    the allocation bursts trigger young-generation passes that rescan them, then full
    passes that rescan every live object (the programs included): that doubled the run time.
    Events, stats and compiled instructions hold only numbers, strings and tuples of them, so
    they form no cycles to collect.
    On exit the objects made meanwhile go straight to the oldest generation
    (``gc.freeze`` then ``gc.unfreeze``, as documented) instead of being scanned twice on
    their way there. That moves the caller's young objects too: any garbage cycle among them
    is then freed at the next full pass instead of an earlier young one (later, never lost).
    It is skipped when the process has frozen objects of its own, which must stay frozen.
    The collector's previous on/off state is restored. Results never depend on any of this.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() == 0:
            gc.freeze()
            gc.unfreeze()
        if was_enabled:
            gc.enable()
