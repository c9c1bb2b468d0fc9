"""Schedule generators: pure, torch-free functions from a config to a :class:`braid.core.ir.Plan`.

Use :func:`build` (``build("braided_v", p=4, m=12)``) or :func:`get_schedule`; the names
are listed by :func:`names`. The generators register themselves (:func:`register`) when this
package is imported.
"""

from braid.schedules.registry import Knob, ScheduleSpec, build, get_schedule, names, register  # noqa: F401

# Importing the generator modules fills the registry (any import of braid.schedules.* runs this first).
import braid.schedules.generators  # noqa: E402,F401
