"""The fleet's public key registry: what the coordinator may know about the devices' identities.

Why a separate file: the fleet key file holds the devices' PRIVATE identity keys (mode 0600, read
only by the emulated devices). The coordinator must not read it, yet it must know which keys may
register (`serve --fleet-public FILE`), so the fleet writes the public halves next to it, keyed
by device id (the train client's user id). Format (contract):
{"version": 1, "keys": {"<device_id>": "<32-byte Ed25519 public key, hex>"}}.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dpfleet.coordinator.run_dir import atomic_write
from dpfleet.errors import DpfleetError
from dpfleet.secagg.fleet import create_fleet_file, load_fleet_file

VERSION = 1


def fleet_keys(path: Path, devices: int) -> dict[int, Ed25519PrivateKey]:
    """The identity keys of devices 0..devices-1: read from `path`, or created there if absent."""
    path = Path(path)
    keys = load_fleet_file(path) if path.exists() else create_fleet_file(path, devices)
    if len(keys) < devices:
        raise DpfleetError(f"fleet key file {path} holds {len(keys)} device keys but the fleet has "
                           f"{devices} devices; use a new --fleet-keys file")
    return {i: keys[i] for i in range(devices)}


def public_registry(keys: Mapping[int, Ed25519PrivateKey], device_ids: Sequence[str]) -> dict:
    """{"version", "keys": {device_id: public hex}} for devices 0..len(device_ids)-1."""
    if len(set(device_ids)) != len(device_ids):
        raise DpfleetError("device ids must be unique")
    return {"version": VERSION, "keys": {
        device_id: keys[i].public_key().public_bytes_raw().hex()
        for i, device_id in enumerate(device_ids)}}


def write_public_registry(path: Path, keys: Mapping[int, Ed25519PrivateKey],
                          device_ids: Sequence[str]) -> Path:
    path = Path(path)
    atomic_write(path, json.dumps(public_registry(keys, device_ids), indent=1))
    return path


def load_public_registry(path: Path) -> dict[str, bytes]:
    """device_id -> 32-byte Ed25519 public key; one clear DpfleetError for a bad file."""
    path = Path(path)
    try:
        payload = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise DpfleetError(f"fleet public registry {path} not found") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DpfleetError(f"fleet public registry {path} is not readable JSON: {exc}") from exc
    if not (isinstance(payload, dict) and payload.get("version") == VERSION
            and isinstance(payload.get("keys"), dict)):
        raise DpfleetError(f"fleet public registry {path}: expected {{'version': {VERSION}, "
                           "'keys': {device_id: public key hex}}")
    out = {}
    for device_id, value in payload["keys"].items():
        try:
            key = bytes.fromhex(value)
        except (ValueError, TypeError) as exc:
            raise DpfleetError(f"fleet public registry {path}: bad key for {device_id!r}") from exc
        if len(key) != 32:
            raise DpfleetError(f"fleet public registry {path}: key for {device_id!r} is not 32 bytes")
        out[device_id] = key
    return out
