"""An emulated fleet's long-term Ed25519 identity keys, kept out of the coordinator's hands.

Signed mode is only as good as the identity keys the devices trust: they must come from
somewhere the coordinator cannot rewrite. A real fleet pins them in a device registry; an
emulated one keeps them in a fleet key file written once (mode 0600) and read by the emulated
devices, never by the server state machine. Each device pins the public keys from this file
and checks the setup's identity list against them (`policy.ClientPolicy.check`).

File format (JSON): {"version": 1, "keys": {"<client id>": "<32-byte private key, hex>"}}.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dpfleet.errors import DpfleetError
from dpfleet.io import write_secret

VERSION = 1


def create_fleet_file(path: Path, clients: int) -> dict[int, Ed25519PrivateKey]:
    """Generate identity keys for `clients` devices and write them to `path` (refuses to
    overwrite: replacing a fleet's keys is exactly what must not happen silently)."""
    path = Path(path)
    if path.exists():
        raise DpfleetError(f"fleet key file {path} already exists; not overwriting it")
    keys = {u: Ed25519PrivateKey.generate() for u in range(clients)}
    payload = {"version": VERSION,
               "keys": {str(u): k.private_bytes_raw().hex() for u, k in keys.items()}}
    write_secret(path, json.dumps(payload).encode())
    return keys


def load_fleet_file(path: Path) -> dict[int, Ed25519PrivateKey]:
    """The devices' identity keys from a fleet key file; a clear error for a bad file."""
    path = Path(path)
    try:
        payload = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise DpfleetError(f"fleet key file {path} not found") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DpfleetError(f"fleet key file {path} is not readable JSON: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("version") != VERSION or not isinstance(
            payload.get("keys"), dict):
        raise DpfleetError(f"fleet key file {path}: expected {{'version': {VERSION}, 'keys': "
                           f"{{id: hex}}}}")
    keys = {}
    for client, value in payload["keys"].items():
        try:
            keys[int(client)] = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(value))
        except (ValueError, TypeError) as exc:
            raise DpfleetError(f"fleet key file {path}: bad key for client {client!r}") from exc
    if sorted(keys) != list(range(len(keys))):
        raise DpfleetError(f"fleet key file {path}: client ids must be 0..{len(keys) - 1}")
    return keys


def pinned_keys(keys: Mapping[int, Ed25519PrivateKey]) -> Mapping[int, bytes]:
    """The read-only public-key map a device pins."""
    return MappingProxyType({u: k.public_key().public_bytes_raw() for u, k in keys.items()})
