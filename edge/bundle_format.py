"""The phone bundle's on-disk format and its verification (numpy-free, torch-free).

A bundle is a folder: `manifest.json` (canonical JSON: sorted keys, no spaces, ASCII), its
Ed25519 signature `manifest.sig` (64 raw bytes over exactly the manifest file's bytes), and
every other file listed in the manifest with its size and sha256 (the signer's public key
`signing_key.pub` included, as a convenience copy: trust comes from the key the app pins, never
from the bundle). `verify_bundle` checks the signature, then every file, and returns the files'
bytes: callers hand those verified bytes (never a second read from disk) to ONNX Runtime,
ExecuTorch or SentencePiece, so a flipped byte cannot reach native code. The manifest's signed
`bundle_serial` lets a device refuse a bundle older than one it already accepted (`check_serial`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from dpfleet.errors import DpfleetError
from dpfleet.io import sha256_hex
from dpfleet.jsonio import canonical_bytes

BUNDLE_VERSION = 1
MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
PUBLIC_KEY = "signing_key.pub"
MAX_MANIFEST_BYTES = 4 << 20


class BundleError(DpfleetError):
    """A bundle that fails verification: bad signature, wrong hash, missing or unlisted file."""


def canonical_json(obj: object) -> bytes:
    """The one byte string a manifest is signed as (and written as)."""
    return canonical_bytes(obj)


def sign_manifest(manifest: dict, key: Ed25519PrivateKey) -> tuple[bytes, bytes]:
    """(canonical manifest bytes, their 64-byte Ed25519 signature)."""
    blob = canonical_json(manifest)
    return blob, key.sign(blob)


def public_key_pem(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def public_key_hex(key: Ed25519PublicKey) -> str:
    """The raw 32-byte key as hex: what an app pins."""
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def load_public_key(key: Ed25519PublicKey | bytes | str | Path) -> Ed25519PublicKey:
    """An Ed25519 public key from a key object, 32 raw bytes, 64 hex chars, PEM bytes or a file."""
    if isinstance(key, Ed25519PublicKey):
        return key
    if isinstance(key, Path):
        try:
            key = key.read_bytes()
        except OSError as exc:
            raise BundleError(f"cannot read public key {key}: {exc.strerror}") from exc
    if isinstance(key, str):
        key = key.strip().encode()
    try:
        if len(key) == 32:
            return Ed25519PublicKey.from_public_bytes(key)
        if len(key) == 64:
            return Ed25519PublicKey.from_public_bytes(bytes.fromhex(key.decode("ascii")))
        loaded = serialization.load_pem_public_key(key)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BundleError(f"not an Ed25519 public key ({exc})") from exc
    if not isinstance(loaded, Ed25519PublicKey):
        raise BundleError("the public key is not an Ed25519 key")
    return loaded


def bundle_serial(manifest: dict, where: object) -> int | None:
    """The signed manifest's `bundle_serial` (export/bundle_serial.py); None for a bundle
    exported before serials existed. Read it only from a manifest whose signature verified."""
    if "bundle_serial" not in manifest:
        return None
    serial = manifest["bundle_serial"]
    if type(serial) is not int or serial < 0:
        raise BundleError(f"{where}: the signed bundle_serial is not a non-negative integer: "
                          f"{serial!r}")
    return serial


def check_serial(serial: int | None, min_serial: int | None, where: object) -> None:
    """Refuse a bundle older than the newest one the device accepted from the same key (a
    rollback to a bundle the signer has replaced). No minimum: any bundle, serial or not."""
    if min_serial is not None and (serial is None or serial < min_serial):
        raise BundleError(f"{where}: bundle serial {serial} is below {min_serial}, the newest "
                          "this device accepted from this key: an older bundle (rollback) is "
                          "refused")


@dataclass(frozen=True)
class VerifiedBundle:
    """A bundle whose signature and file hashes were checked; `files` holds the checked bytes."""

    folder: Path
    manifest: dict
    files: dict[str, bytes]

    def read(self, name: str) -> bytes:
        if name not in self.files:
            raise BundleError(f"{self.folder}: the manifest lists no file {name!r}")
        return self.files[name]


def _safe_name(name: object) -> bool:
    if not isinstance(name, str) or not name or "\\" in name:
        return False
    path = PurePosixPath(name)
    return not path.is_absolute() and ".." not in path.parts and name not in (MANIFEST, SIGNATURE)


def _read(path: Path, limit: int | None = None) -> bytes:
    try:
        with open(path, "rb") as fh:
            data = fh.read() if limit is None else fh.read(limit + 1)
    except OSError as exc:
        raise BundleError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if limit is not None and len(data) > limit:
        raise BundleError(f"{path} is larger than {limit} bytes")
    return data


def verify_bundle(folder: Path, public_key: Ed25519PublicKey | bytes | str | Path) -> VerifiedBundle:
    """Check the manifest's signature with `public_key`, then every listed file's size and sha256
    (and that no unlisted file lies in the folder). Any failure is a BundleError naming it."""
    folder = Path(folder)
    key = load_public_key(public_key)
    if not folder.is_dir():
        raise BundleError(f"bundle folder not found: {folder}")
    blob = _read(folder / MANIFEST, MAX_MANIFEST_BYTES)
    signature = _read(folder / SIGNATURE, 64)
    try:
        key.verify(signature, blob)
    except InvalidSignature as exc:
        raise BundleError(
            f"{folder}: the manifest's signature does not verify with the given public key "
            "(tampered manifest, damaged signature, or another signer)"
        ) from exc
    try:
        manifest = json.loads(blob)
    except ValueError as exc:  # signed but unparsable: the signer's bug, still no crash
        raise BundleError(f"{folder}: signed manifest is not JSON ({exc})") from exc
    if not isinstance(manifest, dict) or canonical_json(manifest) != blob:
        raise BundleError(f"{folder}: signed manifest is not canonical JSON")
    if manifest.get("bundle_version") != BUNDLE_VERSION:
        raise BundleError(
            f"{folder}: bundle version {manifest.get('bundle_version')!r}; this client reads {BUNDLE_VERSION}"
        )
    listed = manifest.get("files")
    if not isinstance(listed, dict):
        raise BundleError(f"{folder}: manifest has no file list")
    files = {}
    for name, entry in sorted(listed.items()):
        if not _safe_name(name):
            raise BundleError(f"{folder}: manifest lists an invalid file name {name!r}")
        size = entry.get("bytes") if isinstance(entry, dict) else None
        if type(size) is not int or size < 0 or not isinstance(entry.get("sha256"), str):
            raise BundleError(f"{folder}: manifest entry of {name} needs integer bytes and a sha256")
        path = folder / name
        if not path.is_file():
            raise BundleError(f"{folder}: {name} is listed in the manifest but missing")
        if path.stat().st_size != size:
            raise BundleError(f"{folder}: {name} has {path.stat().st_size} bytes, the manifest says {size}")
        data = _read(path, size)
        if len(data) != size or sha256_hex(data) != entry.get("sha256"):
            raise BundleError(f"{folder}: {name} does not match its sha256 in the signed manifest")
        files[name] = data
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir()}
    if extra := sorted(on_disk - set(files) - {MANIFEST, SIGNATURE}):
        raise BundleError(f"{folder}: files not in the signed manifest: {extra}")
    return VerifiedBundle(folder, manifest, files)
