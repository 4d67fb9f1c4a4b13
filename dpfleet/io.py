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
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_path(path: Path) -> None:
    """fsync a file or a folder by path (a folder: the names in it, e.g. after a rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    except BaseException:
        tmp.unlink(missing_ok=True)
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
