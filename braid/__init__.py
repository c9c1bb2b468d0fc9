"""braid: braided TP/PP pipeline schedules, their compiler, simulator, executor and viewer.

The schedule generators, the simulator and the viewer live in the top-level folders
``schedules/``, ``simulator/`` and ``viz/`` of the source tree and install as
``braid.schedules``, ``braid.simulator`` and ``braid.viz`` (a package-dir mapping in
``pyproject.toml``). Run from a source checkout without installing (``PYTHONPATH=.``),
the finder below gives them the same names.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

__version__ = "0.1.0"

_ROOT = Path(__file__).resolve().parent.parent
_FOLDERS = {f"braid.{name}": _ROOT / name for name in ("schedules", "simulator", "viz")}


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Finds ``braid.schedules`` / ``braid.simulator`` / ``braid.viz`` in a source checkout."""

    def find_spec(self, fullname, path, target=None):
        folder = _FOLDERS.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)])


def _in_source_checkout() -> bool:
    return (_ROOT / "pyproject.toml").is_file() and all((f / "__init__.py").is_file() for f in _FOLDERS.values())


if _in_source_checkout() and not (Path(__file__).parent / "schedules").is_dir():
    if not any(isinstance(f, _SourceTreeFinder) for f in sys.meta_path):
        # First, so that braid.schedules comes from the same tree as this braid (an editable
        # install of another checkout maps the name to its own folder).
        sys.meta_path.insert(0, _SourceTreeFinder())
