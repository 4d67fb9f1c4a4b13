"""Bundle rollback: an older bundle signed with the same key is refused once a newer one was taken.

The attack: the signer exported bundle 1 (here: a 10x smaller learning rate and batch 2, standing
in for "a known bad model or weaker settings"), then bundle 2. A device runs bundle 2; a
coordinator, proxy or mirror that kept bundle 1 hands it back with a plan that matches it. The
signature verifies (same key), so only the signed `bundle_serial` can tell them apart. The device
must refuse bundle 1 and keep training with bundle 2: the delta it reports afterwards is bundle
2's, which differs from bundle 1's by a large margin.

`BlobLink` stands in for `fleet/link.CoordinatorLink` (blobs by hash, and the report), so the
device side runs without a service; tests/test_fleet_bundle.py covers the real sockets.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
from bundle_helpers import make_bundle, program_cache, sentences, word_checkpoint
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from dpfleet.edge.bundle_format import (
    MANIFEST,
    SIGNATURE,
    BundleError,
    public_key_hex,
    sign_manifest,
    verify_bundle,
)
from dpfleet.edge.device_client import BundleClient
from dpfleet.errors import DpfleetError
from dpfleet.export.bundle_serial import last_serial, next_serial, serial_file
from dpfleet.fleet import bundle_device
from dpfleet.fleet.participant import take_part

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def two_bundles(tmp_path_factory):
    """(old, new, key file, public key hex): two exports signed with one key, old first."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("rollback")
    key = root / "release.signing_key.pem"
    key.write_bytes(Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    for name, lr, batch in (("old", 0.05, 2), ("new", 0.5, 4)):
        ckpt, _ = word_checkpoint(root / name / "ckpt", "cifg")
        (root / name / "config.json").write_text(json.dumps({"client": {"lr": lr}}))
        summary = make_bundle(ckpt, root / name / "bundle", program_cache(tmp_path_factory),
                              batch_size=batch, signing_key=key)
    return root / "old" / "bundle", root / "new" / "bundle", key, summary["public_key"]


def _rows(client: BundleClient) -> np.ndarray:
    return client.examples(sentences(9, 3))


@pytest.mark.slow
def test_each_export_signs_a_higher_serial(two_bundles, tmp_path):
    old, new, key, pub = two_bundles
    serials = [verify_bundle(b, pub).manifest["bundle_serial"] for b in (old, new)]
    assert serials[0] < serials[1] == last_serial(key)
    assert serial_file(key).parent == key.parent  # beside the key, never inside a bundle
    with pytest.raises(DpfleetError, match="not above"):
        next_serial(key, serials[1])  # a release pipeline cannot reuse or go back
    own = tmp_path / "k.pem"
    assert next_serial(own, 5) == 5 and next_serial(own) > 5  # unix time floor: > 1.7e9
    assert last_serial(own) > 1_700_000_000
    serial_file(own).write_text("many")
    with pytest.raises(DpfleetError, match="counter"):
        next_serial(own)


@pytest.mark.slow
def test_the_serial_is_covered_by_the_signature(two_bundles, tmp_path):
    old, _, _, pub = two_bundles
    copy = tmp_path / "old"
    shutil.copytree(old, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["bundle_serial"] += 10**6  # an attacker renumbers the old bundle
    blob, _ = sign_manifest(manifest, Ed25519PrivateKey.generate())
    (copy / MANIFEST).write_bytes(blob)  # keeps the genuine signature: it no longer matches
    with pytest.raises(BundleError, match="signature"):
        BundleClient(copy, pub)


@pytest.mark.slow
def test_bundle_client_refuses_the_older_bundle_and_keeps_the_newer(two_bundles):
    old, new, _, pub = two_bundles
    device = BundleClient(new, pub)
    floor = device.serial
    theta = device.weights()
    # what the rollback would change: the old bundle's epoch from the same weights
    stale = BundleClient(old, pub)  # no minimum set: an old bundle still loads (and trains)
    d_old = stale.train_epoch(theta, _rows(stale), seed=7)
    d_new = device.train_epoch(theta, _rows(device), seed=7)
    assert np.abs(d_old - d_new).max() > 0.5 * np.abs(d_new).max() > 1e-3
    with pytest.raises(BundleError, match="rollback") as refused:
        device = BundleClient(old, pub, min_serial=floor)
    assert f"below {floor}" in str(refused.value)
    assert device.serial == floor and device.lr == 0.5 and device.batch_size == 4
    assert np.array_equal(device.train_epoch(theta, _rows(device), seed=7), d_new)
    assert BundleClient(new, pub, min_serial=floor).serial == floor  # the same bundle: fine


def _legacy(bundle, tmp_path, key_file):
    """The bundle as an export from before serials would be: no bundle_serial, same key."""
    copy = tmp_path / "legacy"
    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    del manifest["bundle_serial"]
    key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    blob, signature = sign_manifest(manifest, key)
    (copy / MANIFEST).write_bytes(blob)
    (copy / SIGNATURE).write_bytes(signature)
    return copy


@pytest.mark.slow
def test_a_bundle_without_serial_loads_only_where_no_minimum_is_set(two_bundles, tmp_path):
    _, new, key, pub = two_bundles
    legacy = _legacy(new, tmp_path, key)
    assert BundleClient(legacy, pub).serial is None
    with pytest.raises(BundleError, match="serial None is below"):
        BundleClient(legacy, pub, min_serial=1)


class BlobLink:
    """Stands in for CoordinatorLink: serves blobs by sha256 and records reports."""

    def __init__(self):
        self.blobs: dict[str, bytes] = {}
        self.reports: list[np.ndarray] = []

    def put(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        self.blobs[sha] = data
        return sha

    async def blob(self, sha: str) -> bytes:
        return self.blobs[sha]

    async def report(self, round_, attempt, delta, **kwargs) -> None:
        self.reports.append(np.array(delta))


def _assignment(link: BlobLink, bundle, pub, theta: np.ndarray, round_: int) -> dict:
    """A plain-aggregation assignment that serves `bundle` with a plan matching it."""
    client = BundleClient(bundle, pub)
    for data in client.bundle.files.values():
        link.put(data)
    ref = {"manifest_sha256": link.put((bundle / MANIFEST).read_bytes()),
           "signature_sha256": link.put((bundle / SIGNATURE).read_bytes())}
    plan = {"lr": client.lr, "batch_size": client.batch_size, "seq_len": client.seq_len,
            "runtime": "onnx", "client_seed": 7, "clip_norm": 100.0,
            "tokenizer_sha256": link.put(b"tokenizer")}
    return {"round": round_, "attempt": 0, "aggregation": "plain", "bundle": ref,
            "plan_sha256": link.put(json.dumps(plan).encode()),
            "model_sha256": link.put(theta.astype("<f4").tobytes())}


@pytest.mark.slow
def test_a_fleet_device_refuses_the_rollback_and_trains_the_newer_bundle(two_bundles, tmp_path,
                                                                       monkeypatch):
    old, new, key, pub = two_bundles
    monkeypatch.setattr(bundle_device, "_CACHE", {})
    link = BlobLink()
    newer = BundleClient(new, pub)
    theta = newer.weights()
    rows = _rows(newer)
    serials: dict[str, int] = {}  # the device's own state (DeviceState.bundle_serials)

    def part(bundle, round_):
        assignment = _assignment(link, bundle, pub, theta, round_)
        return asyncio.run(take_part(link, assignment, rows, bundle_key=bytes.fromhex(pub),
                                     bundle_serials=serials))

    assert part(new, 1).kind == "reported"
    assert serials == {pub: newer.serial}
    d_new = newer.clip(newer.train_epoch(theta, rows, seed=7), 100.0)[0]
    assert np.array_equal(link.reports[-1], d_new)
    stale = BundleClient(old, pub)
    d_old = stale.clip(stale.train_epoch(theta, rows, seed=7), 100.0)[0]
    assert np.abs(d_old - d_new).max() > 0.5 * np.abs(d_new).max()  # what the rollback would do
    refused = part(old, 2)  # the coordinator hands the older bundle back
    assert refused.kind == "refused_bundle" and "rollback" in refused.detail
    assert len(link.reports) == 1 and serials == {pub: newer.serial}  # nothing sent or lowered
    legacy = part(_legacy(new, tmp_path, key), 3)  # nor a re-signed copy without a serial
    assert legacy.kind == "refused_bundle" and len(link.reports) == 1
    assert part(new, 4).kind == "reported"  # and it goes on with the newer bundle
    assert np.array_equal(link.reports[-1], d_new)
    assert np.abs(link.reports[-1] - d_old).max() > 0.5 * np.abs(d_new).max()


@pytest.mark.slow
def test_the_record_is_per_key(two_bundles, tmp_path, monkeypatch):
    """A device that also pins another key (another app's bundles) keeps a minimum per key."""
    _, new, _, pub = two_bundles
    monkeypatch.setattr(bundle_device, "_CACHE", {})
    other = public_key_hex(Ed25519PrivateKey.generate().public_key())
    serials = {other: 10**12}
    link = BlobLink()
    newer = BundleClient(new, pub)
    assignment = _assignment(link, new, pub, newer.weights(), 1)
    out = asyncio.run(take_part(link, assignment, _rows(newer), bundle_key=bytes.fromhex(pub),
                                bundle_serials=serials))
    assert out.kind == "reported" and serials == {other: 10**12, pub: newer.serial}


def test_a_restarted_fleet_worker_keeps_its_devices_minimum(monkeypatch):
    """A worker reports each device's raised minimum at once (like its timer), so a device of a
    worker that died starts again with it: a crash does not reopen the rollback."""
    from service_fleet import tiny_cfg

    from dpfleet.fleet import emulate

    class Proc:  # stands in for the worker process: first dead (as after kill -9), then alive
        pid, exitcode = 1, -9

        def __init__(self, alive: bool):
            self.alive = alive

        def is_alive(self) -> bool:
            return self.alive

        def join(self, timeout=None) -> None:
            pass

    started = []
    monkeypatch.setattr(emulate, "RESTART_DELAY_S", 0.0)
    monkeypatch.setattr(emulate.Fleet, "_start_worker",
                        lambda self, spec: started.append(spec) or Proc(len(started) > 1))
    keys = [Ed25519PrivateKey.generate() for _ in range(2)]
    fleet = emulate.Fleet(tiny_cfg(), "https://127.0.0.1:1", ["a", "b"],
                          [np.zeros((1, 3), np.int64)] * 2, keys, {}, processes=1, seed=0,
                          model_bytes=4, start_hour=0.0, log=lambda s: None)
    fleet.start()
    fleet.events.put(("bundle_serials", 0, 1, {"ab" * 32: 7}))
    fleet.poll(5.0)
    assert len(started) == 2  # the dead worker was started again
    devices = {d.index: d.bundle_serials for d in started[-1].devices}
    assert devices == {0: {}, 1: {"ab" * 32: 7}}


@given(serial=st.one_of(st.none(), st.integers(0, 2**63)),
       floor=st.one_of(st.none(), st.integers(0, 2**63)))
def test_check_serial_accepts_exactly_the_bundles_at_or_above_the_minimum(serial, floor):
    from dpfleet.edge.bundle_format import check_serial

    accepted = floor is None or (serial is not None and serial >= floor)
    try:
        check_serial(serial, floor, "bundle")
    except BundleError as exc:
        assert not accepted and "rollback" in str(exc)
    else:
        assert accepted


@given(value=st.one_of(st.booleans(), st.floats(), st.text(max_size=5), st.integers(max_value=-1),
                       st.lists(st.integers(), max_size=2)))
def test_a_signed_serial_that_is_not_a_count_is_refused(value):
    from dpfleet.edge.bundle_format import bundle_serial

    with pytest.raises(BundleError, match="bundle_serial"):
        bundle_serial({"bundle_serial": value}, "bundle")


@pytest.mark.slow
def test_cli_serial_below_the_last_is_one_error_line(two_bundles, tmp_path, capsys):
    from dpfleet.cli import main

    old, _, key, _ = two_bundles
    checkpoint = old.parent / "ckpt"
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(checkpoint), "--bundle", str(tmp_path / "b"), "--signing-key",
              str(key), "--serial", str(last_serial(key))])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "not above" in err[0]
    assert not (tmp_path / "b").exists()
