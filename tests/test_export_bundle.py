"""The phone bundle: signed manifest, every file verified before use, bad input never crashes.

Attacks: a tampered file, a re-signed bundle carrying the attacker's own public key, a mix of
two bundles, an unlisted file, a signed path-traversal name, and a fuzz of single-byte flips over
every file (each gives a BundleError before any byte reaches ONNX Runtime or SentencePiece).
"""

from __future__ import annotations

import json
import os
import shutil
import stat

import numpy as np
import pytest
import torch
from bundle_helpers import make_bundle, program_cache, sentences, spm_checkpoint, word_checkpoint
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from edge_models import SEQ_LEN, tiny_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numerics import scaled_bound

from dpfleet.cli import main
from dpfleet.edge.bundle_format import (
    MANIFEST,
    PUBLIC_KEY,
    SIGNATURE,
    BundleError,
    canonical_json,
    load_public_key,
    sign_manifest,
    verify_bundle,
)
from dpfleet.edge.device_client import BundleClient
from dpfleet.export.bundle import default_key_path
from dpfleet.io import sha256_hex

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def spm_bundle(tmp_path_factory):
    """A bundle over a SentencePiece checkpoint (so spm.model is among the fuzzed files)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("spm-bundle")
    folder = spm_checkpoint(root / "ckpt")
    summary = make_bundle(folder, root / "bundle", program_cache(tmp_path_factory))
    return root / "bundle", summary


def copy(bundle, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(bundle, out)
    return out


@pytest.mark.slow
def test_bundle_is_complete_and_verifies(spm_bundle):
    bundle, summary = spm_bundle
    verified = verify_bundle(bundle, summary["public_key"])
    m = verified.manifest
    assert set(verified.files) == {"infer.onnx", "step.onnx", "train.onnx", "weights.bin", PUBLIC_KEY,
                                   "tokenizer/tokenizer.json", "tokenizer/spm.model",
                                   "ort_required_operators.config"}
    assert (bundle / MANIFEST).read_bytes() == canonical_json(m)
    for name, entry in m["files"].items():
        assert entry["sha256"] == sha256_hex((bundle / name).read_bytes())
    train = m["training"]["onnx"]
    names = [p["name"] for p in m["model"]["parameters"]]
    assert [i["name"] for i in train["inputs"]] == ["inputs", "targets", *(f"p.{n}" for n in names)]
    assert [o["name"] for o in train["outputs"]] == ["loss", *(f"g.{n}" for n in names)]
    assert train["inputs"][0]["shape"][1] == SEQ_LEN and train["inputs"][0]["dtype"] == "int64"
    assert train["opsets"]["ai.onnx"] >= 17 and train["ir_version"] >= 8
    assert train["ops"] == sorted(train["ops"]) and {"ai.onnx::MatMul", "ai.onnx::Tanh"} <= set(train["ops"])
    assert m["examples"] == {"seq_len": SEQ_LEN, "row_length": SEQ_LEN + 1, "max_examples": 256,
                             "dtype": "int64"}
    assert m["tokenizer"]["special_ids"] == {"pad": 0, "bos": 1, "eos": 2, "unk": 3}
    assert m["model"]["parameter_count"] * 4 == m["files"]["weights.bin"]["bytes"]
    assert m["measured"]["window_vs_eager"]["top1"] == 1.0
    assert {"examples", "epoch", "loss", "sgd", "clipping", "window", "words"} <= set(m["rules"])
    assert m["runtimes"]["onnxruntime"]
    config = verified.read("ort_required_operators.config").decode().splitlines()
    listed = {op for line in config if not line.startswith("#") for op in line.split(";")[2].split(",")}
    for program in (train, m["inference"]["window"], m["inference"]["step"]):
        assert {op.split("::")[1] for op in program["ops"]} <= listed


@pytest.mark.slow
def test_generated_key_is_private_and_reused(spm_bundle, tmp_path_factory):
    bundle, summary = spm_bundle
    key_file = default_key_path(bundle)
    assert summary["signing_key_generated"] and summary["signing_key"] == str(key_file)
    assert key_file.parent == bundle.parent  # never shipped inside the bundle
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert load_public_key(bundle / PUBLIC_KEY) == load_public_key(summary["public_key"])
    # a second export to the same place (after removing the first) reuses the key
    again = tmp_path_factory.mktemp("again")
    shutil.copy(key_file, again / "b.signing_key.pem")
    ckpt = bundle.parent / "ckpt"
    second = make_bundle(ckpt, again / "b", program_cache(tmp_path_factory))
    assert not second["signing_key_generated"] and second["public_key"] == summary["public_key"]


@pytest.mark.slow
def test_other_signer_is_refused_even_with_its_key_inside(spm_bundle, tmp_path):
    """The attacker swaps the weights, rewrites the hashes, re-signs with their own key and ships
    their public key in the bundle: an app that pins the real key refuses it; trusting the
    bundle's own key file would have loaded weights far from the real ones."""
    bundle, summary = spm_bundle
    out = copy(bundle, tmp_path)
    evil = np.frombuffer((out / "weights.bin").read_bytes(), "<f4") + np.float32(5.0)
    (out / "weights.bin").write_bytes(evil.astype("<f4").tobytes())
    attacker = Ed25519PrivateKey.generate()
    (out / PUBLIC_KEY).write_bytes(attacker.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    m = json.loads((out / MANIFEST).read_bytes())
    for name in ("weights.bin", PUBLIC_KEY):
        data = (out / name).read_bytes()
        m["files"][name] = {"bytes": len(data), "sha256": sha256_hex(data)}
    blob, sig = sign_manifest(m, attacker)
    (out / MANIFEST).write_bytes(blob)
    (out / SIGNATURE).write_bytes(sig)
    with pytest.raises(BundleError, match="signature does not verify"):
        BundleClient(out, summary["public_key"])
    naive = BundleClient(out, out / PUBLIC_KEY)  # what pinning prevents
    real = BundleClient(bundle, summary["public_key"])
    assert np.abs(naive.weights() - real.weights()).min() >= 4.9


@pytest.mark.slow
def test_tampering_without_resigning_is_caught(spm_bundle, tmp_path):
    bundle, summary = spm_bundle
    key = summary["public_key"]
    out = copy(bundle, tmp_path)
    m = json.loads((out / MANIFEST).read_bytes())
    m["client"]["clip_norm"] = 1e6  # a manifest edit: a device that believed it would not clip
    (out / MANIFEST).write_bytes(canonical_json(m))
    with pytest.raises(BundleError, match="signature"):
        verify_bundle(out, key)
    shutil.copy(bundle / MANIFEST, out / MANIFEST)
    verify_bundle(out, key)
    (out / "extra.onnx").write_bytes(b"x")
    with pytest.raises(BundleError, match="not in the signed manifest"):
        verify_bundle(out, key)
    (out / "extra.onnx").unlink()
    (out / "infer.onnx").unlink()
    with pytest.raises(BundleError, match="infer.onnx is listed"):
        verify_bundle(out, key)


@pytest.mark.slow
def test_files_from_another_bundle_are_caught(spm_bundle, tmp_path_factory):
    from dpfleet.export.training import ProgramSpec, training_program

    bundle, summary = spm_bundle
    root = tmp_path_factory.mktemp("other")
    # another model's bundle's train.onnx: the bytes BundleExport writes for the edge tests' word
    # CIFG, its cached training program (not a whole second bundle: its inference exports)
    other = training_program(ProgramSpec(tiny_config("cifg"), SEQ_LEN, None, "onnx"),
                             program_cache(tmp_path_factory)).read_verified()
    assert other != (bundle / "train.onnx").read_bytes()
    mixed = root / "mixed"
    shutil.copytree(bundle, mixed)
    (mixed / "train.onnx").write_bytes(other)
    with pytest.raises(BundleError, match="train.onnx"):
        verify_bundle(mixed, summary["public_key"])


@pytest.mark.slow
def test_signed_but_malformed_manifests_are_refused(spm_bundle, tmp_path):
    """Even a validly signed manifest cannot point outside the bundle or crash the reader."""
    bundle, _ = spm_bundle
    out = copy(bundle, tmp_path)
    key = Ed25519PrivateKey.generate()
    secret = tmp_path / "secret.txt"
    secret.write_text("outside")
    m = json.loads((out / MANIFEST).read_bytes())
    m["files"]["../secret.txt"] = {"bytes": 7, "sha256": sha256_hex(b"outside")}
    blob, sig = sign_manifest(m, key)
    (out / MANIFEST).write_bytes(blob)
    (out / SIGNATURE).write_bytes(sig)
    with pytest.raises(BundleError, match="invalid file name"):
        verify_bundle(out, key.public_key())
    del m["files"]["../secret.txt"]
    m["files"]["weights.bin"]["bytes"] = "many"  # a signed but malformed entry: an error, no crash
    blob, sig = sign_manifest(m, key)
    (out / MANIFEST).write_bytes(blob)
    (out / SIGNATURE).write_bytes(sig)
    with pytest.raises(BundleError, match="integer bytes"):
        verify_bundle(out, key.public_key())


@pytest.mark.slow
def test_bad_public_keys_are_clear_errors(spm_bundle, tmp_path):
    bundle, _ = spm_bundle
    for bad in ("zz" * 32, b"short", tmp_path / "missing.pem"):
        with pytest.raises(BundleError):
            verify_bundle(bundle, bad)
    other = Ed25519PrivateKey.generate().public_key()
    with pytest.raises(BundleError, match="signature"):
        verify_bundle(bundle, other)


FILES = ["manifest.json", "manifest.sig", "signing_key.pub", "weights.bin", "train.onnx", "infer.onnx",
         "step.onnx", "tokenizer/tokenizer.json", "tokenizer/spm.model", "ort_required_operators.config"]


@pytest.fixture
def no_native_loads(monkeypatch):
    """Fails the test if any bytes reach ONNX Runtime or SentencePiece."""
    import onnxruntime
    import sentencepiece

    def refuse(*args, **kwargs):
        raise AssertionError("bytes reached a native loader before verification failed")

    monkeypatch.setattr(onnxruntime, "InferenceSession", refuse)
    monkeypatch.setattr(sentencepiece, "SentencePieceProcessor", refuse)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(FILES), st.floats(0, 1, exclude_max=True), st.integers(0, 7))
