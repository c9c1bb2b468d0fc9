"""Schedule generators: pure, torch-free functions from a config to a :class:`braid.core.ir.Plan`.

Use :func:`build` (``build("braided_v", p=4, m=12)``) or :func:`get_schedule`; the names
are listed by :func:`names`.
"""

from braid.schedules.registry import Knob, ScheduleSpec, build, get_schedule, names, register  # noqa: F401
