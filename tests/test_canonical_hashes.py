"""Persisted, signed or cached hashes keep their exact bytes now that one owner
(`dpfleet.jsonio.canonical_bytes` / `canonical_sha256`) computes them: each golden value below was
computed by the code each site had before (its own `json.dumps(sort_keys=True, ...)`)."""

import hashlib
import json

import pytest

from dpfleet.coordinator.mechanisms.tree import TreeMechanism
from dpfleet.coordinator.state.guarantee import digest
from dpfleet.edge.bundle_format import canonical_json
from dpfleet.export.models import ModelConfig
from dpfleet.jsonio import SPACED, canonical_bytes, canonical_sha256
from dpfleet.public.kd_pretrain import KDTrainConfig
from dpfleet.public.pipeline import cache_key
from dpfleet.public.public_init import _key
from dpfleet.public.topk_cache import manifest_mac
from dpfleet.secagg.count_bit import terms_digest
from dpfleet.secagg.encoding import Discretizer
from dpfleet.secagg.round_terms import bind_round


def test_mechanism_fingerprints_keep_their_bytes():  # config.json's mechanism binding
    assert TreeMechanism().fingerprint() == "105e74179f65069e2ae5d67084085eb039dadae4dfe407424dc3921fdd1c358b"
    assert TreeMechanism("prefix").fingerprint() == \
        "1627bcfb6a9a01cfa6b2c3dc1417262b97c215a0ddc9d99d776b38bd2954cd78"


def test_the_guarantee_digest_keeps_its_bytes():  # release records and the resume point
    assert digest({"rounds": 3, "dp.clip": 0.5, "é": None, "b": [1, 2.5]}) == \
        "dc3abe26b4de60cfa4673ae7495f7a7824302af4893737b7a2f11f5276843549"


def test_signed_bundle_manifests_and_round_terms_keep_their_bytes():  # what devices verify and sign
    assert canonical_json({"b": 1, "a": ["é", 0.1]}) == b'{"a":["\\u00e9",0.1],"b":1}'
    plan = {"lr": 0.1, "seq_len": 8, "model": {"arch": "cifg"}}
    assert bind_round(b"t" * 32, b"m" * 32, plan).hex() == \
        "a2ada14d2cc70a80e732a4f2e9daea859e551285cbc1b32aa7ff502c254d4b46"
    disc = Discretizer(length=10, clip_norm=0.5, bits=16, clients=4, seed=7)
    assert terms_digest(disc, None).hex() == \
        "6f30f0703b489fee1b8d1f67b4247367f82e202e1bbb912e1d461620bb7416dc"
    assert terms_digest(disc, 2.5).hex() == \
        "4bcb848b6647cc466f36f6fc2d66813817ddd896e135cef440e2be6fc83b48af"


def test_cache_keys_and_macs_keep_their_bytes():  # an old cache entry is still a hit
    manifest = {"shard_files": {"0.npz": {"sha256": "cd"}}, "shards": 1}
    assert manifest_mac(b"s" * 32, "ab" * 32, manifest) == \
        "91cf83e44781cf0f987236123cabddef76662e6402e988a6242072a49ecd3552"
    assert cache_key("teacher", {"b": 1, "a": 0.5}, ModelConfig) == "de6f3b183256247d"
    assert _key([[1, 2, 3]], ModelConfig(vocab_size=50), KDTrainConfig(steps=2), ["wikitext2"]) == \
        "dc45d46c71ab17589fea8ac9"


@pytest.mark.parametrize("obj", [{"b": [1, 2.5, None], "a": {"é": "x", "c": True}}, [3, "z", {"y": 0.1}]])
def test_spaced_canonical_bytes_are_json_dumps_sorted(obj):
    """The sites that hashed json.dumps(obj, sort_keys=True) (its default separators) pass SPACED."""
    assert canonical_bytes(obj, separators=SPACED) == json.dumps(obj, sort_keys=True).encode()
    assert canonical_bytes(obj) == json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    assert canonical_sha256(obj, b"label").digest() == \
        hashlib.sha256(b"label" + canonical_bytes(obj)).digest()


def test_canonical_bytes_refuse_what_is_not_json():
    """A NaN would hash as the non-JSON token `NaN` (or collide with null): refused instead."""
    with pytest.raises(ValueError):
        canonical_bytes({"x": float("nan")})
