"""Files braid writes: checked before the work, written whole or not at all.

Every file the project writes (metrics, traces, HTML, cost files, captures, reports) goes
through :func:`atomic_write_text` / :func:`atomic_write_bytes` / :func:`atomic_path`: the
bytes land in a temporary file in the same directory, are flushed to disk, and replace the
target with one ``os.replace`` -- a reader (or a resumed run) sees the old file or the new
one, never half of one. :func:`check_output_path` is called by every CLI on its output
arguments *before* the run, so a missing or read-only directory costs one line and exit 2
instead of the measured work.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


# errno -> what a failed write met, and what to do about it
WRITE_CAUSES = {
    errno.ENOSPC: ("disk full", "free space"),
    errno.EDQUOT: ("disk quota exceeded", "free space within the quota"),
    errno.EFBIG: ("file size limit reached (ulimit -f)", "raise the limit"),
    errno.EACCES: ("permission denied", "make the directory writable"),
    errno.EPERM: ("operation not permitted", "make the directory writable"),
    errno.EROFS: ("read-only file system", "write elsewhere"),
}


def write_failure(err: OSError, path: str | os.PathLike | None = None) -> str:
    """One line for a write that failed: the path, and the cause (disk full, quota, file size limit, permission
    named as such)."""
    where = path if path is not None else err.filename if err.filename is not None else "a file"
    cause = WRITE_CAUSES.get(err.errno)
    return f"{where}: {cause[0]}; {cause[1]}" if cause else f"{where}: cannot write ({err.strerror or err})"


class OutputPathError(ValueError):
    """An output path that cannot be written; the message says what to change."""


def check_output_path(path: str | os.PathLike, *, what: str = "output file",
                      inputs: tuple[str | os.PathLike, ...] = ()) -> Path:
    """Check that ``path`` can be written later: its directory exists and is writable,
    it is not a directory, and it is not one of ``inputs`` (overwriting what is read)."""
    p = Path(path)
    if str(path) == "":
        raise OutputPathError(f"{what}: empty path")
    if p.is_dir():
        raise OutputPathError(f"{what} {str(path)!r} is a directory; give a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise OutputPathError(f"{what} {str(path)!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"{what} {str(path)!r}: directory {str(parent)!r} is not writable")
    if p.exists() and not os.access(p, os.W_OK):
        raise OutputPathError(f"{what} {str(path)!r} exists and is read-only")
    for inp in inputs:
        with contextlib.suppress(OSError):
            if Path(inp).exists() and p.exists() and p.samefile(inp):
                raise OutputPathError(f"{what} {str(path)!r} is also an input; choose another name")
        if Path(inp).resolve() == p.resolve():
            raise OutputPathError(f"{what} {str(path)!r} is also an input; choose another name")
    return p


def plain_mode(path: str | os.PathLike) -> None:
    """Give ``path`` the mode a plain ``open()`` would (0666 less the umask): writers that create
    their files 0600 (``mkstemp``, safetensors) leave them unreadable to the user's group."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` atomically,
    on any exception it is removed and ``path`` is left as it was."""
    target = Path(path)
    parent = target.parent if str(target.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix + ".tmp", dir=parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb") as f:
            os.fsync(f.fileno())
        plain_mode(tmp_path)  # mkstemp creates the file 0600
        os.replace(tmp_path, target)
        fsync_dir(parent)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp_path.unlink()
        if isinstance(err, OSError) and err.errno:  # named by the file it was for, not the temporary one
            raise OSError(err.errno, err.strerror, str(target)) from err
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` whole or not at all."""
    atomic_write_bytes(path, text.encode(encoding))


def fsync_dir(directory: str | os.PathLike) -> None:
    """Flush a directory's entries (a rename into it) to disk; best effort."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
