"""Top-k labelling survives a kill, verifies its shards, and is cached across jobs.

On a tiny random Llama teacher (conftest.build_tiny_teacher) with a trimmed vocabulary; the
real Gemma is never loaded here.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import dpfleet.edge.staged as staged
from dpfleet.cli import main
from dpfleet.errors import DpfleetError
from dpfleet.public.teacher import load_teacher
from dpfleet.public.teacher_tokenizer import TeacherVocab, build_teacher_vocab, load_teacher_spm
from dpfleet.public.topk import TopKCorpus, TopKExtractor, build_corpus, student_sequences
from dpfleet.public.topk_cache import cached_topk_corpus, teacher_digest

_WORDS = [
    "the", "of", "and", "to", "in", "a", "is", "was", "for", "on", "as", "with", "by", "he",
    "at", "from", "his", "an", "were", "are", "which", "this", "be", "had", "not", "or", "but",
    "its", "first", "new", "one", "their", "after", "been", "two", "they", "has", "also", "who",
    "all", "she", "her", "other", "into", "more", "than", "time", "city", "when", "only", "most",
    "there", "some", "would", "about", "up", "over",
]


def _lines(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14))).capitalize() + " ."
            for _ in range(n)]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tiny_teacher_builder) -> Path:
    return tiny_teacher_builder(tmp_path_factory.mktemp("teacher"), _lines(800, 0), 400)


@pytest.fixture(scope="module")
def vocab_dir(teacher_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vocab")
    build_teacher_vocab(load_teacher_spm(teacher_dir), _lines(400, 1), 330, out, "tiny")
    return out


@pytest.fixture(scope="module")
def vocab(vocab_dir) -> TeacherVocab:
    return TeacherVocab.load(vocab_dir)


@pytest.fixture(scope="module")
def teacher(teacher_dir):
    return load_teacher(str(teacher_dir), device="cpu")


@pytest.fixture(scope="module")
def sequences(vocab) -> list[list[int]]:
    return student_sequences(_lines(15, 2), vocab.tokenizer, seq_len=12)[:15]  # 5 shards of 3


def _counting(extractor: TopKExtractor) -> list:
    """Record every teacher batch the extractor runs (one per shard at these sizes)."""
    calls, rows = [], extractor.rows

    def counted(batch):
        calls.append(len(batch))
        return rows(batch)

    extractor.rows = counted
    return calls


def _arrays(folder: Path) -> list[bytes]:
    corpus = TopKCorpus(folder)
    return [a.tobytes() for a in (corpus.tokens, corpus.starts, corpus.topk_ids, corpus.topk_logits)]


@pytest.mark.slow
def test_kill_mid_labelling_resumes_from_the_manifest(teacher, vocab, vocab_dir, teacher_dir,
                                                      sequences, tmp_path):
    (tmp_path / "seqs.json").write_text(json.dumps(sequences))
    killed = tmp_path / "killed"
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("topk_labeller.py")), str(teacher_dir),
         str(vocab_dir), str(tmp_path / "seqs.json"), str(killed), "3", "1.0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    manifest_file, deadline = killed / "manifest.json", time.monotonic() + 120
    try:
        while not (manifest_file.is_file()
                   and json.loads(manifest_file.read_text()).get("shard_files")):
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline, "no shard recorded within 120 s"
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    at_kill = json.loads(manifest_file.read_text())
    recorded = set(at_kill["shard_files"])
    total = -(-len(sequences) // 3)
    assert "shards" not in at_kill and 1 <= len(recorded) < total  # killed mid-job
    stamps = {name: (killed / name).stat().st_mtime_ns for name in recorded}

    extractor = TopKExtractor(teacher, vocab, 4)
    calls, lines = _counting(extractor), []
    build_corpus(extractor, sequences, killed, 3, progress=False, log=lines.append)
    assert len(calls) == total - len(recorded)  # the recorded shards ran no teacher batch
    assert {name: (killed / name).stat().st_mtime_ns for name in recorded} == stamps
    assert lines[0] == (f"resuming: {len(recorded)} of {total} shards already labelled "
                        f"({sum(r['tokens'] for r in at_kill['shard_files'].values()):,} of "
                        f"{sum(map(len, sequences)):,} tokens) in {killed}")

    whole = tmp_path / "whole"
    build_corpus(TopKExtractor(teacher, vocab, 4), sequences, whole, 3, progress=False)
    assert _arrays(killed) == _arrays(whole)


def test_corrupt_truncated_and_unrecorded_shards_are_refused_then_recomputed(
        teacher, vocab, sequences, tmp_path, capsys):
    extractor = TopKExtractor(teacher, vocab, 4)
    build_corpus(extractor, sequences, tmp_path, 3, progress=False)
    before = _arrays(tmp_path)
    flipped = bytearray((tmp_path / "shard-00001.npz").read_bytes())
    flipped[len(flipped) // 2] ^= 0x01
    (tmp_path / "shard-00001.npz").write_bytes(bytes(flipped))
    with pytest.raises(DpfleetError) as err:
        TopKCorpus(tmp_path)
    message = str(err.value)
    assert "shard-00001.npz is corrupt" in message and "distill-corpus" in message
    assert str(tmp_path) in message and "\n" not in message

    shard2 = tmp_path / "shard-00002.npz"
    shard2.write_bytes(shard2.read_bytes()[:100])  # truncated
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    del manifest["shard_files"]["shard-00003.npz"]  # written, then killed before its record
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    calls, lines = _counting(extractor), []
    capsys.readouterr()
    build_corpus(extractor, sequences, tmp_path, 3, progress=True, log=lines.append)
    assert len(calls) == 3
    done = sum(map(len, sequences[:3])) + sum(map(len, sequences[12:]))
    assert lines[0].startswith(f"resuming: 2 of 5 shards already labelled ({done:,} of ")
    differs = "SHA-256 differs from manifest.json's (truncated, corrupt or another corpus's)"
    assert lines[1:] == [
        f"top-k shard {tmp_path / 'shard-00001.npz'}: {differs}; recomputing it",
        f"top-k shard {tmp_path / 'shard-00002.npz'}: {differs}; recomputing it",
        f"top-k shard {tmp_path / 'shard-00003.npz'}: present but not recorded in manifest.json; "
        "recomputing it"]
    assert f"{done}/{sum(map(len, sequences))}" in capsys.readouterr().err  # the bar's start
    assert _arrays(tmp_path) == before


def test_a_corpus_without_hashes_still_loads_unverified(teacher, vocab, sequences, tmp_path):
    build_corpus(TopKExtractor(teacher, vocab, 4), sequences, tmp_path, 8, progress=False)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    del manifest["shard_files"]  # as written before the hashes were recorded
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert len(TopKCorpus(tmp_path)) == len(sequences)
    (tmp_path / "shard-00000.npz").write_bytes(b"garbage")
    with pytest.raises(DpfleetError, match=r"shard-00000.npz is unreadable .*distill-corpus"):
        TopKCorpus(tmp_path)


def test_cache_returns_at_once_and_every_input_gets_its_own_entry(
        teacher, vocab, teacher_dir, sequences, tmp_path, monkeypatch):
    monkeypatch.setenv("DPFLEET_CACHE", str(tmp_path / "cache"))
    lines = []

    def cached(extractor, seqs=sequences):
        return cached_topk_corpus(extractor, seqs, shard_sequences=8, progress=False,
                                  log=lines.append)

    first = cached(TopKExtractor(teacher, vocab, 4))
    assert first.parent == tmp_path / "cache" / "topk"
    assert lines[0].startswith(f"top-k labels: labelling into {first}")
    again = TopKExtractor(teacher, vocab, 4)
    calls = _counting(again)
    lines.clear()
    assert cached(again) == first and calls == []  # no teacher forward at all
    assert lines == [f"top-k labels: cached in {first}"]
    assert len(TopKCorpus(first)) == len(sequences)
    (first / "shard-00001.npz").write_bytes(b"damaged")  # a damaged entry is repaired, not served
    lines.clear()
    assert cached(again) == first and len(calls) == 1 and len(TopKCorpus(first)) == len(sequences)
    assert "shard-00001.npz: SHA-256 differs" in lines[-1]

    # as large, trimmed on other text: the same ids stand for other pieces
    other_vocab = build_teacher_vocab(load_teacher_spm(teacher_dir), _lines(400, 3), 330,
                                      tmp_path / "vocab2", "tiny")
    assert not np.array_equal(other_vocab.student_to_teacher, vocab.student_to_teacher)
    other_head = TopKExtractor(teacher, vocab, 4)
    # an int8-screened head's labels are not the float32 head's (only the recorded mode counts here)
    other_head.head_mode = "float32" if other_head.head_mode == "int8" else "int8"
    variants = {
        "k": cached(TopKExtractor(teacher, vocab, 3)),
        "targets": cached(TopKExtractor(teacher, vocab, 4, targets="student")),
        "vocabulary": cached(TopKExtractor(teacher, other_vocab, 4)),
        "sequences": cached(TopKExtractor(teacher, vocab, 4), sequences[:-1]),
        "head": cached(other_head),
    }
    assert len({first, *variants.values()}) == 6, variants
    head_manifest = json.loads((variants["head"] / "manifest.json").read_text())
    assert head_manifest.get("head_mode", "float32") == other_head.head_mode
    assert json.loads((variants["k"] / "key.json").read_text())["k"] == 3


def test_teacher_identity_is_its_files_hashes_computed_once(teacher_dir, tmp_path, monkeypatch):
    copy = shutil.copytree(teacher_dir, tmp_path / "teacher")
    sidecar, hashed = tmp_path / "sidecar.json", []
    real = staged.sha256_file
    monkeypatch.setattr(staged, "sha256_file", lambda p: hashed.append(p.name) or real(p))
    monkeypatch.setattr(staged, "RACY_NS", -10**18)  # the copy is new: keep its digests anyway
    first = teacher_digest(copy, sidecar)
    assert sorted(first) == ["config.json", "model.safetensors"] and len(hashed) == 2
    assert teacher_digest(copy, sidecar) == first and len(hashed) == 2  # from the sidecar
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = config["rms_norm_eps"] * 2  # another model, same file names
    (copy / "config.json").write_text(json.dumps(config))
    second = teacher_digest(copy, sidecar)
    assert hashed[2:] == ["config.json"] and second["config.json"] != first["config.json"]
    assert second["model.safetensors"] == first["model.safetensors"]
    (copy / "model.safetensors").unlink()
    with pytest.raises(DpfleetError, match="no weights file"):
        teacher_digest(copy, sidecar)


def test_cli_without_out_labels_into_the_cache_then_finds_it(teacher_dir, vocab_dir, tmp_path,
                                                             monkeypatch, capsys):
    monkeypatch.setenv("DPFLEET_CACHE", str(tmp_path / "cache"))
    records = tmp_path / "public.jsonl"
    records.write_text("\n".join(json.dumps({"user": f"u{i}", "text": t})
                                 for i, t in enumerate(_lines(12, 9))))
    args = ["public", "distill-corpus", "--teacher", str(teacher_dir), "--tokenizer",
            str(vocab_dir), "--dataset", "jsonl", "--path", str(records), "--k", "4",
            "--device", "cpu", "--shard-sequences", "5"]
    main(args)
    out = capsys.readouterr()
    summary = json.loads(out.out)
    folder = Path(summary["corpus"])
    assert folder.parent == tmp_path / "cache" / "topk" and "labelling into" in out.err
    assert len(TopKCorpus(folder)) == summary["sequences"]
    stamp = (folder / "manifest.json").stat().st_mtime_ns
    main(args)
    again = capsys.readouterr()
    assert json.loads(again.out) == summary
    assert f"top-k labels: cached in {folder}" in again.err
    assert (folder / "manifest.json").stat().st_mtime_ns == stamp


def test_distill_corpus_help_says_what_is_resumed_verified_and_cached(capsys):
    main(["public", "distill-corpus", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for phrase in ("Resumed:", "Verified:", "Cached:", "SHA-256", "$DPFLEET_CACHE/topk/"):
        assert phrase in text



def test_attack_weights_rewritten_with_size_and_mtime_restored_get_their_own_digest(
        teacher_dir, tmp_path, monkeypatch):
    """Another teacher's bytes put in place of the cached one's, same size, mtime set back with
    utime (what `cp -p` or rsync of a re-conversion does): the cache must not hand out the old
    teacher's labels, so the digest must be the new bytes'. ctime, which user space cannot set,
    is in the sidecar's stamps."""
    copy = shutil.copytree(teacher_dir, tmp_path / "teacher")
    monkeypatch.setattr(staged, "RACY_NS", -10**18)
    sidecar, weights = tmp_path / "sidecar.json", copy / "model.safetensors"
    first = teacher_digest(copy, sidecar)["model.safetensors"]
    before = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of the last weight: another model, same size
    time.sleep(0.01)
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (before.st_size,
                                                                     before.st_mtime_ns)
    second = teacher_digest(copy, sidecar)["model.safetensors"]
    assert second == hashlib.sha256(bytes(data)).hexdigest() != first


