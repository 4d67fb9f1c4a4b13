"""Every load of a staged teacher checks its files against `staged.json` (not only
`dpfleet public offline-check`).

The attack: on the server, flip float32 sign bits in the staged safetensors (the logits then
move by > 0.5 while staying finite, so no job would notice), or drop in a file the manifest does
not list, and run a teacher job. The loader must refuse before the tampered weights give a
single logit; a teacher converted locally (no staged.json) keeps loading as before. The tiny
local teacher stands in for Gemma in the packaged slot (the GGUF fetch is made to fail).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpfleet.cli import main
from dpfleet.edge import staged as staged_module
from dpfleet.errors import DpfleetError
from dpfleet.public import teacher as teacher_module
from dpfleet.public.offline import stage_bundle
from dpfleet.public.teacher import load_teacher

IDS = torch.tensor([[2, 40, 41, 300, 12, 7, 99]])


def _logits(spec: str) -> torch.Tensor:
    return load_teacher(spec, device="cpu").logits(IDS, torch.ones_like(IDS))


def _attempt(spec: str) -> torch.Tensor | DpfleetError:
    """What a teacher job gets from the loader: the logits, or the refusal."""
    try:
        return _logits(spec)
    except DpfleetError as exc:
        return exc


def _flip_signs(path) -> None:
    blob = bytearray(path.read_bytes())
    for i in range(len(blob) - 1, len(blob) * 3 // 4, -4):  # float32 sign bits, last quarter
        blob[i] ^= 0x80
    path.write_bytes(bytes(blob))


@pytest.fixture
def server(tiny_teacher_dir, tmp_path, monkeypatch):
    """A staged cache copied to the 'server' (DPFLEET_CACHE points there); downloads refused."""
    def refuse(*args, **kwargs):
        raise AssertionError("the packaged teacher was fetched, not taken from the cache")

    monkeypatch.setattr(teacher_module, "fetch_packaged_gguf", refuse)
    local = tmp_path / "connected-cache"
    shutil.copytree(tiny_teacher_dir, local / "teachers" / "gemma3-270m")
    monkeypatch.setenv("DPFLEET_CACHE", str(local))
    stage_bundle(tmp_path / "bundle", ["gemma3-270m"], [])
    shutil.copytree(tmp_path / "bundle", tmp_path / "server-cache")
    monkeypatch.setenv("DPFLEET_CACHE", str(tmp_path / "server-cache"))
    staged_module.forget_digests()
    return tmp_path / "server-cache"


def test_sign_flipped_staged_weights_never_reach_a_job(server, tiny_teacher_dir, tmp_path):
    clean = _logits("gemma3-270m")
    assert torch.equal(clean, _logits(str(tiny_teacher_dir)))  # the staged copy is the teacher
    weights = server / "teachers" / "gemma3-270m" / "model.safetensors"
    original = weights.read_bytes()
    _flip_signs(weights)
    # what the flip does to the logits (measured on an unstaged copy: no manifest there)
    shutil.copytree(server / "teachers" / "gemma3-270m", tmp_path / "loose" / "teacher")
    moved = (_logits(str(tmp_path / "loose" / "teacher")) - clean).abs().max().item()
    assert moved > 0.5
    for spec in ("gemma3-270m", str(server / "teachers" / "gemma3-270m")):  # by name, by path
        got = _attempt(spec)
        assert isinstance(got, DpfleetError), (
            f"tampered teacher loaded by {spec}: logits moved by "
            f"{(got - clean).abs().max().item():.3f}")
        assert "model.safetensors" in str(got) and "staged.json" in str(got)
    weights.write_bytes(original)  # the intact file loads again, to the same logits
    assert torch.equal(_logits("gemma3-270m"), clean)


def test_a_rewrite_that_restores_size_and_mtime_is_hashed_again(server, monkeypatch):
    """The in-process digest cache keys on (inode, size, mtime, ctime): setting mtime back does
    not make a rewritten file look checked (ctime cannot be set from user space)."""
    monkeypatch.setattr(staged_module, "RACY_NS", -1)  # cache even these fresh files
    clean = _logits("gemma3-270m")
    weights = server / "teachers" / "gemma3-270m" / "model.safetensors"
    stamp = weights.stat()
    cached = [k for k in staged_module._DIGESTS if k[0] == str(weights.resolve())]
    assert len(cached) == 1 and cached[0][-1] == stamp.st_ctime_ns  # the load used the cache
    assert staged_module.file_sha256(weights) == staged_module._DIGESTS[cached[0]]
    _flip_signs(weights)
    os.utime(weights, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert weights.stat().st_size == stamp.st_size
    got = _attempt("gemma3-270m")
    assert isinstance(got, DpfleetError), f"logits moved by {(got - clean).abs().max():.3f}"


def test_unlisted_or_missing_files_are_refused(server):
    folder = server / "teachers" / "gemma3-270m"
    extra = folder / "model-00002-of-00002.safetensors"
    extra.write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(DpfleetError, match="not listed"):
        load_teacher("gemma3-270m", device="cpu")
    extra.unlink()
    (folder / "tokenizer.model").unlink()
    with pytest.raises(DpfleetError, match="tokenizer.model"):
        load_teacher("gemma3-270m", device="cpu")


def test_an_unreadable_manifest_is_refused(server):
    (server / "staged.json").write_text("{not json")
    with pytest.raises(DpfleetError, match="staged.json"):
        load_teacher("gemma3-270m", device="cpu")


def test_a_locally_converted_teacher_without_manifest_still_loads(tiny_teacher_dir, tmp_path,
                                                                  monkeypatch):
    cache = tmp_path / "cache"
    shutil.copytree(tiny_teacher_dir, cache / "teachers" / "gemma3-270m")
    monkeypatch.setenv("DPFLEET_CACHE", str(cache))
    assert torch.equal(_logits("gemma3-270m"), _logits(str(tiny_teacher_dir)))


def test_a_job_on_a_tampered_teacher_is_one_error_line(server, tmp_path, capsys):
    _flip_signs(server / "teachers" / "gemma3-270m" / "model.safetensors")
    corpus = tmp_path / "public.jsonl"
    corpus.write_text('{"user": "u", "text": "the cat sat on the mat"}\n' * 50)
    with pytest.raises(SystemExit) as exit_info:
        main(["public", "teacher-tokenizer", "--teacher", "gemma3-270m", "--vocab-size", "300",
              "--out", str(tmp_path / "vocab"), "--dataset", "jsonl", "--path", str(corpus)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "model.safetensors" in err[0]
    assert not (tmp_path / "vocab").exists()


def _restage(server) -> None:
    """The stronger attacker: after editing the weights, rewrite staged.json to match them."""
    import json

    from dpfleet.edge.staged import file_sha256

    manifest = server / "staged.json"
    files = json.loads(manifest.read_text())["sha256"]
    manifest.write_text(json.dumps({"sha256": {n: file_sha256(server / n) for n in files}}))


def test_the_pinned_list_digest_stops_an_attacker_who_rewrites_the_list(server, tiny_teacher_dir,
                                                                        monkeypatch):
    """staged.json alone cannot stop someone who also rewrites it; the digest offline-stage
    printed (DPFLEET_STAGED_SHA256) can."""
    from dpfleet.edge.staged import PIN_ENV, file_sha256
    from dpfleet.public.offline import offline_check

    clean = _logits("gemma3-270m")
    pin = file_sha256(server / "staged.json")  # what offline-stage printed
    monkeypatch.setenv(PIN_ENV, pin)
    assert torch.equal(_logits("gemma3-270m"), clean)  # the intact bundle loads under the pin
    _flip_signs(server / "teachers" / "gemma3-270m" / "model.safetensors")
    _restage(server)
    monkeypatch.delenv(PIN_ENV)
    unpinned = _attempt("gemma3-270m")  # the list matches the edit: only the pin can tell
    assert isinstance(unpinned, torch.Tensor) and (unpinned - clean).abs().max() > 0.5
    monkeypatch.setenv(PIN_ENV, pin)
    for spec in ("gemma3-270m", str(tiny_teacher_dir)):  # a loose folder is refused too
        got = _attempt(spec)
        assert isinstance(got, DpfleetError) and PIN_ENV in str(got)
    with pytest.raises(DpfleetError, match=PIN_ENV):
        offline_check("gemma3-270m", [], "cpu")
    (server / "staged.json").unlink()  # deleting the list does not switch the check off
    got = _attempt("gemma3-270m")
    assert isinstance(got, DpfleetError) and PIN_ENV in str(got)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pick=st.floats(0, 1, exclude_max=True), where=st.floats(0, 1, exclude_max=True),
       bit=st.integers(0, 7))
def test_any_single_bit_flip_in_any_staged_teacher_file_is_refused(server, pick, where, bit):
    from dpfleet.edge.staged import verify_staged_teacher

    folder = server / "teachers" / "gemma3-270m"
    files = sorted(f for f in folder.rglob("*") if f.is_file())
    target = files[int(pick * len(files))]
    original = target.read_bytes()
    blob = bytearray(original)
    blob[int(where * len(blob))] ^= 1 << bit
    target.write_bytes(bytes(blob))
    try:
        with pytest.raises(DpfleetError, match=target.name):
            verify_staged_teacher(folder)
    finally:
        target.write_bytes(original)
    verify_staged_teacher(folder)  # restored: accepted again (re-hashed: its ctime moved)


def test_a_file_changed_in_the_last_seconds_is_never_cached(tmp_path):
    """Coarse timestamps: a rewrite within the same tick keeps every stamp, so a fresh file is
    hashed again each time rather than trusted from the cache."""
    path = tmp_path / "w.bin"
    path.write_bytes(b"a" * 64)
    first = staged_module.file_sha256(path)
    assert not [k for k in staged_module._DIGESTS if k[0] == str(path.resolve())]
    path.write_bytes(b"b" * 64)  # possibly within the same timestamp tick
    assert staged_module.file_sha256(path) != first
