"""The floor's file helpers (dpfleet/io.py): atomic replace with the right mode, secrets 0600, digests."""

import hashlib
import os
import stat

import pytest

from dpfleet.io import (
    append_text,
    atomic_write,
    private_mkdir,
    private_umask,
    sha256_file,
    sha256_hex,
    write_secret,
)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_write_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "a.json"
    atomic_write(path, "old")
    atomic_write(path, b"new")
    assert path.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]
    assert mode(path) == 0o600  # the permission rule, whatever the umask
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


def test_the_permission_rule_holds_under_a_permissive_umask(tmp_path):
    old = os.umask(0)  # a user's process may have any umask: dpfleet's folders and files ignore it
    try:
        folder = private_mkdir(tmp_path / "a" / "b")
        atomic_write(folder / "x.json", "{}")
        append_text(folder / "log.jsonl", "1\n")
        append_text(folder / "log.jsonl", "2\n", fsync=True)
        assert os.umask(0) == 0  # library code never changed it
    finally:
        os.umask(old)
    assert mode(tmp_path / "a") == mode(folder) == 0o700
    assert mode(folder / "x.json") == mode(folder / "log.jsonl") == 0o600
    assert (folder / "log.jsonl").read_text() == "1\n2\n"
    existing = tmp_path / "open"
    existing.mkdir(mode=0o755)
    assert mode(private_mkdir(existing)) == 0o700  # a folder dpfleet writes in is tightened


def test_private_umask_nests_and_restores(tmp_path):
    old = os.umask(0o022)
    try:
        with private_umask():
            with private_umask():
                (tmp_path / "lib").write_text("")  # what a library writes on its own
            assert os.umask(0o077) == 0o077
        assert os.umask(0o022) == 0o022
    finally:
        os.umask(old)
    assert mode(tmp_path / "lib") == 0o600
