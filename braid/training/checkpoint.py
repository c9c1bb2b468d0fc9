"""Checkpoint directories: complete or absent, checked before they are read.

Layout of a checkpoint directory ``DIR``::

    DIR/step_00000040/      one complete checkpoint: torch.distributed.checkpoint files
                            (.metadata, __<rank>_<n>.distcp), layout.json (what was saved:
                            model, parameter names and shapes, parallel layout, step) and
                            manifest.json (size and sha256 of every other file)
    DIR/latest              the name of the newest complete step folder
    DIR/.step_00000050.partial   a save in progress (never read)

:func:`save` writes a step into ``.step_N.partial``, adds the layout record and the
manifest, renames the folder to ``step_N`` and then replaces ``latest`` (both atomic
renames), and finally removes all but the ``keep`` newest step folders. A job killed at
any moment therefore leaves ``latest`` naming a complete checkpoint -- the previous one
until the new one is whole.

:func:`verify` checks a step folder against its manifest (missing, truncated, empty or
altered files) before :func:`load` reads it; every problem is a :class:`CheckpointError`
with a one-line message.

Trust: the manifest detects damage, not tampering -- whoever can write the directory can
rewrite the manifest too, and ``torch.distributed.checkpoint``'s reader unpickles
``.metadata``, which can run code. Resume only from directories you trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

from braid.io.files import WRITE_CAUSES, atomic_write_text, fsync_dir
from braid.io.inputs import InputFileError, read_json

FORMAT = "braid-checkpoint/1"
LAYOUT, MANIFEST, LATEST = "layout.json", "manifest.json", "latest"
_STEP = re.compile(r"step_(\d{8})")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed; the message is one line saying why and what to do."""


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def step_folders(directory: str | os.PathLike) -> list[Path]:
    """Complete step folders of ``directory`` (a manifest present), oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if _STEP.fullmatch(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


def resolve(path: str | os.PathLike) -> Path:
    """The step folder to resume: ``path`` itself if it is one, else the one ``path/latest`` names."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"{path}: no such directory")
    if (p / MANIFEST).is_file() or (p / LAYOUT).is_file():
        return p
    latest = p / LATEST
    if not latest.is_file():
        if (p / ".metadata").is_file():
            raise CheckpointError(f"{path}: a checkpoint without layout record or manifest (an older format); "
                                  "start a fresh run")
        raise CheckpointError(f"{path}: no checkpoint there (no '{LATEST}' file and no {MANIFEST})")
    with open(latest, "rb") as f:
        name = f.read(256).decode(errors="replace").strip()  # a step folder's name: never more (a link to a device)
    if not _STEP.fullmatch(name):
        raise CheckpointError(f"{latest}: does not name a step folder (got {name[:40]!r}); point --resume at a step folder")
    if not (p / name).is_dir():
        raise CheckpointError(f"{latest} names {name}, which is missing; point --resume at another step folder")
    return p / name


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path.parent}: {what} {path.name} is missing (incomplete or damaged checkpoint)")
    try:
        data = read_json(path, what, expect=object)
    except InputFileError as err:  # unreadable, not JSON, larger or deeper than a record may be
        raise CheckpointError(f"{path}: unreadable {what} ({str(err).removeprefix(f'{path}: ')}); the checkpoint is damaged") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} {what}")
    return data


def read_layout(step_dir: str | os.PathLike) -> dict:
    """The layout record of a step folder (what was saved; see :func:`save`)."""
    return _read_json(Path(step_dir) / LAYOUT, "layout record")


def read_manifest(step_dir: str | os.PathLike) -> dict[str, dict]:
    """``{file name: {"size": bytes, "sha256": hex}}`` of a step folder, sizes checked against the files."""
    d = Path(step_dir)
    files = _read_json(d / MANIFEST, "manifest").get("files")
    if not isinstance(files, dict) or ".metadata" not in files or LAYOUT not in files:
        raise CheckpointError(f"{d / MANIFEST}: lists no .metadata / {LAYOUT}; the checkpoint is damaged")
    for name, entry in files.items():
        if "/" in name or name in ("", ".", "..") or not isinstance(entry, dict):
            raise CheckpointError(f"{d / MANIFEST}: bad entry {name[:40]!r}; the checkpoint is damaged")
        f = d / name
        if not f.is_file():
            raise CheckpointError(f"{d}: {name} is missing (incomplete or damaged checkpoint)")
        size = f.stat().st_size
        if size != entry.get("size"):
            raise CheckpointError(f"{d}: {name} has {size} bytes, the manifest says {entry.get('size')} "
                                  "(truncated or damaged checkpoint)")
    return files


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify(step_dir: str | os.PathLike, share: tuple[int, int] = (0, 1)) -> list[str]:
    """Problems of a step folder: sizes of every file, checksums of this rank's share.

    ``share = (rank, world)``: the rank hashes every ``world``-th file, so ranks split the
    reading; the caller gathers the lists. Returns one-line messages (empty: sound).
    """
    d = Path(step_dir)
    try:
        files = read_manifest(d)
    except CheckpointError as err:
        return [str(err)]
    rank, world = share
    problems = []
    for i, (name, entry) in enumerate(sorted(files.items())):
        if i % world == rank and sha256(d / name) != entry.get("sha256"):
            problems.append(f"{d}: {name} does not match its checksum (damaged checkpoint); resume from another step folder")
    return problems


