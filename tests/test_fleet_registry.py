"""The fleet key file (fleet/emulate.py) and the public registry the coordinator is given."""

from __future__ import annotations

import json
import stat

import pytest

from dpfleet.errors import DpfleetError
from dpfleet.fleet.emulate import fleet_keys
from dpfleet.secagg.registry import load_public_registry, public_registry, write_public_registry


def test_keys_created_once_then_reused_and_public_halves_only(tmp_path):
    path = tmp_path / "fleet_keys.json"
    keys = fleet_keys(path, 5)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = fleet_keys(path, 3)  # a smaller fleet reuses the first keys
    assert [again[i].private_bytes_raw() for i in range(3)] == [
        keys[i].private_bytes_raw() for i in range(3)]
    with pytest.raises(DpfleetError, match="holds 5 device keys"):
        fleet_keys(path, 6)
    ids = ["alice", "bob", "carol", "dan", "eve"]
    public = tmp_path / "fleet_public.json"
    write_public_registry(public, public_registry(keys, ids))
    text = public.read_text()
    for k in keys.values():  # no private key leaks into what the coordinator reads
        assert k.private_bytes_raw().hex() not in text
    loaded = load_public_registry(public)
    assert loaded == {u: keys[i].public_key().public_bytes_raw() for i, u in enumerate(ids)}


def test_bad_registry_files_are_clear_errors(tmp_path):
    path = tmp_path / "r.json"
    with pytest.raises(DpfleetError, match="not found"):
        load_public_registry(path)
    for payload, match in (("{", "readable JSON"), (json.dumps({"version": 2, "keys": {}}), "expected"),
                           (json.dumps({"version": 1, "keys": {"a": "zz"}}), "bad public key"),
                           (json.dumps({"version": 1, "keys": {"a": "00" * 31}}), "bad public key")):
        path.write_text(payload)
        with pytest.raises(DpfleetError, match=match):
            load_public_registry(path)
