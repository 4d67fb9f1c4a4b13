"""The floor's file helpers: one atomic write, one secret write, the sha256 digests.

Every layer writes files through these (the floor of the layers: docs/api/index.md), so "a crash
never leaves a half-written file" and "a key is never readable by others" are implemented once:

* `atomic_write`: the bytes go to a fresh temporary file in the same folder, are flushed and
  fsynced, the file is renamed over `path` (atomic on POSIX) and the folder is fsynced, so after a
  crash `path` holds the old content or the new one, never a mix, and the rename is durable.
* `write_secret`: a new file created with mode 0600 in the open call itself (never readable by
  others, not even for a moment, whatever the umask), never over an existing file, fsynced.
* `fsync_path`: fsync a file or folder by path (what a rename of a folder needs).
* `sha256_hex` / `sha256_file`: hex digests of bytes and of a file (read in 1 MiB chunks).
* `check_writable`: before any work, the OSError that creating a folder or file would raise.
* `removed_on_failure`: what a failed setup created at a path is removed again, nothing else.

An OSError raised here names the path it is about, so the CLI can say it in one line.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def fsync_path(path: Path) -> None:
    """fsync a file or a folder by path (a folder: the names in it, e.g. after a rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        _name(exc, path)
        raise
    finally:
        os.close(fd)


def _name(exc: OSError, path: Path) -> None:
    """Give a system error `path` as its file name when it has none (an error on a file
    descriptor); an OSError raised with a message of its own keeps it."""
    if exc.filename is None and exc.errno is not None:
        exc.filename = str(path)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def atomic_write(path: Path, data: bytes | str | Callable[[BinaryIO], object],
                 mode: int | None = None) -> None:
    """Replace `path` by `data` atomically and durably (module docstring).

    `data`: bytes, a str (UTF-8 encoded), or a function that writes the content into the binary
    file it is given (`lambda f: np.save(f, x)`: nothing is held twice in memory; if it raises,
    `path` is left as it was). The file gets `mode` when given (e.g. 0o644 for a cache other
    users read), otherwise what a plain new file gets (0666 less the umask)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp")  # one per writer: no clashes
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            if mode is not None:
                os.fchmod(fd, mode)  # whatever the umask
            if callable(data):
                data(fh)
            else:
                fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):  # a write on the file descriptor names no path
            _name(exc, path)
        raise
    fsync_path(path.parent)


def write_secret(path: Path, secret: bytes) -> None:
    """`secret` alone in a new file, created with mode 0600 (never readable by others, not even
    for a moment) and never over an existing one; fsynced with its folder."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        _write_all(fd, secret)
        os.fsync(fd)
    except OSError as exc:
        _name(exc, path)
        raise
    finally:
        os.close(fd)
    fsync_path(path.parent)


def sha256_hex(data: bytes) -> str:
    """The sha256 of `data`, as hex."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes, as hex (read in 1 MiB chunks: any size fits in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_writable(path: Path, folder: bool = True) -> None:
    """Raise, before any work, the OSError that creating or replacing `path` would raise: a
    folder (created with its parents), or with `folder=False` a file in a folder that must exist
    (`atomic_write` creates none). A file in the way, a missing folder, a read-only file
    system, no permission. Writes nothing. (A full disk shows only when writing: `atomic_write`
    names the path then.)"""
    path = Path(path)
    if path.exists():
        if folder != path.is_dir():
            code = errno.ENOTDIR if folder else errno.EISDIR
            raise OSError(code, os.strerror(code), str(path))
        where = path if folder else path.parent
    else:
        where = path.parent  # as the user wrote it (a relative path ends at '.')
        while not where.exists():
            where = where.parent
        if not where.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{os.strerror(errno.ENOTDIR)} ({where} is a file)",
                                     str(path))
        if not folder and where != path.parent:
            raise FileNotFoundError(errno.ENOENT, f"{os.strerror(errno.ENOENT)} (no folder "
                                    f"{path.parent})", str(path))
    if not os.access(where, os.W_OK | os.X_OK):
        code = errno.EROFS if os.statvfs(where).f_flag & os.ST_RDONLY else errno.EACCES
        raise OSError(code, os.strerror(code), str(path))


@contextmanager
def removed_on_failure(path: Path, kept: Callable[[], bool] = lambda: False) -> Iterator[None]:
    """If the block raises (Ctrl-C included) while `kept()` is false, remove what it created at
    `path`, a folder that was missing or empty before: the folder and the parents it needed, or,
    for a folder that existed empty, what is in it now. A folder that held anything is left
    alone, and so is a parent that holds anything else: never data that was there before.

    Why: a run whose setup fails (a config the data cannot satisfy, an unwritable file) must not
    leave a half-written folder that the corrected run then has to avoid."""
    path = Path(path).absolute()
    missing = []  # the folders the block may create, innermost first
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = probe.parent
    empty_before = not missing and path.is_dir() and not any(path.iterdir())
    try:
        yield
    except BaseException:
        if (missing or empty_before) and not kept():
            _remove_created(path, missing)
        raise


def _remove_created(path: Path, missing: list[Path]) -> None:
    """`removed_on_failure`'s undo: best effort, never hiding the failure that called it."""
    try:
        if missing:
            shutil.rmtree(path, ignore_errors=True)
            for parent in missing[1:]:  # created on the way: removed only while empty
                parent.rmdir()
        elif path.is_dir():
            for entry in path.iterdir():
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
    except OSError:
        pass