@pytest.fixture(scope="module")
def other_teacher(teacher_dir, tmp_path_factory):
    """Teacher B: teacher A's folder with another output layer (same vocabulary, other labels)."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("teacher-b")
    for path in teacher_dir.iterdir():
        shutil.copy(path, folder / path.name)
    model = AutoModelForCausalLM.from_pretrained(str(teacher_dir))
    torch.manual_seed(7)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return load_teacher(str(folder), device="cpu")


def _label_cached(extractor, sequences) -> Path:
    return cached_topk_corpus(extractor, sequences, shard_sequences=8, progress=False,
                              log=lambda line: None)


def _rows_differing(a: Path, b: Path) -> int:
    x, y = TopKCorpus(a), TopKCorpus(b)
    return int((x.topk_ids != y.topk_ids).any(axis=1).sum())


def _refusals(err: str) -> list[str]:
    return [line for line in err.splitlines() if "refused" in line]


@pytest.mark.parametrize("swapped", ["whole entry", "manifest and shards"])
def test_attack_another_teachers_cache_entry_is_refused_and_relabelled(
        teacher, other_teacher, vocab, sequences, tmp_path, monkeypatch, capsys, swapped):
    """Teacher A's labels copied over teacher B's cache entry (with A's key.json, or keeping
    B's): B must get its own labels, from its own teacher, never A's with no forward."""
    monkeypatch.setenv("DPFLEET_CACHE", str(tmp_path / "cache"))
    entry_b = _label_cached(TopKExtractor(other_teacher, vocab, 4), sequences)
    truth_b = _arrays(entry_b)
    entry_a = _label_cached(TopKExtractor(teacher, vocab, 4), sequences)
    assert entry_a != entry_b
    for path in entry_a.iterdir():
        if swapped == "whole entry" or path.name != "key.json":
            shutil.copy(path, entry_b / path.name)
    assert _rows_differing(entry_a, entry_b) == 0 and _arrays(entry_b) != truth_b  # poisoned
    again = TopKExtractor(other_teacher, vocab, 4)
    calls = _counting(again)
    capsys.readouterr()
    assert _label_cached(again, sequences) == entry_b
    assert len(calls) == 2  # both shards labelled again by teacher B
    assert _arrays(entry_b) == truth_b  # B's labels, as a fresh labelling made them
    refused = _refusals(capsys.readouterr().err)
    assert len(refused) == 1 and str(entry_b) in refused[0], refused
    secret = tmp_path / "cache" / "topk" / "cache-secret"
    assert secret.stat().st_mode & 0o777 == 0o600


def test_attack_a_shard_swapped_with_its_manifest_updated_is_refused_and_recomputed(
        teacher, other_teacher, vocab, sequences, tmp_path, monkeypatch, capsys):
    """One shard of A's entry replaced by B's labels of the same sequences, its hash written
    into manifest.json: every shard matches its record, but the records are not the cache's."""
    monkeypatch.setenv("DPFLEET_CACHE", str(tmp_path / "cache"))
    entry = _label_cached(TopKExtractor(teacher, vocab, 4), sequences)
    truth = _arrays(entry)
    fresh = tmp_path / "fresh"
    shutil.copytree(entry, fresh)
    build_corpus(TopKExtractor(other_teacher, vocab, 4), sequences, tmp_path / "b", 8,
                 progress=False)
    shutil.copy(tmp_path / "b" / "shard-00001.npz", entry / "shard-00001.npz")
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["shard_files"]["shard-00001.npz"]["sha256"] = hashlib.sha256(
        (entry / "shard-00001.npz").read_bytes()).hexdigest()
    (entry / "manifest.json").write_text(json.dumps(manifest, indent=2))
    wrong = _rows_differing(entry, fresh)
    assert wrong > 0  # the poisoned entry loads (it verifies against its manifest) and is wrong
    again = TopKExtractor(teacher, vocab, 4)
    calls = _counting(again)
    capsys.readouterr()
    assert _label_cached(again, sequences) == entry
    assert calls and _arrays(entry) == truth and _rows_differing(entry, fresh) == 0
    refused = _refusals(capsys.readouterr().err)
    assert len(refused) == 1 and str(entry) in refused[0], refused


def test_a_cache_entry_killed_mid_labelling_resumes_sealed(teacher, vocab, sequences, tmp_path,
                                                           monkeypatch, capsys):
    """Every manifest a cached job writes is sealed, so a half-done entry is this cache's own:
    the rerun keeps its finished shard (no refusal, one teacher batch) and ends with A's labels."""
    monkeypatch.setenv("DPFLEET_CACHE", str(tmp_path / "cache"))
    dying = TopKExtractor(teacher, vocab, 4)
    rows = dying.rows

    def killed_on_the_second_shard(batch, calls=[]):  # noqa: B006 (the count of this extractor)
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return rows(batch)

    dying.rows = killed_on_the_second_shard
    with pytest.raises(KeyboardInterrupt):
        _label_cached(dying, sequences)
    again = TopKExtractor(teacher, vocab, 4)
    calls = _counting(again)
    capsys.readouterr()
    entry = _label_cached(again, sequences)
    assert len(calls) == 1 and not _refusals(capsys.readouterr().err)
    build_corpus(TopKExtractor(teacher, vocab, 4), sequences, tmp_path / "whole", 8, progress=False)
    assert _arrays(entry) == _arrays(tmp_path / "whole")
