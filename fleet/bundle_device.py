"""A device that trains from the run's signed phone bundle (`[fleet] client = "bundle"`).

Why: the fleet then exercises exactly what a phone would ship (issue 12 item 4, issue 13 item 2):
the program, tokenizer and rules of the bundle, run by the reference client `BundleClient`
(onnxruntime / ExecuTorch + numpy), not dpfleet's trainer. The device pins the bundle's public
key out of band (`fleet emulate --bundle-key`); the coordinator only names the manifest and its
signature by hash. The signature is checked on the manifest's bytes before any listed file is
fetched, and `BundleClient` runs `verify_bundle` (signature, every size and sha256, no unlisted
file) before a byte reaches a runtime. A verified bundle is cached per process by (manifest
hash, pinned key): every emulated device of a worker shares one copy and one session. Each
device keeps its own record of the highest signed `bundle_serial` it accepted per key
(`DeviceState.bundle_serials`) and refuses an older bundle of that key (a rollback).
"""

from __future__ import annotations

import json
import tempfile
import threading
from pathlib import Path

import numpy as np
from cryptography.exceptions import InvalidSignature

from dpfleet.edge.bundle_format import (
    MANIFEST,
    SIGNATURE,
    BundleError,
    bundle_serial,
    check_serial,
    load_public_key,
    public_key_hex,
)
from dpfleet.edge.client_update import ClientUpdate

_CACHE: dict[tuple[str, str], tuple[object, threading.Lock]] = {}
_ROOT: tempfile.TemporaryDirectory | None = None


def _root() -> Path:
    global _ROOT
    if _ROOT is None:  # removed when the process exits
        _ROOT = tempfile.TemporaryDirectory(prefix="dpfleet-bundles-")
    return Path(_ROOT.name)


def _inside(folder: Path, name: object) -> Path:
    target = (folder / str(name)).resolve()
    if not isinstance(name, str) or folder.resolve() not in target.parents:
        raise BundleError(f"the signed manifest lists a file outside the bundle: {name!r}")
    return target


async def fetch_bundle(link, ref: dict, public_key,
                       serials: dict[str, int] | None = None) -> tuple[object, threading.Lock]:
    """(BundleClient, its lock) of the bundle `ref` names, downloaded by hash and verified with
    the pinned `public_key`; BundleError if it is not that key's bundle. `serials`: the device's
    own record {key hex: highest bundle_serial accepted}; a bundle below it is refused (before
    any listed file is fetched) and an accepted one raises it."""
    from dpfleet.edge.device_client import BundleClient

    key = load_public_key(public_key)
    floor = None if serials is None else serials.get(public_key_hex(key))
    if ref is None:
        raise BundleError("the assignment names no bundle (is the coordinator's [fleet] client "
                          "'bundle'?): a device pinning a bundle key trains with nothing else")
    try:
        manifest_sha, signature_sha = str(ref["manifest_sha256"]), str(ref["signature_sha256"])
    except (KeyError, TypeError) as exc:
        raise BundleError(f"the assignment's bundle field is malformed ({exc!r})") from exc
    cached = _CACHE.get((manifest_sha, public_key_hex(key)))
    if cached is not None:
        check_serial(cached[0].serial, floor, "the coordinator's bundle")
        return _accepted(cached, key, serials)
    blob, signature = await link.blob(manifest_sha), await link.blob(signature_sha)
    try:  # first the signature: an unsigned manifest never makes the device fetch its files
        key.verify(signature, blob)
    except InvalidSignature:
        raise BundleError("the coordinator's bundle is not signed by the pinned bundle key: "
                          "refused before any program was fetched or loaded") from None
    try:
        manifest = json.loads(blob)
        entries = [(name, str(entry["sha256"])) for name, entry in manifest["files"].items()]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BundleError(f"the signed manifest has no usable file list ({exc!r})") from exc
    check_serial(bundle_serial(manifest, "the coordinator's bundle"), floor,
                 "the coordinator's bundle")  # a rollback fetches nothing more
    folder = Path(tempfile.mkdtemp(prefix="bundle-", dir=_root()))
    (folder / MANIFEST).write_bytes(blob)
    (folder / SIGNATURE).write_bytes(signature)
    for name, sha in entries:
        target = _inside(folder, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(await link.blob(sha))
    client = BundleClient(folder, key)  # verify_bundle: signature + every file, before any runtime
    _CACHE[manifest_sha, public_key_hex(key)] = entry = (client, threading.Lock())
    return _accepted(entry, key, serials)


def _accepted(entry: tuple, key, serials: dict[str, int] | None) -> tuple:
    """Record the accepted bundle's serial as the device's new minimum for this key."""
    serial = entry[0].serial
    if serials is not None and serial is not None:
        hexkey = public_key_hex(key)
        serials[hexkey] = max(serial, serials.get(hexkey, serial))
    return entry


def check_plan(client, plan: dict, theta: np.ndarray) -> None:
    """The round's plan must ask for what the signed bundle trains (else the device refuses)."""
    for what, ours, theirs in (("lr", client.lr, plan["lr"]),
                               ("batch_size", client.batch_size, plan["batch_size"]),
                               ("seq_len", client.seq_len, plan["seq_len"]),
                               ("model size", sum(client.sizes), theta.size)):
        if ours != theirs:
            raise BundleError(f"the round's plan says {what} = {theirs}, the signed bundle {ours}")
    if plan["runtime"] not in ("onnx", "executorch"):
        raise BundleError(f"the bundle trains with onnx or executorch, not {plan['runtime']!r}")


def train_update(client, plan: dict, theta: np.ndarray, examples: np.ndarray) -> ClientUpdate:
    """One local epoch from the round's theta with the plan's seed (the `simulation.train_plan`
    rule), clipped with the manifest's rule to the round's bound (adaptive clipping moves it)."""
    delta = client.train_epoch(theta, examples, seed=int(plan["client_seed"]), runtime=plan["runtime"])
    clip_norm = float(plan["clip_norm"])
    clipped, norm = client.clip(delta, clip_norm)
    return ClientUpdate(clipped, norm, norm > clip_norm, client.last_loss, len(examples))


def pinned_bundle_key(cfg, path: Path | None) -> bytes | None:
    """The raw 32-byte bundle key `fleet emulate --bundle-key FILE` pins (None: dpfleet's trainer)."""
    if cfg.fleet.client != "bundle":
        if path is not None:
            raise BundleError("--bundle-key is for [fleet] client = 'bundle'; this config trains "
                              "with dpfleet's own runtime")
        return None
    if path is None:
        raise BundleError("[fleet] client = 'bundle' needs --bundle-key FILE (the coordinator's "
                          "STATE/bundle_key.pub, got out of band)")
    key = load_public_key(Path(path))
    return bytes.fromhex(public_key_hex(key))