@pytest.mark.slow
def test_every_single_byte_flip_is_refused_before_loading(spm_bundle, no_native_loads, name, where, bit):
    bundle, summary = spm_bundle
    path = bundle / name
    original = path.read_bytes()
    data = bytearray(original)
    data[int(where * len(data))] ^= 1 << bit
    try:
        path.write_bytes(bytes(data))
        with pytest.raises(BundleError) as info:
            BundleClient(bundle, summary["public_key"])
        assert name in str(info.value) or "signature" in str(info.value)
    finally:
        path.write_bytes(original)


@pytest.mark.slow
def test_fuzz_sweeps_first_and_last_byte_of_every_file(spm_bundle, no_native_loads):
    bundle, summary = spm_bundle
    for name in FILES:
        path = bundle / name
        original = path.read_bytes()
        for pos in (0, len(original) - 1):
            data = bytearray(original)
            data[pos] ^= 0xFF
            try:
                path.write_bytes(bytes(data))
                with pytest.raises(BundleError):
                    BundleClient(bundle, summary["public_key"])
            finally:
                path.write_bytes(original)
        path.write_bytes(original[:-1])  # truncation too
        try:
            with pytest.raises(BundleError):
                BundleClient(bundle, summary["public_key"])
        finally:
            path.write_bytes(original)