def save(directory: str | os.PathLike, step: int, state: dict[str, Any], layout: dict[str, Any], *, rank: int,
         barrier: Callable[[], None], keep: int = 2, extra: dict[str, str] | None = None) -> Path:
    """Write ``state`` as step folder ``step`` of ``directory`` (collective: every rank calls it).

    ``layout``: the layout record (JSON-able); ``extra``: further text files for the folder
    (e.g. the run's configuration). Returns the step folder.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    d = Path(directory)
    final, tmp = d / step_name(step), d / f".{step_name(step)}.partial"
    failed = None
    if rank == 0:
        try:
            d.mkdir(parents=True, exist_ok=True)
            for stale in d.glob(".step_*.partial"):  # left by a killed save
                shutil.rmtree(stale, ignore_errors=True)
            _clear_trash(d)
            tmp.mkdir()
        except OSError as err:
            failed = _write_failure(d, final, err)
    _agree(failed, barrier)
    try:
        dcp.save(state, checkpoint_id=tmp)  # every rank writes its part; rank 0 writes .metadata last
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP raises the same wrapped failure on every rank
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(_write_failure(d, final, err)) from None
    if rank == 0:
        try:
            atomic_write_text(tmp / LAYOUT, json.dumps({"format": FORMAT, "step": step, **layout}, indent=1) + "\n")
            for name, text in (extra or {}).items():
                atomic_write_text(tmp / name, text)
            files = {p.name: {"size": p.stat().st_size, "sha256": sha256(p)} for p in sorted(tmp.iterdir()) if p.is_file()}
            atomic_write_text(tmp / MANIFEST, json.dumps({"format": FORMAT, "files": files}, indent=1) + "\n")
            fsync_dir(tmp)
            if final.exists():  # a step folder newer than the one this run resumed from
                final.rename(d / f".trash-{final.name}")
            os.replace(tmp, final)
            fsync_dir(d)
            atomic_write_text(d / LATEST, final.name + "\n")
            prune(d, keep)
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            failed = _write_failure(d, final, err)
    _agree(failed, barrier)
    return final


class CheckpointWriteError(CheckpointError):
    """A save that could not be written (disk full, permissions); the previous checkpoint is kept."""

    exit_code = 1


def _agree(failed: str | None, barrier: Callable[[], None]) -> None:
    """Every rank raises rank 0's verdict together (a rank left waiting in a barrier would hang)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        verdict = [failed]
        dist.broadcast_object_list(verdict, src=0)
        failed = verdict[0]
    else:
        barrier()
    if failed is not None:
        raise CheckpointWriteError(failed)


def _write_failure(directory: Path, final: Path, err: BaseException) -> str:
    """One line for a save that failed: the path, the cause (disk full, quota, file size limit, permission named
    as such), and the checkpoint that stays."""
    latest = directory / LATEST
    try:
        kept = f"{latest} still names {latest.read_text().strip()}" if latest.is_file() else "no earlier checkpoint"
    except OSError:
        kept = f"{latest} unreadable"
    cause = WRITE_CAUSES.get(_errno(err))
    if cause:
        return f"{directory}: {cause[0]} while writing {final.name} (nothing of it is kept; {kept}); {cause[1]} and resume"
    return f"{directory}: cannot write {final.name} ({_cause(err)[:200]}; {kept})"


def _errno(err: BaseException) -> int | None:
    """The errno of an ``OSError`` anywhere in ``err``'s causes (or in DCP's per-rank failures)."""
    seen: set[int] = set()
    todo = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return e.errno
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return None


def prune(directory: Path, keep: int) -> None:
    """Remove all but the ``keep`` newest step folders (and never the one ``latest`` names)."""
    latest = (directory / LATEST).read_text().strip() if (directory / LATEST).is_file() else None
    folders = [p for p in step_folders(directory) if p.name != latest]
    for old in folders[: max(0, len(folders) - (keep - 1))]:
        old.rename(directory / f".trash-{old.name}")  # a kill mid-delete leaves trash, never half a step folder
    _clear_trash(directory)


def load(step_dir: str | os.PathLike, state: dict[str, Any]) -> None:
    """Fill ``state`` (the same structure :func:`save` was given) from a verified step folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, checkpoint_id=step_dir)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP wraps every rank's failure; one line is what the user needs
        raise CheckpointError(f"{step_dir}: cannot be loaded into this run ({_cause(err)[:300]})") from None


def _cause(err: BaseException) -> str:
    """The first rank's own exception text, out of DCP's per-rank wrapper."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        exc = next(iter(failures.values()))
        err = exc[0] if isinstance(exc, tuple) else exc
    text = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _clear_trash(directory: Path) -> None:
    for trash in directory.glob(".trash-*"):
        shutil.rmtree(trash, ignore_errors=True)

