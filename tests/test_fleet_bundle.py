"""`[fleet] client = "bundle"`: the coordinator publishes one signed phone bundle per run and the
devices train with its reference client (`BundleClient`), over real sockets on 127.0.0.1.

Parity: each committed sum equals the sum the eager trainer gives for the same plan (same theta,
devices, seeds) within the bundle's parity tolerance (tests/test_device_client.py: per delta
max |d - eager d| <= 1e-6 + 1e-4 * max |eager d|, so a sum of n is within n * 1e-6 + 1e-4 * the
sum of those maxima), and the whole run keeps `simulate`'s participation and lands within that
tolerance of its final model. Attack: a coordinator serving a bundle that the pinned key did not
sign (another key, or a tampered program re-signed) gets no update: onnxruntime never sees a
byte of it, no round commits and the model stays where it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.numpy import load_file
from service_fleet import capture_sums, fleet_data, run_devices, tiny_cfg

from dpfleet.coordinator.engine.backends import SequentialTrainer
from dpfleet.coordinator.engine.simulation import derive_seed, run_simulation
from dpfleet.edge import device_client
from dpfleet.edge.bundle_format import load_public_key, public_key_hex, sign_manifest
from dpfleet.edge.runtime import EagerRuntime
from dpfleet.export.models import ModelConfig
from dpfleet.fleet import participant
from dpfleet.service.run_bundle import BUNDLE_DIR, KEY_FILE, PUBLIC_FILE, bundle_key
from dpfleet.service.server import shutdown, start

pytest.importorskip("onnxruntime")


BATCH = {"batch_size": 3}  # 8 examples per device: three minibatches, so their order matters


def bundle_cfg(**sections):
    return tiny_cfg(client={"runtime": "onnx", **BATCH}, fleet={"client": "bundle"}, **sections)


def pinned(path) -> bytes:
    return bytes.fromhex(public_key_hex(load_public_key(path)))


async def _serve(cfg, root, keys, examples, *, pin: bytes | None = None, until=None):
    """Serve `cfg` on STATE = root/state to the end (or, with `until(driver, outcomes by
    device)`, until it holds), with every device pinning `pin` (default: STATE's own key)."""
    running = await start(cfg, root / "state", log=lambda s: None)
    sums = capture_sums(running.driver.engine)
    theta0 = running.driver.engine.server.theta.copy()
    pin = pin or pinned(root / "state" / PUBLIC_FILE)
    stop = asyncio.Event()
    per = {d: {"outcomes": []} for d in keys}
    devices = asyncio.create_task(run_devices(running.url, keys, examples, per_device=per,
                                              runtime=cfg.client.runtime, stop=stop, bundle_key=pin))
    outcomes = {d: per[d]["outcomes"] for d in keys}
    if until is None:
        await asyncio.wait_for(asyncio.shield(running.task), 120)
        await asyncio.wait_for(devices, 60)
    else:
        for _ in range(600):
            if until(running.driver, outcomes):
                break
            await asyncio.sleep(0.1)
        stop.set()  # devices in a check-in long-poll would notice only when it returns (~25 s)
        devices.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await devices
    status = running.driver.status()
    theta = running.driver.engine.server.theta.copy()
    model_cfg = ModelConfig(**running.driver.b.model_config)
    await shutdown(running)
    return status, sums, outcomes, model_cfg, theta0, theta


@pytest.mark.slow  # ~15 s: a served run of bundle devices next to its simulation
def test_bundle_devices_commit_the_eager_sum_and_simulates_run(tmp_path, monkeypatch):
    cfg = bundle_cfg(service={"report_deadline_s": 120.0})
    users, examples = fleet_data(cfg, tmp_path / "fleet")
    keys = {u: Ed25519PrivateKey.generate() for u in users}
    def no_dpfleet_trainer(*a, **k):
        raise AssertionError("a bundle device used dpfleet's own runtime")

    monkeypatch.setattr(participant, "runtime_for", no_dpfleet_trainer)
    status, sums, outcomes, model_cfg, _, _ = asyncio.run(_serve(cfg, tmp_path, keys, examples))
    assert status["rounds_committed"] == cfg.rounds and status["rounds_failed"] == 0
    assert {o.kind for outs in outcomes.values() for _, _, o in outs} == {"reported"}
    assert len(sums) == cfg.rounds
    eager = SequentialTrainer(EagerRuntime(model_cfg, 1))
    for plan, aggregate in sums:
        chosen = [plan.devices[u] for u in aggregate.survivors]
        ref = eager.train_round(plan.theta, [examples[users[i]] for i in chosen],
                                [derive_seed(cfg.seed, plan.round, i) for i in chosen], lr=cfg.client.lr,
                                batch_size=cfg.client.batch_size, clip_norm=plan.clip_norm)
        total = np.sum([u.delta.astype(np.float64) for u in ref], axis=0)
        bound = len(ref) * 1e-6 + 1e-4 * sum(np.abs(u.delta).max() for u in ref)
        assert np.abs(total).max() > 1e-2  # real training, not an empty sum
        assert np.abs(aggregate.total - total).max() <= bound
    # the same run through `simulate` with the eager trainer: same participation, same model
    sim_cfg = tiny_cfg(client=BATCH, service={"report_deadline_s": 120.0})
    run_simulation(sim_cfg, tmp_path / "sim", progress=False, log=lambda s: None)
    lines = [(tmp_path / d / "participation.jsonl").read_text() for d in ("state", "sim")]
    assert lines[0] == lines[1]
    ours = load_file(tmp_path / "state" / "checkpoint" / "model.safetensors")
    theirs = load_file(tmp_path / "sim" / "checkpoint" / "model.safetensors")
    for name in ours:
        scale = np.abs(theirs[name]).max()
        assert np.abs(ours[name] - theirs[name]).max() <= 1e-5 + 1e-4 * scale, name
    manifest = json.loads((tmp_path / "state" / BUNDLE_DIR / "manifest.json").read_text())
    assert manifest["client"]["lr"] == cfg.client.lr
    assert manifest["examples"]["seq_len"] == cfg.data.seq_len


def _resign_with(folder, key: Ed25519PrivateKey, tamper: bool) -> None:
    """The coordinator's side of the attack: optionally damage the training program, then
    re-list every file's hash and re-sign the manifest with ITS key."""
    from dpfleet.io import sha256_hex

    manifest = json.loads((folder / "manifest.json").read_text())
    if tamper:
        program = bytearray((folder / "train.onnx").read_bytes())
        program[len(program) // 2] ^= 0xFF
        (folder / "train.onnx").write_bytes(bytes(program))
    for name, entry in manifest["files"].items():
        data = (folder / name).read_bytes()
        entry.update(bytes=len(data), sha256=sha256_hex(data))
    blob, signature = sign_manifest(manifest, key)
    (folder / "manifest.json").write_bytes(blob)
    (folder / "manifest.sig").write_bytes(signature)


@pytest.mark.parametrize("attack", ["other_key", pytest.param("tampered_resigned", marks=pytest.mark.slow)])
def test_a_bundle_the_pinned_key_did_not_sign_is_refused_before_onnxruntime(
        tmp_path, monkeypatch, attack):
    from cryptography.hazmat.primitives import serialization

    cfg = bundle_cfg(rounds=2, service={"report_deadline_s": 1.0})  # all refuse: no wait
    users, examples = fleet_data(cfg, tmp_path / "fleet")
    keys = {u: Ed25519PrivateKey.generate() for u in users}
    state = tmp_path / "state"
    if attack == "other_key":  # the app pinned a key; this coordinator signs with its own
        pin = bytes.fromhex(public_key_hex(Ed25519PrivateKey.generate().public_key()))
    else:  # a genuine bundle first (devices pin its key), then the coordinator's edit
        asyncio.run(_boot_only(cfg, state))
        pin = pinned(state / PUBLIC_FILE)
        rogue = Ed25519PrivateKey.generate()
        (state / KEY_FILE).write_bytes(rogue.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        _resign_with(state / BUNDLE_DIR, rogue, tamper=True)
        assert public_key_hex(bundle_key(state).public_key()) != pin.hex()

    sessions: list = []
    real = device_client.load_session
    monkeypatch.setattr(device_client, "load_session",
                        lambda *a, **k: sessions.append(a[1]) or real(*a, **k))

    def round_failed(driver, outcomes):
        refused = sum(o.kind == "refused_bundle" for outs in outcomes.values() for _, _, o in outs)
        return refused >= cfg.dp.report_goal and driver.status()["rounds_failed"] >= 1

    status, sums, outcomes, _, theta0, theta = asyncio.run(
        _serve(cfg, tmp_path, keys, examples, pin=pin, until=round_failed))
    assert sessions == []  # no byte of the coordinator's bundle reached onnxruntime
    kinds = [o.kind for outs in outcomes.values() for _, _, o in outs]
    assert len(kinds) >= cfg.dp.report_goal and set(kinds) == {"refused_bundle"}
    assert all("not signed by the pinned bundle key" in o.detail
               for outs in outcomes.values() for _, _, o in outs)
    assert status["rounds_failed"] >= 1 and status["rounds_committed"] == 0
    assert sums == []  # the engine was never asked to sum anything
    np.testing.assert_array_equal(theta, theta0)  # no DP step: the model is where it started
    assert not (state / "checkpoint").exists()


async def _boot_only(cfg, state):
    running = await start(cfg, state, log=lambda s: None)
    await shutdown(running)


def bundle_toml(tmp_path, runtime="onnx", rounds=2):
    from test_fleet_cli import tiny_toml

    path = tiny_toml(tmp_path, rounds=rounds)
    text = path.read_text().replace('trainer = "sequential"',
                                    f'trainer = "sequential"\nruntime = "{runtime}"')
    path.write_text(text + '\n[fleet]\nclient = "bundle"\n')
    return path


def test_bundle_config_and_missing_key_are_one_clean_line(tmp_path):
    from cli_helpers import run_here
    from test_cli_errors import assert_clean_error

    cfg = bundle_toml(tmp_path, runtime="eager")
    assert_clean_error(run_here("fleet", "run", str(cfg), "--state", str(tmp_path / "s")),
                       "set client.runtime = 'onnx' or 'executorch'")
    cfg = bundle_toml(tmp_path)
    assert_clean_error(run_here("fleet", "emulate", str(cfg), "--coordinator", "http://127.0.0.1:9"),
                       "needs --bundle-key STATE/bundle_key.pub")
    bad = tmp_path / "bad.pub"
    bad.write_text("not a key")
    assert_clean_error(run_here("fleet", "emulate", str(cfg), "--coordinator", "http://127.0.0.1:9",
                               "--bundle-key", str(bad)), "not an Ed25519 public key")


@pytest.mark.slow  # ~1 min: a coordinator subprocess that exports the bundle, two spawned workers
def test_fleet_run_with_bundle_devices(tmp_path):
    import subprocess
    import sys

    state = tmp_path / "state"
    proc = subprocess.run([sys.executable, "-m", "dpfleet", "fleet", "run", str(bundle_toml(tmp_path)),
                           "--state", str(state), "--processes", "2"],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len((state / "participation.jsonl").read_text().splitlines()) == 2
    summary = json.loads((tmp_path / "state_fleet" / "summary.json").read_text())
    assert summary["counts"].get("reported", 0) >= 2 * 3
    assert not any(k.startswith("refused_bundle") for k in summary["counts"])
    pin = pinned(state / PUBLIC_FILE)
    from dpfleet.edge.bundle_format import verify_bundle

    verify_bundle(state / BUNDLE_DIR, pin)  # the bundle the devices pinned is STATE's
    assert oct((state / KEY_FILE).stat().st_mode & 0o777) == "0o600"


@pytest.mark.slow  # ~14 s: signed SecAgg rounds of bundle devices over loopback
def test_signed_secagg_rounds_with_bundle_devices(tmp_path, monkeypatch):
    """Through signed SecAgg+ too: each committed sum is its survivors' bundle-trained updates
    (within the encoding's bound), and each of those updates is the eager one within tolerance."""
    from test_service_secagg import SECAGG, check_sums, policy_for

    cfg = tiny_cfg(**SECAGG, rounds=2, client={"runtime": "onnx", **BATCH},
                   fleet={"client": "bundle"})
    users, examples = fleet_data(cfg, tmp_path / "fleet")
    keys = {u: Ed25519PrivateKey.generate() for u in users}
    identities = {u: k.public_key().public_bytes_raw() for u, k in keys.items()}
    monkeypatch.setattr(participant, "runtime_for", None)  # calling dpfleet's runtime would fail

    async def main():
        running = await start(cfg, tmp_path / "state", log=lambda s: None, poll_s=2.0)
        sums = capture_sums(running.driver.engine)
        devices = asyncio.create_task(run_devices(
            running.url, keys, examples, runtime="onnx", pinned=identities, policy=policy_for(cfg),
            bundle_key=pinned(tmp_path / "state" / PUBLIC_FILE)))
        await asyncio.wait_for(asyncio.shield(running.task), 180)
        outcomes = await asyncio.wait_for(devices, 30)
        model_cfg = ModelConfig(**running.driver.b.model_config)
        await shutdown(running)
        return sums, outcomes, model_cfg

    sums, outcomes, model_cfg = asyncio.run(main())
    assert len(sums) == cfg.rounds
    check_sums(sums, outcomes)
    eager = SequentialTrainer(EagerRuntime(model_cfg, 1))
    checked = 0
    for plan, agg in sums:
        for u in agg.survivors:
            d = plan.devices[u]
            (o,) = [o for r, _, o in outcomes[users[d]] if r == plan.round + 1 and o.update]
            seeds = [derive_seed(cfg.seed, plan.round, d)]
            (ref,) = eager.train_round(plan.theta, [examples[users[d]]], seeds,
                                       lr=cfg.client.lr, batch_size=cfg.client.batch_size,
                                       clip_norm=plan.clip_norm)
            assert np.abs(o.update.delta - ref.delta).max() <= 1e-6 + 1e-4 * np.abs(ref.delta).max()
            checked += 1
    assert checked >= cfg.rounds * cfg.dp.report_goal


class BlobLink:
    """Stands in for `CoordinatorLink.blob` only: serves bytes by sha256 and records each ask."""

    def __init__(self, blobs: dict[str, bytes]):
        self.blobs, self.asked = blobs, []

    async def blob(self, sha: str) -> bytes:
        self.asked.append(sha)
        return self.blobs[sha]


def _signed(manifest: dict, key: Ed25519PrivateKey) -> tuple[BlobLink, dict]:
    from dpfleet.io import sha256_hex

    blob, sig = sign_manifest(manifest, key)
    link = BlobLink({sha256_hex(blob): blob, sha256_hex(sig): sig})
    return link, {"manifest_sha256": sha256_hex(blob), "signature_sha256": sha256_hex(sig)}


def test_the_signature_is_checked_before_any_listed_file_is_fetched(tmp_path):
    from dpfleet.edge.bundle_format import BundleError
    from dpfleet.fleet.bundle_device import fetch_bundle

    pinned_key, rogue = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    files = {"train.onnx": {"bytes": 3, "sha256": "ab" * 32}}
    link, ref = _signed({"bundle_version": 1, "files": files}, rogue)
    with pytest.raises(BundleError, match="not signed by the pinned bundle key"):
        asyncio.run(fetch_bundle(link, ref, pinned_key.public_key()))
    assert link.asked == [ref["manifest_sha256"], ref["signature_sha256"]]  # no program fetched
    # a manifest the pinned key did sign may still not name a file outside the bundle
    link, ref = _signed({"bundle_version": 1, "files": {"../../escape": files["train.onnx"]}},
                        pinned_key)
    with pytest.raises(BundleError, match="outside the bundle"):
        asyncio.run(fetch_bundle(link, ref, pinned_key.public_key()))
    with pytest.raises(BundleError, match="names no bundle"):
        asyncio.run(fetch_bundle(link, None, pinned_key.public_key()))


class StoreLink:
    """Stands in for `CoordinatorLink.blob` over the coordinator's own BlobStore."""

    def __init__(self, blobs):
        self.blobs = blobs

    async def blob(self, sha: str) -> bytes:
        return self.blobs.get(sha)


@pytest.mark.slow  # an ExecuTorch export: 65-75 s beside the other workers, so with the slow set
def test_a_fleet_device_trains_through_the_bundles_pte(tmp_path, tmp_path_factory, monkeypatch):
    """`client.runtime = "executorch"`: the run's bundle ships train.pte, and a fleet device that
    fetched it (signature first, every file verified) trains its round through the .pte: its
    clipped update equals the eager trainer's, and the ONNX program's, within the parity
    tolerance (max |d - eager d| <= 1e-6 + 1e-4 * max |eager d|, norm to 1e-5 relative). Small
    model: the edge tests' tiny CIFG, whose programs the session's cache holds once
    test_edge_runtime_parity has run (then this test takes seconds, not an export's ~30 s)."""
    pytest.importorskip("executorch")
    from bundle_helpers import program_cache, sentences, word_checkpoint
    from edge_models import SEQ_LEN

    from dpfleet.edge.client_update import client_update
    from dpfleet.export.checkpoint import load_checkpoint
    from dpfleet.fleet.bundle_device import check_plan, fetch_bundle, train_update
    from dpfleet.service.blobs import BlobStore
    from dpfleet.service.run_bundle import run_bundle

    xdg, programs = tmp_path / "xdg", program_cache(tmp_path_factory)
    programs.mkdir(parents=True, exist_ok=True)
    (xdg / "dpfleet").mkdir(parents=True)
    (xdg / "dpfleet" / "programs").symlink_to(programs)  # the session's exports
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    cfg = tiny_cfg(data={"seq_len": SEQ_LEN, "max_examples": 64},
                   client={"runtime": "executorch", "batch_size": 4},
                   fleet={"client": "bundle"})
    model_cfg, model, tok = load_checkpoint(word_checkpoint(tmp_path / "ckpt", "cifg")[0])
    blobs = BlobStore()
    (tmp_path / "state").mkdir()
    published = run_bundle(cfg, tmp_path / "state", model, model_cfg, tok, blobs, log=lambda s: None)
    client, _ = asyncio.run(fetch_bundle(StoreLink(blobs), published.assignment_field(),
                                         pinned(tmp_path / "state" / PUBLIC_FILE)))
    assert client.bundle.manifest["training"]["pte"]["file"] == "train.pte"
    rows = client.examples(sentences(9, 1))
    assert len(rows) % 4  # a partial last minibatch: the static-batch program pads it
    theta = client.weights()
    plan = {"lr": cfg.client.lr, "batch_size": 4, "seq_len": SEQ_LEN, "runtime": "executorch",
            "client_seed": 7}
    check_plan(client, plan, theta)
    for clip in (cfg.dp.clip_norm / 10, 100.0):  # clipped, and left alone
        ref = client_update(EagerRuntime(model_cfg, 1), theta, rows, lr=cfg.client.lr, batch_size=4,
                            clip_norm=clip, seed=7)
        assert np.abs(ref.delta).max() > 1e-3  # the epoch really moved the weights
        for runtime in ("executorch", "onnx"):
            got = train_update(client, {**plan, "clip_norm": clip, "runtime": runtime}, theta, rows)
            assert got.clipped == ref.clipped == (clip < 1)
            assert abs(got.norm - ref.norm) <= 1e-5 * ref.norm
            assert np.abs(got.delta - ref.delta).max() <= 1e-6 + 1e-4 * np.abs(ref.delta).max(), runtime
    assert client._pte is not None  # the .pte program was loaded and ran
