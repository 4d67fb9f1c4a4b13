"""JSON files have one writer (`dpfleet.jsonio.write_json`): atomic, 0600, and the same bytes the
sites wrote before (indent, key order, a trailing newline where there was one). A disk that
fills up mid-write leaves the old file of a run directory (config.json, a JSON summary, the
checkpoint's tokenizer.json), never half of the new one."""

import os
import resource
import signal
from contextlib import contextmanager

import pytest

from dpfleet.coordinator.state.run_dir import RunDir
from dpfleet.edge.tokenizer import WordTokenizer, load_tokenizer
from dpfleet.jsonio import dumps, write_json

# what the tokenizer's save wrote before write_json (WordTokenizer(["the", "cat"]))
TOKENIZER_JSON = '{"kind": "word", "vocab_size": 6, "words": ["the", "cat"]}'


@contextmanager
def disk_full_after(nbytes: int):
    """Writes past `nbytes` into any file fail with EFBIG (RLIMIT_FSIZE), as on a full disk."""
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_write_json_writes_what_dumps_says_atomically_and_0600(tmp_path):
    obj = {"b": [1, 2.5, float("inf")], "a": {"é": None}}
    path = write_json(tmp_path / "x.json", obj, indent=1, end="\n")
    assert path.read_text() == dumps(obj, indent=1) + "\n" == '{\n "b": [\n  1,\n  2.5,\n  null\n ],\n ' \
        '"a": {\n  "\\u00e9": null\n }\n}\n'
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]  # no temporary file left


def test_what_is_not_json_writes_nothing_and_keeps_the_old_file(tmp_path):
    write_json(tmp_path / "x.json", {"old": 1})
    with pytest.raises(TypeError):
        write_json(tmp_path / "x.json", {"new": object()})
    assert (tmp_path / "x.json").read_text() == '{"old": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


def test_a_run_directorys_json_files_keep_their_bytes(tmp_path):
    run = RunDir(tmp_path / "run")
    resolved = {"rounds": 3, "dp": {"clip_norm": 0.5, "target_epsilon": float("inf")}, "seed": 1}
    run.write_config(resolved)
    assert (run.path / "config.json").read_text() == '{\n  "rounds": 3,\n  "dp": {\n    "clip_norm": 0.5,' \
        '\n    "target_epsilon": null\n  },\n  "seed": 1\n}'
    run.write_json("privacy.json", {"epsilon": 1.25, "delta": 1e-06})
    assert (run.path / "privacy.json").read_text() == '{\n  "epsilon": 1.25,\n  "delta": 1e-06\n}'
    WordTokenizer(["the", "cat"]).save(run.path / "tokenizer")
    assert (run.path / "tokenizer" / "tokenizer.json").read_text() == TOKENIZER_JSON
    for name in ("config.json", "privacy.json", "tokenizer/tokenizer.json"):
        assert os.stat(run.path / name).st_mode & 0o777 == 0o600, name


@pytest.mark.parametrize("write", [
    lambda run: run.write_config({"rounds": 3, "notes": "x" * 5000}),
    lambda run: run.write_json("privacy.json", {"notes": "x" * 5000}),
    lambda run: WordTokenizer([f"w{i}" for i in range(2000)]).save(run.path / "tokenizer"),
])
def test_a_disk_full_mid_write_leaves_the_old_file(tmp_path, write):
    run = RunDir(tmp_path / "run")
    run.write_config({"rounds": 2})
    run.write_json("privacy.json", {"epsilon": 1.0})
    WordTokenizer(["the", "cat"]).save(run.path / "tokenizer")
    files = ("config.json", "privacy.json", "tokenizer/tokenizer.json")
    before = {name: (run.path / name).read_bytes() for name in files}
    with pytest.raises(OSError), disk_full_after(4096):
        write(run)
    assert {name: (run.path / name).read_bytes() for name in files} == before
    assert load_tokenizer(run.path / "tokenizer").vocab_size == WordTokenizer(["the", "cat"]).vocab_size
