"""The floor's file helpers (dpfleet/io.py): atomic replace with the right mode, secrets 0600, digests."""

import hashlib
import os
import stat

import pytest

from dpfleet.io import atomic_write, sha256_file, sha256_hex, write_secret


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_write_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "a.json"
    atomic_write(path, "old")
    atomic_write(path, b"new")
    assert path.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert mode(path) == 0o666 & ~umask  # what a plain new file gets
    atomic_write(path, b"shared", mode=0o644)
    assert mode(path) == 0o644


def test_write_secret_is_0600_and_never_overwrites(tmp_path):
    path = tmp_path / "key"
    old = os.umask(0)  # even with a permissive umask
    try:
        write_secret(path, b"k" * 32)
    finally:
        os.umask(old)
    assert path.read_bytes() == b"k" * 32 and mode(path) == 0o600
    with pytest.raises(FileExistsError):
        write_secret(path, b"other")


def test_digests(tmp_path):
    data = b"x" * 3_000_000  # more than one 1 MiB chunk
    (tmp_path / "f").write_bytes(data)
    assert sha256_file(tmp_path / "f") == sha256_hex(data) == hashlib.sha256(data).hexdigest()


def test_atomic_write_from_a_writer_and_a_failing_one(tmp_path):
    path = tmp_path / "a.bin"
    atomic_write(path, lambda f: f.write(b"streamed"))
    assert path.read_bytes() == b"streamed"

    def broken(f):
        f.write(b"half")
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        atomic_write(path, broken)
    assert path.read_bytes() == b"streamed" and [p.name for p in tmp_path.iterdir()] == ["a.bin"]
