"""Files braid reads: opened and checked before any work, every problem one line naming the file.

The counterpart of :mod:`braid.io.files` (what braid writes). Every command reads the files
it is handed through these functions before a process group exists, so a missing,
unreadable, truncated or malformed file costs one line and exit code 2 rather than a
traceback per rank:

* :func:`read_text` -- a UTF-8 text file (CSV, JSON lines);
* :func:`read_json` -- a JSON file whose top level has the expected type (cost files,
  traces, ``config.json``, ``tokenizer_config.json``, a safetensors index);
* :func:`safetensors_keys` -- the tensor names of a ``.safetensors`` file, its header
  checked against the file (length, JSON, dtypes, shapes, offsets within the file) by the
  ``safetensors`` package itself;
(A Hugging Face ``config.json`` is read by :mod:`braid.hf.config` on top of these.)

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
