"""The run's signed phone bundle (`[fleet] client = "bundle"`): built once, served as blobs.

Why one bundle per run: its training program takes the weights as inputs, so the same program
serves every round and each round's theta travels as the model blob; the devices then train
exactly what a phone would ship (`edge/device_client.py`). Why a key of its own in STATE
(`bundle_key.pem`, 0600): the devices pin its public half (`STATE/bundle_key.pub`) out of band,
so a coordinator, proxy or mirror that serves any other program is refused by every device
before the program reaches a runtime. A restart reuses STATE/bundle when it still verifies with
that key and matches the run's config (same bytes, same manifest hash); otherwise it is rebuilt.

The release (`release_bundle`) is the finished model's bundle, STATE/release, signed with the
same key: published only when the service was given a release policy and the run meets it
(`export/policy.py`), so a model that misses the policy never leaves STATE as a bundle.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dpfleet.coordinator.config import SimulationConfig
from dpfleet.coordinator.run_privacy.caveats import config_facts, run_caveats
from dpfleet.edge.bundle_format import (
    MANIFEST,
    SIGNATURE,
    BundleError,
    VerifiedBundle,
    public_key_hex,
    public_key_pem,
    verify_bundle,
)
from dpfleet.edge.wire.protocol import PUBLIC_FILE
from dpfleet.export.policy import ReleasePolicy
from dpfleet.io import atomic_write, write_secret
from dpfleet.jsonio import write_json
from dpfleet.service.blobs import BlobStore

BUNDLE_DIR = "bundle"
RELEASE_DIR = "release"  # the finished model's bundle, when a release policy passed it
KEY_FILE = "bundle_key.pem"


@dataclass(frozen=True)
class RunBundle:
    """What an assignment names: the manifest's and its signature's blob hashes."""

    manifest_sha256: str
    signature_sha256: str
    public_key: str  # hex; devices must get it out of band, never from the coordinator

    def assignment_field(self) -> dict:
        return {"manifest_sha256": self.manifest_sha256, "signature_sha256": self.signature_sha256}


def bundle_key(state: Path) -> Ed25519PrivateKey:
    """STATE's bundle signing key (generated 0600 on first use); writes its public PEM beside it."""
    path = Path(state) / KEY_FILE
    if path.exists():
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as exc:
            raise BundleError(f"{path}: unreadable bundle key ({exc})") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise BundleError(f"{path}: the bundle key must be Ed25519")
    else:
        key = Ed25519PrivateKey.generate()
        write_secret(path, key.private_bytes(serialization.Encoding.PEM,
                                             serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption()))
    atomic_write(Path(state) / PUBLIC_FILE, public_key_pem(key.public_key()))
    return key


def _runtimes(cfg: SimulationConfig) -> tuple[str, ...]:
    return ("onnx", "executorch") if cfg.client.runtime == "executorch" else ("onnx",)


def _caveats(cfg: SimulationConfig) -> list[str]:
    """The run's caveats from its config (what the status page shows), for the bundle's manifest:
    the operator chose them in the config, so the service's own bundle accepts them."""
    return run_caveats(config_facts(cfg))[0]


def _fits(manifest: dict, cfg: SimulationConfig, model_cfg: dict) -> bool:
    """Whether a bundle left in STATE was built for this run's model and client settings."""
    try:
        client, examples = manifest["client"], manifest["examples"]
        want_pte = cfg.client.runtime == "executorch"
        return (manifest["model"]["config"] == model_cfg
                and examples["seq_len"] == cfg.data.seq_len
                and examples["max_examples"] == cfg.data.max_examples
                and client["lr"] == cfg.client.lr and client["batch_size"] == cfg.client.batch_size
                and client["clip_norm"] == cfg.dp.clip_norm
                and ("pte" in manifest["training"]) == want_pte
                and manifest.get("caveats") == _caveats(cfg))
    except (KeyError, TypeError):
        return False


def build_run_bundle(cfg: SimulationConfig, state: Path, model, model_cfg, tokenizer,
                     log=print) -> VerifiedBundle:
    """STATE/bundle for this run (reused when it verifies and fits), verified with STATE's key."""
    from dpfleet.export.bundle import BundleExport
    from dpfleet.export.checkpoint import save_checkpoint

    state = Path(state)
    key = bundle_key(state)
    folder = state / BUNDLE_DIR
    want = model_cfg.to_dict()
    if folder.exists():
        try:
            verified = verify_bundle(folder, key.public_key())
            if _fits(verified.manifest, cfg, want):
                return verified
        except BundleError as exc:
            log(f"bundle: {exc}; rebuilding it")
        shutil.rmtree(folder)
    log("bundle: exporting the run's signed phone bundle (the devices' training program)")
    with tempfile.TemporaryDirectory(dir=state, prefix=".bundle-src-") as tmp:
        checkpoint = Path(tmp) / "checkpoint"
        save_checkpoint(checkpoint, model, model_cfg, tokenizer)
        # BundleExport reads lr, batch size, clip norm, seq_len, max_examples from here
        write_json(Path(tmp) / "config.json", cfg.resolved())
        BundleExport(checkpoint, folder, runtimes=_runtimes(cfg), signing_key=state / KEY_FILE,
                     seq_len=cfg.data.seq_len, batch_size=cfg.client.batch_size,
                     caveats=_caveats(cfg), accept_caveats=True).run()
    return verify_bundle(folder, key.public_key())


def release_bundle(state: Path, policy: ReleasePolicy, caveats: list[str]) -> dict:
    """The finished run's model as STATE/release, signed with STATE's bundle key, after `policy`
    passed the run (else a PolicyRefused and nothing written); the manifest records the policy.
    The run's caveats were the operator's config choice (as for the devices' bundle): accepted
    here, and refused only by a policy that says allow_caveats = false. Returns its summary."""
    from dpfleet.export.bundle import BundleExport

    state = Path(state)
    policy.check(state, caveats)  # before the key or any file: a refusal writes nothing
    bundle_key(state)
    return BundleExport(state / "checkpoint", state / RELEASE_DIR, signing_key=state / KEY_FILE,
                        caveats=caveats, accept_caveats=True, policy=policy).run()


def publish(bundle: VerifiedBundle, blobs: BlobStore, public_key: str) -> RunBundle:
    """Every file of the bundle, its manifest and signature as pinned content-addressed blobs."""
    for data in bundle.files.values():
        blobs.put(data, pinned=True)
    manifest = blobs.put((bundle.folder / MANIFEST).read_bytes(), pinned=True)
    signature = blobs.put((bundle.folder / SIGNATURE).read_bytes(), pinned=True)
    return RunBundle(manifest, signature, public_key)


def run_bundle(cfg: SimulationConfig, state: Path, model, model_cfg, tokenizer, blobs: BlobStore,
               log=print) -> RunBundle:
    """Build (or reuse) and publish the run's bundle; logs its manifest hash and public key."""
    verified = build_run_bundle(cfg, state, model, model_cfg, tokenizer, log)
    key = public_key_hex(bundle_key(state).public_key())
    published = publish(verified, blobs, key)
    log(f"bundle: manifest {published.manifest_sha256[:12]}..., {len(verified.files)} files, "
        f"public key in {Path(state) / PUBLIC_FILE}")
    return published
