"""A Hugging Face checkpoint's ``config.json``: read and checked before any work, without touching
its weights (the cost model's shapes and the checkpoint loader both start here). A missing or
ill-typed field is a ``ValueError`` naming the file and the field."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from braid.io.inputs import InputFileError, read_json
from braid.io.limits import check_shape


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint directory (or that file itself) as a dict; ``ValueError``
    naming the file if it is absent, not JSON or has no ``model_type``."""
    f = _config_file(path)
    d = read_json(f, "Hugging Face config.json")
    if "model_type" not in d:
        raise ValueError(f"{f}: no model_type")
    return d


def _config_file(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_file():
        return p
    if p.suffix == ".json":
        raise InputFileError(f"{p}: no such Hugging Face config file")
    if not (p / "config.json").is_file():
        raise InputFileError(f"{str(path)!r} is not a Hugging Face checkpoint directory: no config.json in it")
    return p / "config.json"


def read_family_config(path: str | os.PathLike) -> tuple[dict[str, Any], Any, Any]:
    """``(config.json dict, family, the family's model config)`` of a checkpoint directory.

    A missing or ill-typed field (no ``hidden_size``, a negative layer count, ...) is a
    ``ValueError`` naming ``config.json`` and the field, never a ``KeyError``.
    """
    f = _config_file(path)
    d = read_config(path)
    if not isinstance(d["model_type"], str):
        raise ValueError(f"{f}: model_type must be a string, got {d['model_type']!r}")
    from braid.models.registry import family_for_hf  # the registry loads the families' modules on first use

    family = family_for_hf(d["model_type"])
    try:
        cfg = family.from_hf(d)
    except KeyError as err:
        raise ValueError(f"{f}: no {err.args[0]!r} (a {family.name} config.json needs it)") from None
    except (TypeError, ValueError, AttributeError) as err:
        raise ValueError(f"{f}: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn"):
        for part in (cfg, getattr(cfg, "lm", None)):
            value = getattr(part, name, None)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{f}: {name} must be a positive integer, got {value!r}")
            check_shape({name: value}, str(f))
    return d, family, cfg
