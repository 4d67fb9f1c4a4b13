"""Failures are atomic and said in one line, for every command that writes.

* A destination that cannot be written (a file in the way of a folder, a read-only file system, a
  file whose folder is missing) is one `error:` line, the last printed, exit 2, no traceback,
  before any work.
* A config that fails validation only once its data is loaded, and a disk that fills up while the
  first files are written, leave no half-written run or state directory behind.

The commands run in-process (`dpfleet.cli.main`); none gets as far as training. The read-only
case mounts a read-only tmpfs when run as root (root ignores permission bits) and uses mode 0500
otherwise. A full disk is an os.fsync that fails with ENOSPC (what a full disk or an NFS server
says at fsync; every file dpfleet writes atomically is fsynced before it is renamed into place).
"""

import errno
import os
import subprocess
from pathlib import Path

import pytest

from dpfleet.cli import main
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.state.run_dir import to_toml

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY = {
    "rounds": 2, "seed": 11,
    "data": {"dataset": "shakespeare", "max_clients": 12, "eval_examples": 50, "max_examples": 16,
             "keyboard_words": 0},  # no keyboard metrics: seconds a run, read by none
    "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024},
    "model": {"arch": "cifg", "embedding_dim": 16, "hidden_dim": 32, "projection_dim": 16},
    "client": {"batch_size": 16, "threads": 1},
    "dp": {"noise_multiplier": 1.0, "clip_norm": 0.5, "report_goal": 4},
    "participation": {"mode": "uniform"},
}
# disjoint participation for 8 rounds of 4 needs 32 clients: the data has 12, which only the
# loaded data can tell (the engine refuses it), after the run directory was opened
NEEDS_MORE_CLIENTS = {**TINY, "rounds": 8, "participation": {"mode": "disjoint"}}

# command -> its argv with DEST (the destination under test) and the files it reads
WRITERS = {
    "simulate": "simulate {config} --out DEST --quiet",
    "audit": "audit {config} --out DEST --quiet",
    "plan": "plan -N 1000 -T 10 --target-zcdp 0.5 --mechanism tree -M 50 --out DEST",
    "export": "export {missing}/checkpoint --format onnx --out DEST",
    "export --bundle": "export {missing}/checkpoint --bundle DEST",
    "service serve": "service serve {config} --state DEST",
    "fleet run": "fleet run {config} --state DEST",
    "fleet emulate --fleet-dir": "fleet emulate {config} --coordinator http://127.0.0.1:9 --fleet-dir DEST",
    "fleet emulate --summary": "fleet emulate {config} --coordinator http://127.0.0.1:9 "
                               "--summary DEST",  # a file
    "public teacher-tokenizer": "public teacher-tokenizer --teacher {missing} --out DEST",
    "public distill-corpus": "public distill-corpus --tokenizer {missing} --out DEST",
    "public pretrain": "public pretrain --tokenizer {missing} --out DEST",
    "public fred-stats": f"public fred-stats {EXAMPLES / 'fred.toml'} --out DEST",
    "public fred-rank": "public fred-rank --stats {missing}/s.npz --candidates kjv --plot DEST",
    "public offline-stage": "public offline-stage --out DEST",
    "public pipeline": f"public pipeline {EXAMPLES / 'public_pipeline.toml'} --out DEST",
    "data get": "data get kjv",  # writes the cache: DPFLEET_CACHE=DEST
}


def write_config(path: Path, values: dict) -> Path:
    path.write_text(to_toml(parse_config(values).resolved()))
    return path


def run_cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    """(exit code, the `error:` lines) of one in-process `dpfleet` command that must fail: it
    ends with its error line (warnings a run prints first, e.g. about its noise, may precede it)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err and err[-1].startswith("error: ") and "Traceback" not in "\n".join(err), err
    return exc.value.code, [line for line in err if line.startswith("error")]


def argv_for(name: str, dest: Path, tmp_path: Path, monkeypatch) -> list[str]:
    config = write_config(tmp_path / "tiny.toml", TINY)
    if name == "data get":
        monkeypatch.setenv("DPFLEET_CACHE", str(dest))
    return [str(dest) if a == "DEST" else a
            for a in WRITERS[name].format(config=config, missing=tmp_path / "missing").split()]


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder no one can write in: a read-only tmpfs for root, mode 0500 for anyone else."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o500)
        yield folder
        folder.chmod(0o700)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"root without a read-only mount here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.parametrize("name", WRITERS)
@pytest.mark.parametrize("blocked", ["file in the way", "read-only"])
def test_an_unwritable_destination_is_one_error_line(name, blocked, tmp_path, capsys, monkeypatch,
                                                     request):
    if blocked == "file in the way":
        (tmp_path / "file").write_text("a user's file")
        dest, reason = tmp_path / "file" / "out", "Not a directory"
    else:
        dest = request.getfixturevalue("read_only_dir") / "out"
        reason = "Read-only file system" if os.geteuid() == 0 else "Permission denied"
    code, err = run_cli(argv_for(name, dest, tmp_path, monkeypatch), capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {dest}") and reason in err[0], err
    assert {p.name for p in tmp_path.iterdir()} <= {"file", "ro", "tiny.toml"}  # nothing new


@pytest.mark.parametrize("name", ["fleet emulate --summary", "public fred-rank"])
def test_a_file_whose_folder_is_missing_is_one_error_line(name, tmp_path, capsys, monkeypatch):
    """A folder is created with its parents; a file is written into a folder that must exist."""
    dest = tmp_path / "no" / "such"
    code, err = run_cli(argv_for(name, dest, tmp_path, monkeypatch), capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {dest}:") and "No such file or directory" in err[0], err
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("name", ["simulate", "service serve"])
def test_a_config_refused_after_loading_its_data_leaves_nothing(name, tmp_path, capsys, monkeypatch):
    config = write_config(tmp_path / "bad.toml", NEEDS_MORE_CLIENTS)
    dest = tmp_path / "runs" / "bad"  # its parent is created on the way, and removed again
    code, err = run_cli(WRITERS[name].format(config=config).replace("DEST", str(dest)).split(), capsys)
    assert code == 2 and len(err) == 1 and "disjoint participation needs" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.toml"]  # the corrected config
    # then uses the same directory (it used to land in runs/bad-2)


def test_a_folder_that_existed_empty_is_emptied_not_removed(tmp_path, capsys):
    config = write_config(tmp_path / "bad.toml", NEEDS_MORE_CLIENTS)
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _ = run_cli(["simulate", str(config), "--out", str(empty), "--quiet"], capsys)
    assert code == 2 and empty.is_dir() and not any(empty.iterdir())


def test_a_folder_that_held_anything_is_never_cleaned(tmp_path, capsys):
    """--overwrite reuses a folder with a user's file in it: a failed run removes none of it."""
    config = write_config(tmp_path / "bad.toml", NEEDS_MORE_CLIENTS)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    code, _ = run_cli(["simulate", str(config), "--out", str(out), "--overwrite", "--quiet"], capsys)
    assert code == 2 and (out / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("name", ["simulate", "plan", "service serve"])
def test_a_full_disk_is_one_line_and_leaves_nothing(name, tmp_path, capsys, monkeypatch):
    dest = tmp_path / "out"
    argv = argv_for(name, dest, tmp_path, monkeypatch)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    code, err = run_cli(argv, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: /") and err[0].endswith(": No space left on device"), err
    assert not dest.exists()  # what it had created is gone


def test_debug_shows_the_traceback(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("DPFLEET_DEBUG", "1")
    with pytest.raises(NotADirectoryError):
        main(WRITERS["plan"].replace("DEST", str(tmp_path / "file" / "out")).split())
