"""Files braid reads: opened and checked before any work, every problem one line naming the file.

The counterpart of :mod:`braid.files` (what braid writes). Every command reads the files
it is handed through these functions before a process group exists, so a missing,
unreadable, truncated or malformed file costs one line and exit code 2 rather than a
traceback per rank:

* :func:`read_text` -- a UTF-8 text file (CSV, JSON lines);
* :func:`read_json` -- a JSON file whose top level has the expected type (cost files,
  traces, ``config.json``, ``tokenizer_config.json``, a safetensors index);
* :func:`safetensors_keys` -- the tensor names of a ``.safetensors`` file, its header
  checked against the file (length, JSON, dtypes, shapes, offsets within the file) by the
  ``safetensors`` package itself;
* :func:`read_hf_config` / :func:`read_family_config` -- a Hugging Face ``config.json``, and
  the model config its family reads from it (a missing or ill-typed field named).

Each raises :class:`InputFileError`, a ``ValueError`` whose message starts with the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class InputFileError(ValueError):
    """A file that cannot be used; the message names the file and what is wrong."""


def read_text(path: str | os.PathLike, what: str = "file") -> str:
    """The UTF-8 text of ``path``; a missing, unreadable or binary file is an :class:`InputFileError`."""
    p = Path(path)
    try:
        return _read_bytes(p, what).decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputFileError(f"{p}: not a UTF-8 text file (byte {err.start}: {err.reason}); expected a {what}") from None


def _read_bytes(p: Path, what: str) -> bytes:
    if p.is_dir():
        raise InputFileError(f"{p}: is a directory, expected a {what}")
    if not p.is_file():
        raise InputFileError(f"{p}: no such {what}")
    try:
        return p.read_bytes()
    except OSError as err:
        raise InputFileError(f"{p}: cannot read ({err.strerror or err})") from None


def read_json(path: str | os.PathLike, what: str = "JSON file", expect: type = dict) -> Any:
    """The JSON document in ``path``, whose top level must be an ``expect`` (``dict`` or ``list``)."""
    p = Path(path)
    raw = _read_bytes(p, what)
    try:
        d = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise InputFileError(f"{p}: JSON nested too deeply to be a {what}") from None
    except ValueError as err:  # JSONDecodeError, an integer literal too long, or bytes that are not UTF-8
        raise InputFileError(f"{p}: not valid JSON ({err})") from None
    if not isinstance(d, expect):
        kind = {dict: "a JSON object", list: "a JSON list"}.get(expect, expect.__name__)
        raise InputFileError(f"{p}: expected {kind}, got {type(d).__name__}")
    return d


def safetensors_keys(path: str | os.PathLike) -> list[str]:
    """The tensor names of a safetensors file, after the ``safetensors`` package has checked
    its header against the file: an empty, truncated or garbage file, a header claiming more
    bytes than the file holds, or offsets outside it are an :class:`InputFileError`."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    if not p.is_file():
        raise InputFileError(f"{p}: no such safetensors file")
    size = p.stat().st_size
    if size < 8:
        raise InputFileError(f"{p}: {size} bytes, too short for a safetensors file (truncated or empty)")
    with open(p, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    if header > size - 8:
        raise InputFileError(f"{p}: its header claims {header:,} bytes but the file holds {size:,} (truncated, or not "
                             "a safetensors file)")
    try:
        with safe_open(p, framework="pt", device="cpu") as f:
            keys = list(f.keys())
            for k in keys:  # dtype and shape of every tensor (get_slice reads no data)
                f.get_slice(k).get_shape()
    except (SafetensorError, OSError, ValueError) as err:
        raise InputFileError(f"{p}: not a valid safetensors file ({str(err).splitlines()[0]})") from None
    return keys


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
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
    d = read_hf_config(path)
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
    return d, family, cfg
