"""The floor's file helpers: one atomic write, one secret write, the sha256 digests.

Every layer writes files through these (the floor of the layers: docs/api/index.md), so "a crash
never leaves a half-written file" and "a key is never readable by others" are implemented once:

* `atomic_write`: the bytes go to a fresh temporary file in the same folder, are flushed and
  fsynced, the file is renamed over `path` (atomic on POSIX) and the folder is fsynced, so after a
  crash `path` holds the old content or the new one, never a mix, and the rename is durable.
  The file is 0600 (the permission rule below).
* `write_secret`: a new file created with mode 0600 in the open call itself (never readable by
  others, not even for a moment, whatever the umask), never over an existing file, fsynced.
* `fsync_path`: fsync a file or folder by path (what a rename of a folder needs).
* `sha256_hex` / `sha256_file`: hex digests of bytes and of a file (read in 1 MiB chunks).
* `append_text`: text appended to a log (created 0600), optionally fsynced.
* `private_mkdir`: a folder (and the parents it needs) created 0700.
* `private_umask`: umask 077 for a block, for what libraries write (a CLI command's, a server's).
* `check_writable`: before any work, the OSError that creating a folder or file would raise.
* `removed_on_failure`: what a failed setup created at a path is removed again, nothing else.

The permission rule, one for every writer (runs, service state, audit and export outputs, the
caches): folders dpfleet creates are 0700 and files it writes 0600, whatever the umask. Why: a
run's files are read together (a resume point with config.json, a log with a model); no one but
the user who ran it should read any of them. Files a library writes itself (matplotlib, SQLite,
tensorboardX, a tokenizer's save) land in those 0700 folders; the CLI and the service also hold
`private_umask` so they are 0600 too. Library code never changes a caller's process umask.

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

PRIVATE_DIR = 0o700  # every folder dpfleet creates
PRIVATE_FILE = 0o600  # every file dpfleet writes
PRIVATE_UMASK = 0o077  # what `private_umask` holds: library-written files 0600, folders 0700


@contextmanager
def _opened(path: Path, flags: int, mode: int = PRIVATE_FILE) -> Iterator[int]:
    """A file descriptor of `path`, closed after the block; an OSError in it names `path`."""
    fd = os.open(path, flags, mode)
    try:
        yield fd
    except OSError as exc:
        _name(exc, path)
        raise
    finally:
        os.close(fd)


def fsync_path(path: Path) -> None:
    """fsync a file or a folder by path (a folder: the names in it, e.g. after a rename)."""
    with _opened(path, os.O_RDONLY) as fd:
        os.fsync(fd)


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
    `path` is left as it was). The file is 0600 (the permission rule) unless `mode` says
    otherwise."""
    path = Path(path)
    mode = PRIVATE_FILE if mode is None else mode
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp")  # one per writer: no clashes
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode & PRIVATE_FILE)
    try:
        with os.fdopen(fd, "wb") as fh:
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
    with _opened(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL) as fd:
        os.fchmod(fd, PRIVATE_FILE)  # whatever the umask
        _write_all(fd, secret)
        os.fsync(fd)
    fsync_path(path.parent)


def append_text(path: Path, text: str, fsync: bool = False) -> None:
    """`text` appended to the log `path` (created 0600 if missing: never readable by others,
    whatever the umask), in one write; with `fsync`, durable before this returns (a commit
    point). An empty `text` creates the file (0600) and writes nothing."""
    path = Path(path)
    with _opened(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT) as fd:
        os.fchmod(fd, PRIVATE_FILE)
        _write_all(fd, text.encode())
        if fsync:
            os.fsync(fd)


def private_mkdir(path: Path) -> Path:
    """`path` as a folder of the permission rule: the missing ones (it and its parents) created
    0700 whatever the umask, and `path` itself, if it existed and is ours, made 0700 (a run
    directory the user created empty, a cache root from an older dpfleet). Returns `path`."""
    path = Path(path)
    missing = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = probe.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(PRIVATE_DIR)
        except FileExistsError:  # made meanwhile by another writer
            pass
        except OSError as exc:
            _name(exc, folder)
            raise
    if path.is_dir() and not path.is_symlink() and path.stat().st_uid == os.getuid():
        path.chmod(PRIVATE_DIR)  # a mkdir gets 0700 less the umask; an old folder its own mode
    elif not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
    return path


def make_private(tree: Path) -> Path:
    """Every folder in `tree` (itself included) 0700 and every file 0600, links left alone: for an
    output a job assembles with libraries' writers too (an exported program, a phone bundle),
    before it is moved into place. Returns `tree`."""
    tree = Path(tree)
    for root, folders, files in os.walk(tree):
        os.chmod(root, PRIVATE_DIR)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, PRIVATE_FILE)
        folders[:] = [f for f in folders if not os.path.islink(os.path.join(root, f))]
    return tree


_umask_holders = {"count": 0, "saved": 0}


def hold_private_umask() -> None:
    """Umask 077 until the matching `release_private_umask` (`private_umask` says when)."""
    if _umask_holders["count"] == 0:
        _umask_holders["saved"] = os.umask(PRIVATE_UMASK)
    else:
        os.umask(PRIVATE_UMASK)
    _umask_holders["count"] += 1


def release_private_umask() -> None:
    _umask_holders["count"] -= 1
    if _umask_holders["count"] == 0:
        os.umask(_umask_holders["saved"])


@contextmanager
def private_umask() -> Iterator[None]:
    """Umask 077 inside the block, so what libraries write themselves (SQLite and its -wal /
    -shm, tensorboardX events, a tokenizer's files) follows the permission rule too. For a
    command or a server that owns the process (the CLI, `service serve`), never library
    code: a user's Python process keeps its umask. Nested and concurrent holders share it; the
    last one out puts the previous umask back."""
    hold_private_umask()
    try:
        yield
    finally:
        release_private_umask()


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
