"""Files braid reads: opened and checked before any work, every problem one line naming the file.

The counterpart of :mod:`braid.io.files` (what braid writes). Every command reads the files
it is handed through these functions before a process group exists, so a missing,
unreadable, truncated, malformed or oversized file costs one line and exit code 2 rather than
a traceback per rank (or the machine's memory):

* :func:`read_text` -- a UTF-8 text file (CSV, JSON lines, a TOML run file);
* :func:`read_json` -- a JSON file whose top level has the expected type (cost files,
  traces, ``config.json``, ``tokenizer_config.json``, a safetensors index);
* :func:`check_json_lines` -- the nesting of a JSON lines data file, scanned in blocks
  before ``datasets`` parses it;
* :func:`safetensors_keys` -- the tensor names of a ``.safetensors`` file, its header
  checked against the file (length, JSON, dtypes, shapes, offsets within the file) by the
  ``safetensors`` package itself;
(A Hugging Face ``config.json`` is read by :mod:`braid.hf.config` on top of these.)

Each reader takes the :class:`braid.io.limits.FileLimit` of its kind: at most that many
bytes are read (``--config /dev/zero`` reads one byte more than a run file may hold), and
the nesting is counted on the raw bytes before any parser recurses into it.

Each raises :class:`InputFileError`, a ``ValueError`` whose message starts with the file.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from braid.io.limits import RECORD, FileLimit


class InputFileError(ValueError):
    """A file that cannot be used; the message names the file and what is wrong."""


def read_text(path: str | os.PathLike, what: str = "file", limit: FileLimit = RECORD) -> str:
    """The UTF-8 text of ``path``; a missing, unreadable, binary, oversized or too deeply nested file is an
    :class:`InputFileError`."""
    p = Path(path)
    raw = read_bytes(p, what, limit)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputFileError(f"{p}: not a UTF-8 text file (byte {err.start}: {err.reason}); expected a {what}") from None


def _size(n: int) -> str:
    return f"{n / (1 << 30):g} GiB" if n >= 1 << 30 else f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n:,} bytes"


def _too_big(p: Path, what: str, limit: FileLimit, size: int | None = None) -> InputFileError:
    if size is None:  # a device or a pipe: read one byte past the limit
        return InputFileError(f"{p}: more than {_size(limit.bytes)}, the most a {what} may hold")
    return InputFileError(f"{p}: {size:,} bytes, more than a {what} may hold ({_size(limit.bytes)})")


def read_bytes(path: str | os.PathLike, what: str, limit: FileLimit) -> bytes:
    """At most ``limit.bytes`` bytes of ``path`` (a regular file, a pipe or a device), their nesting checked."""
    p = Path(path)
    if p.is_dir():
        raise InputFileError(f"{p}: is a directory, expected a {what}")
    if not p.exists():
        raise InputFileError(f"{p}: no such {what}")
    try:
        if p.is_file() and p.stat().st_size > limit.bytes:  # refused before a byte is read
            raise _too_big(p, what, limit, p.stat().st_size)
        with open(p, "rb") as f:
            raw = f.read(limit.bytes + 1)  # a device or a pipe without end: one byte past the limit is enough
    except OSError as err:
        raise InputFileError(f"{p}: cannot read ({err.strerror or err})") from None
    if len(raw) > limit.bytes:
        raise _too_big(p, what, limit)
    check_depth(raw, p, what, limit)
    return raw


# What a parser recurses into: brackets outside strings (and TOML comments).
_TOML_STRINGS = re.compile(rb'"""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\'|"[^"\\\n]*(?:\\.[^"\\\n]*)*"|\'[^\'\n]*\'|#[^\n]*')
_BLOCK = 1 << 22  # bytes scanned at a time: a few arrays of _BLOCK int64s
_NOT_SCANNED = bytes(b for b in range(256) if b not in b'"[]{}\n')


