"""A Hugging Face checkpoint's ``config.json``: read and checked, without touching its weights
(the cost model's shapes and the checkpoint loader both start here)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint directory as a dict (``ValueError`` if absent or not JSON)."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise ValueError(f"{str(path)!r} is not a Hugging Face checkpoint directory: no config.json in it")
    try:
        d = json.loads(f.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{f}: not valid JSON ({err})") from None
    if "model_type" not in d:
        raise ValueError(f"{f}: no model_type")
    return d
