"""What a SecAgg round's inputs were computed from, bound into its setup: the model and the plan.

Why: a server can hand one device a crafted model and the others the honest one (or the
reverse) and read that device's update out of an aggregate it is summed into (model
inconsistency, Pasquini, Francati and Ateniese, CCS 2022). Nothing in the masks stops it: they
hide inputs, not what the inputs were computed from. So each device hashes the model bytes it
actually received (SHA-256 of the downloaded blob, never the server's claim alone) and the part
of its plan every device of the attempt shares (round, attempt, clip bound, lr, batch size,
model config, runtime, tokenizer, noise kind: `shared_plan`), and folds both with the inputs'
terms (`count_bit.terms_digest`: discretizer and clipped-count threshold) into the
`RoundSetup.terms` it checks before its first message. The terms are in the setup hash, which is
every message's header context, the commitments' and HKDF's context, the shares' AAD and the
signed prefix: devices that received different models or plans hold different setup hashes and
cannot take part in one sum (THREAT_MODEL.md, "Model consistency").
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from dpfleet.jsonio import canonical_bytes

LABEL = b"dpfleet/secagg/round-terms/v1"
# plan fields that differ from device to device by design (its identity and training seed)
PER_DEVICE = frozenset({"device_id", "client_seed"})


def shared_plan(plan: Mapping[str, object]) -> dict:
    """The plan without its per-device fields: what every device of one attempt must agree on."""
    return {k: v for k, v in plan.items() if k not in PER_DEVICE}


def model_digest(model: bytes) -> bytes:
    """SHA-256 of the model's bytes, computed by whoever holds them."""
    return hashlib.sha256(model).digest()


def bind_round(inputs_terms: bytes, model_sha256: bytes, plan: Mapping[str, object]) -> bytes:
    """The 32-byte `RoundSetup.terms` of a round whose inputs mean `inputs_terms`, trained from
    the model with SHA-256 `model_sha256` (32 raw bytes) under `plan` (its per-device fields are
    left out). The plan goes in as canonical JSON: keys sorted, floats as `repr` (exact)."""
    if len(model_sha256) != 32:
        raise ValueError("model_sha256 must be the 32-byte SHA-256 digest of the model's bytes")
    digest = hashlib.sha256(LABEL)
    for part in (inputs_terms, model_sha256, canonical_bytes(shared_plan(plan))):
        digest.update(len(part).to_bytes(8, "little") + part)
    return digest.digest()
