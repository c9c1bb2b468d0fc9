"""Name registry of schedule generators, with what each schedule declares about itself.

A :class:`ScheduleSpec` carries, besides the generator, the schedule's *knobs* -- the
options it accepts (``schedules.build(name, p, m, **options)``), each with the values a
search should try -- and the micro-batch counts it accepts (``m_step``: m must be a
multiple of it; ``min_m``: the least m as a multiple of p) and ``steady_m``: the m (as a
multiple of p) from which one more micro-batch adds the same time and no peak memory (used
by the simulator's extrapolation, :mod:`braid.simulator.fast`, which checks it), and
``saves_memory_of``: the schedule it is a memory-saving variant of. Tools read
these declarations instead of special-casing schedule names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from braid.core.ir import Placement, Plan, ScheduleConfig

Generator = Callable[[ScheduleConfig], Plan]


@dataclass(frozen=True, slots=True)
class Knob:
    """One option of a schedule: its name, the values a search tries, and what it means."""

    name: str
    search: tuple[Any, ...]
    help: str


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    name: str
    fn: Generator
    v: int  # chunks per rank the schedule uses by default
    placement: Placement
    description: str
    knobs: tuple[Knob, ...] = ()
    min_m: int = 1  # m >= min_m * p
    m_step: str = "1"  # "1": any m; "p": m a multiple of p
    steady_m: int = 2  # m >= steady_m * p: fixed time and no memory per extra micro-batch; 0: never
    saves_memory_of: str | None = None  # a variant that trades time for memory (a search tries it when that one does not fit)

    def knob(self, name: str) -> Knob | None:
        """The knob called ``name``, or None when the schedule has no such option."""
        return next((k for k in self.knobs if k.name == name), None)

    def accepts_m(self, p: int, m: int) -> bool:
        """Whether ``m`` micro-batches on ``p`` ranks is a configuration this schedule takes."""
        return m >= self.min_m * p and (self.m_step == "1" or m % p == 0)


_SCHEDULES: dict[str, ScheduleSpec] = {}


def register(name: str, *, v: int, placement: Placement, description: str, knobs: tuple[Knob, ...] = (),
             min_m: int = 1, m_step: str = "1", steady_m: int = 2, saves_memory_of: str | None = None) -> Callable[[Generator], Generator]:
    """Decorator that registers a generator under ``name`` (see :class:`ScheduleSpec`)."""
    if m_step not in ("1", "p"):
        raise ValueError(f"schedule {name!r}: m_step must be '1' or 'p', got {m_step!r}")

    def deco(fn: Generator) -> Generator:
        if name in _SCHEDULES:
            raise ValueError(f"schedule {name!r} registered twice")
        _SCHEDULES[name] = ScheduleSpec(name, fn, v, placement, description, tuple(knobs), min_m, m_step, steady_m,
                                         saves_memory_of)
        return fn

    return deco


def names() -> list[str]:
    return list(_SCHEDULES)


def get_schedule(name: str) -> ScheduleSpec:
    try:
        return _SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; valid names: {', '.join(_SCHEDULES)}") from None


def build(name: str, p: int, m: int, v: int | None = None, **options: Any) -> Plan:
    """Generate the plan of schedule ``name`` for ``p`` ranks and ``m`` micro-batches."""
    spec = get_schedule(name)
    cfg = ScheduleConfig(p, m, spec.v if v is None else v, tuple(sorted(options.items())))
    return spec.fn(cfg)
