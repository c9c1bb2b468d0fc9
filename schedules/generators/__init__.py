"""Schedule generator families; importing this package registers every schedule.

Each module holds one family and registers its generators with
:func:`braid.schedules.registry.register`. A generator is a pure, deterministic, torch-free
function ``ScheduleConfig -> braid.core.ir.Plan`` that lists each rank's compute instructions
in order; the compiler adds communication afterwards.
"""

from braid.schedules.generators import basic, braided, dualpipe, interleaved, zero_bubble  # noqa: F401
