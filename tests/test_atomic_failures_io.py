"""The floor's pieces of atomic failure (dpfleet/io.py): `removed_on_failure` removes only what a
failed block created, `check_writable` raises the OSError a write would, and an OSError on a file
descriptor names its file. The commands that use them: test_atomic_failures.py."""

import errno
import os

import pytest

from dpfleet.cli import os_error_line
from dpfleet.io import atomic_write, check_writable, removed_on_failure


class Refused(Exception):
    pass


def test_a_failed_block_removes_the_folder_and_the_parents_it_created(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "other").mkdir()  # another run beside it: kept
    with pytest.raises(Refused), removed_on_failure(tmp_path / "runs" / "new" / "deep" / "run"):
        (tmp_path / "runs" / "new" / "deep" / "run" / "sub").mkdir(parents=True)
        (tmp_path / "runs" / "new" / "deep" / "run" / "config.json").write_text("{}")
        raise Refused
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["other"]


def test_a_parent_that_got_other_files_meanwhile_is_kept(tmp_path):
    with pytest.raises(Refused), removed_on_failure(tmp_path / "a" / "run"):
        (tmp_path / "a" / "run").mkdir(parents=True)
        (tmp_path / "a" / "someone_elses").write_text("x")
        raise Refused
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["someone_elses"]


def test_an_empty_folder_is_emptied_and_a_used_one_left_alone(tmp_path):
    empty, used = tmp_path / "empty", tmp_path / "used"
    empty.mkdir()
    used.mkdir()
    (used / "notes.txt").write_text("keep")
    for folder in (empty, used):
        with pytest.raises(KeyboardInterrupt), removed_on_failure(folder):
            (folder / "state").mkdir()
            (folder / "config.json").write_text("{}")
            raise KeyboardInterrupt  # Ctrl-C during setup counts as a failure
    assert empty.is_dir() and not any(empty.iterdir())
    assert sorted(p.name for p in used.iterdir()) == ["config.json", "notes.txt", "state"]


def test_nothing_is_removed_once_kept_or_on_success(tmp_path):
    with pytest.raises(Refused), removed_on_failure(tmp_path / "run", kept=lambda: True):
        (tmp_path / "run").mkdir()
        raise Refused
    with removed_on_failure(tmp_path / "ok"):
        (tmp_path / "ok").mkdir()
    assert (tmp_path / "run").is_dir() and (tmp_path / "ok").is_dir()


def test_check_writable_raises_what_the_write_would(tmp_path):
    (tmp_path / "file").write_text("")
    check_writable(tmp_path / "new" / "deep")  # a folder: its parents will be created
    check_writable(tmp_path / "file", folder=False)  # a file replaced
    with pytest.raises(NotADirectoryError, match="file is a file"):
        check_writable(tmp_path / "file" / "out")
    with pytest.raises(NotADirectoryError):
        check_writable(tmp_path / "file")  # a folder wanted where a file is
    with pytest.raises(IsADirectoryError):
        check_writable(tmp_path, folder=False)
    with pytest.raises(FileNotFoundError, match="no folder"):
        check_writable(tmp_path / "missing" / "summary.json", folder=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # it wrote nothing


def test_an_error_on_a_file_descriptor_names_the_file(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as exc:
        atomic_write(tmp_path / "a.json", "{}")
    assert os_error_line(exc.value) == f"{tmp_path / 'a.json'}: No space left on device"
    assert list(tmp_path.iterdir()) == []  # nor a temporary file
    bare = OSError(errno.EIO, os.strerror(errno.EIO))
    assert os_error_line(bare) == "Input/output error (DPFLEET_DEBUG=1 shows where)"