@pytest.fixture(scope="module")
def kv_bundle(tmp_path_factory):
    """A transformer bundle: its streaming program is the KV-cache step, kv_step.onnx."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("kv-bundle")
    folder, _ = word_checkpoint(root / "ckpt", "transformer")
    summary = make_bundle(folder, root / "bundle", program_cache(tmp_path_factory))
    return root / "bundle", summary


def flip_is_refused(bundle, key, name: str, data: bytes) -> None:
    path = bundle / name
    original = path.read_bytes()
    try:
        path.write_bytes(data)
        with pytest.raises(BundleError) as info:
            BundleClient(bundle, key)
        assert name in str(info.value) or "signature" in str(info.value)
    finally:
        path.write_bytes(original)


def test_transformer_bundle_sweep_covers_every_listed_file(kv_bundle, no_native_loads):
    """The files come from the signed manifest, not a fixed list, so a new file is never skipped:
    first / middle / last byte flipped and a truncation of each are refused, naming it."""
    bundle, summary = kv_bundle
    names = [*verify_bundle(bundle, summary["public_key"]).files, MANIFEST, SIGNATURE]
    assert "kv_step.onnx" in names and "step.onnx" not in names
    for name in names:
        original = (bundle / name).read_bytes()
        for pos in (0, len(original) // 2, len(original) - 1):
            data = bytearray(original)
            data[pos] ^= 0x01
            flip_is_refused(bundle, summary["public_key"], name, bytes(data))
        flip_is_refused(bundle, summary["public_key"], name, original[:-1])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.floats(0, 1, exclude_max=True), st.integers(0, 7))
def test_kv_step_byte_flips_are_refused_before_loading(kv_bundle, no_native_loads, where, bit):
    bundle, summary = kv_bundle
    data = bytearray((bundle / "kv_step.onnx").read_bytes())
    data[int(where * len(data))] ^= 1 << bit
    flip_is_refused(bundle, summary["public_key"], "kv_step.onnx", bytes(data))


@pytest.mark.slow  # ~20 s: a second transformer bundle to take its KV step from
def test_kv_step_from_another_bundle_is_caught(kv_bundle, tmp_path_factory):
    """A KV step of another cache size (another bundle's) swapped in: caught by its signed sha256."""
    bundle, summary = kv_bundle
    root = tmp_path_factory.mktemp("kv-other")
    folder, _ = word_checkpoint(root / "ckpt", "transformer")
    make_bundle(folder, root / "bundle", program_cache(tmp_path_factory), seq_len=SEQ_LEN - 1)
    mixed = root / "mixed"
    shutil.copytree(bundle, mixed)
    shutil.copy(root / "bundle" / "kv_step.onnx", mixed / "kv_step.onnx")
    with pytest.raises(BundleError, match="kv_step.onnx"):
        verify_bundle(mixed, summary["public_key"])


@pytest.mark.slow
def test_intact_bundle_still_loads_after_the_fuzz(spm_bundle):
    bundle, summary = spm_bundle
    client = BundleClient(bundle, summary["public_key"])
    words = client.suggest("alice ea", k=3)
    assert words and all(w.casefold().startswith("ea") for w in words), words  # typed: any case


def run_cli(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code, capsys.readouterr().err


@pytest.mark.slow
def test_cli_writes_a_bundle(spm_bundle, tmp_path, capsys, monkeypatch, tmp_path_factory):
    bundle, _ = spm_bundle
    cache = tmp_path / "xdg" / "dpfleet"
    cache.mkdir(parents=True)
    (cache / "programs").symlink_to(program_cache(tmp_path_factory))  # the session's exports
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    key = tmp_path / "key.pem"
    key.write_bytes(Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("\n".join(sentences(30, 5)))
    main(["export", str(bundle.parent / "ckpt"), "--bundle", str(tmp_path / "b"), "--signing-key", str(key),
          "--seq-len", str(SEQ_LEN), "--heldout", str(heldout)])
    summary = json.loads(capsys.readouterr().out)
    window = summary["measured"]["window_vs_eager"]
    assert window["text"].startswith("held-out text (30 lines)")
    assert window["max_abs_err"] <= scaled_bound(window["ref_max_abs"])
    assert summary["signing_key"] == str(key) and not summary["signing_key_generated"]
    verify_bundle(tmp_path / "b", summary["public_key"])
    assert not default_key_path(tmp_path / "b").exists()


@pytest.mark.slow
def test_cli_mistakes_are_one_line(spm_bundle, tmp_path, capsys):
    bundle, _ = spm_bundle
    ckpt = bundle.parent / "ckpt"
    rsa_like = tmp_path / "ec.pem"
    rsa_like.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    cases = [
        (["--bundle", str(tmp_path / "a"), "--signing-key", str(rsa_like)], "must be Ed25519"),
        (["--bundle", str(tmp_path / "a"), "--signing-key", str(tmp_path / "none.pem")], "cannot read"),
        (["--bundle", str(busy)], "not empty"),
        (["--bundle", str(tmp_path / "a"), "--format", "onnx"], "--bundle takes no"),
        ([], "--bundle"),
    ]
    for extra, message in cases:
        code, err = run_cli(["export", str(ckpt), *extra], capsys)
        assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "a").exists() and not list(tmp_path.glob(".a.partial-*"))


@pytest.mark.parametrize("damage", ["spm_flip", "spm_truncated", "json_malformed", "json_wrong_types"])
@pytest.mark.slow
def test_damaged_tokenizer_is_one_error_line(spm_bundle, tmp_path, capsys, damage):
    bundle, _ = spm_bundle
    ckpt = tmp_path / "ckpt"
    shutil.copytree(bundle.parent / "ckpt", ckpt)
    spm, meta = ckpt / "tokenizer" / "spm.model", ckpt / "tokenizer" / "tokenizer.json"
    if damage == "spm_flip":
        data = bytearray(spm.read_bytes())
        data[0] ^= 0xFF  # the first protobuf tag: the model no longer parses
        spm.write_bytes(bytes(data))
    elif damage == "spm_truncated":
        spm.write_bytes(spm.read_bytes()[: len(spm.read_bytes()) // 3])
    elif damage == "json_malformed":
        meta.write_text(meta.read_text()[:-5])
    else:
        meta.write_text(json.dumps({"kind": "sentencepiece", "model_file": 7}))
    code, err = run_cli(["export", str(ckpt), "--bundle", str(tmp_path / "b")], capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and not (tmp_path / "b").exists()
    assert not os.path.exists(default_key_path(tmp_path / "b"))  # nothing written before the check


@pytest.mark.slow
def test_bad_run_config_is_one_error_line(spm_bundle, tmp_path, capsys):
    bundle, _ = spm_bundle
    run = tmp_path / "run"
    shutil.copytree(bundle.parent / "ckpt", run / "checkpoint")
    (run / "config.json").write_text(json.dumps({"client": {"lr": "fast"}}))
    code, err = run_cli(["export", str(run / "checkpoint"), "--bundle", str(tmp_path / "b")], capsys)
    assert code == 2 and "client.lr is not a number" in err and err.count("\n") == 1
    (run / "config.json").write_text("{not json")
    code, err = run_cli(["export", str(run / "checkpoint"), "--bundle", str(tmp_path / "b")], capsys)
    assert code == 2 and "config.json: unreadable" in err


@pytest.mark.slow
def test_a_bundle_follows_the_permission_rule_under_a_permissive_umask(spm_bundle):
    """Exported from Python under the test process's umask (022): every folder of the bundle is
    0700 and every file 0600, the exporters' and tokenizer's own files too (dpfleet.io's rule;
    a user hands a bundle on with chmod or cp)."""
    import stat

    bundle, _ = spm_bundle
    modes = {str(p.relative_to(bundle)): stat.S_IMODE(p.lstat().st_mode) for p in bundle.rglob("*")}
    modes["."] = stat.S_IMODE(bundle.stat().st_mode)
    assert {"manifest.json", "tokenizer/spm.model"} <= set(modes)
    assert {name: m for name, m in modes.items() if m != (0o700 if (bundle / name).is_dir() else 0o600)} == {}
