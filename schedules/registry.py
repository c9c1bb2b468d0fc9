"""Name registry of schedule generators."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from braid.ir import Placement, Plan, ScheduleConfig

Generator = Callable[[ScheduleConfig], Plan]


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    name: str
    fn: Generator
    v: int  # chunks per rank the schedule uses by default
    placement: Placement
    description: str


_SCHEDULES: dict[str, ScheduleSpec] = {}


def register(name: str, *, v: int, placement: Placement, description: str) -> Callable[[Generator], Generator]:
    """Decorator that registers a generator under ``name``."""

    def deco(fn: Generator) -> Generator:
        if name in _SCHEDULES:
            raise ValueError(f"schedule {name!r} registered twice")
        _SCHEDULES[name] = ScheduleSpec(name, fn, v, placement, description)
        return fn

    return deco


def _load() -> None:
    # Importing the generator modules fills the registry.
    import braid.schedules.generators  # noqa: F401


def names() -> list[str]:
    _load()
    return list(_SCHEDULES)


def get_schedule(name: str) -> ScheduleSpec:
    _load()
    try:
        return _SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; valid names: {', '.join(_SCHEDULES)}") from None


def build(name: str, p: int, m: int, v: int | None = None, **options: Any) -> Plan:
    """Generate the plan of schedule ``name`` for ``p`` ranks and ``m`` micro-batches."""
    spec = get_schedule(name)
    cfg = ScheduleConfig(p, m, spec.v if v is None else v, tuple(sorted(options.items())))
    return spec.fn(cfg)
