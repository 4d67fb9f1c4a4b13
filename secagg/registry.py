"""The fleet's public identity registry: device id -> Ed25519 public key, nothing secret.

It sits with SecAgg (the keys devices pin), below both the service (which reads it) and the
fleet emulator (which writes it): the fleet is a client of the service, never the other way.

Why a separate file from the fleet key file: the coordinator may be told which keys are the
fleet's (`serve --fleet-public`, then only those may register) and the devices pin the same
keys for SecAgg, but nobody except the devices ever needs the private keys.
Format: {"version": 1, "keys": {"<device_id>": "<32-byte public key, hex>"}}.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dpfleet.errors import DpfleetError
from dpfleet.jsonio import write_json

VERSION = 1


def public_registry(keys: Mapping[int, Ed25519PrivateKey], users: Sequence[str]) -> dict[str, bytes]:
    """Device id (train client i's user id) -> public key of fleet key i."""
    if len(keys) < len(users):
        raise DpfleetError(f"the fleet key file holds {len(keys)} keys for {len(users)} devices")
    return {u: keys[i].public_key().public_bytes_raw() for i, u in enumerate(users)}


def write_public_registry(path: Path, registry: Mapping[str, bytes]) -> None:
    write_json(Path(path), {"version": VERSION, "keys": {d: k.hex() for d, k in registry.items()}}, indent=1)


def load_public_registry(path: Path) -> dict[str, bytes]:
    """The registry, or one clear DpfleetError for a missing or malformed file."""
    path = Path(path)
    try:
        payload = json.loads(path.read_text())
    except FileNotFoundError:
        raise DpfleetError(f"fleet registry {path} not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DpfleetError(f"fleet registry {path} is not readable JSON: {exc}") from None
    if not isinstance(payload, dict) or payload.get("version") != VERSION or not isinstance(
            payload.get("keys"), dict):
        raise DpfleetError(f"fleet registry {path}: expected {{'version': 1, 'keys': {{id: hex}}}}")
    out = {}
    for device, value in payload["keys"].items():
        try:
            key = bytes.fromhex(value)
        except (ValueError, TypeError):
            key = b""
        if len(key) != 32:
            raise DpfleetError(f"fleet registry {path}: bad public key for device {device!r}")
        out[str(device)] = key
    return out