def nesting(raw: bytes, syntax: str) -> int:
    """The deepest nesting of ``[`` / ``{`` outside strings (and TOML comments) in ``raw``; for ``jsonl``
    the deepest of any line. Unbalanced brackets count as they stand (the parser refuses such a file)."""
    import numpy as np

    if syntax == "toml":  # a run file (1 MiB at most): strings and comments out, and a dotted key nests a table per dot
        bare = _TOML_STRINGS.sub(b"", raw)
        dots = max((_key_dots(piece) for piece in re.split(rb"[\n{,]", bare)), default=0)
        return max(dots, nesting(bare.replace(b'"', b""), "json"))
    # JSON: without its escapes (an escaped backslash first) every quote opens or closes a string; only the
    # quotes, brackets and newlines are kept
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_SCANNED)
    deepest, depth_at_end, line_base, quotes = 0, 0, 0, 0
    for lo in range(0, len(text), _BLOCK):
        a = np.frombuffer(text, dtype=np.uint8, count=min(_BLOCK, len(text) - lo), offset=lo)
        quote = a == ord('"')
        outside = (np.cumsum(quote) + quotes) & 1 == 0
        quotes += int(quote.sum())
        step = (((a == ord("[")) | (a == ord("{"))) & outside).astype(np.int64) - (((a == ord("]")) | (a == ord("}"))) & outside)
        depth = depth_at_end + np.cumsum(step)
        depth_at_end = int(depth[-1])
        if syntax == "jsonl":  # from each line's start: less the depth at the newline before it
            newline = a == ord("\n")
            last = np.maximum.accumulate(np.where(newline, np.arange(len(a)), -1))
            base = np.where(last >= 0, depth[last.clip(0)], line_base)
            line_base = int(base[-1])
            depth = depth - base
        deepest = max(deepest, int(depth.max()))
    return deepest


def _key_dots(piece: bytes) -> int:
    """The dots of a TOML key (``a.b.c = ...``, a table header ``[a.b]``); not of the value after ``=``."""
    key, eq, _ = piece.partition(b"=")
    return key.count(b".") if eq or piece.lstrip().startswith(b"[") else 0


def check_depth(raw: bytes, p: Path, what: str, limit: FileLimit) -> None:
    """An :class:`InputFileError` for ``raw`` nested deeper than ``limit.depth`` (files of a ``syntax``)."""
    if limit.syntax is None:
        return
    depth = nesting(raw, limit.syntax)
    if depth > limit.depth:
        raise InputFileError(f"{p}: nested too deeply ({depth:,} levels; a {what} has at most {limit.depth})")


def check_json_lines(path: str | os.PathLike, what: str, limit: FileLimit) -> None:
    """A JSON lines file's size and the nesting of each line, read in blocks of whole lines (a parser that
    recurses without bound -- pyarrow's, under ``datasets`` -- never sees a line nested deeper than ``limit.depth``)."""
    p = Path(path)
    if not p.is_file():
        raise InputFileError(f"{p}: no such {what}")
    if p.stat().st_size > limit.bytes:
        raise _too_big(p, what, limit, p.stat().st_size)
    try:
        with open(p, "rb") as f:
            rest = b""
            while block := f.read(_LINES_BLOCK):
                block = rest + block
                cut = block.rfind(b"\n") + 1
                if not cut and len(block) > _LINES_BLOCK:
                    raise InputFileError(f"{p}: a line longer than {_size(_LINES_BLOCK)}; a {what} holds one document per line")
                check_depth(block[:cut], p, what, limit)
                rest = block[cut:]
            check_depth(rest, p, what, limit)
    except OSError as err:
        raise InputFileError(f"{p}: cannot read ({err.strerror or err})") from None


_LINES_BLOCK = 64 << 20


def read_json(path: str | os.PathLike, what: str = "JSON file", expect: type = dict, limit: FileLimit = RECORD) -> Any:
    """The JSON document in ``path``, whose top level must be an ``expect`` (``dict`` or ``list``)."""
    p = Path(path)
    raw = read_bytes(p, what, limit)
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
