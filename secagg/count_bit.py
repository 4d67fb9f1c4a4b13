"""Adaptive clipping's clipped bit as one more coordinate of the vector SecAgg sums.

Why here and not reported on the side: adaptive clipping (`coordinator.adaptive_clipping`) needs
how many of a round's devices had ||delta|| <= C^t, and under secure aggregation the server must
not see any one device's norm or bit. So each device appends b = [||delta|| <= C^t] as one exact
integer after its discretized model part (never rotated, scaled or clipped with it); the masks
cover it like any coordinate, and the unmasked modular sum holds the exact count of the devices
whose update is in the sum (a device is in both or in neither: it is one masked vector). The
coordinator then adds its tree-noised count noise (sigma_b) exactly as for plain aggregation.

What the devices' inputs mean is bound into the setup (`RoundSetup.terms`, in the setup hash
every message carries): the discretizer and the threshold C^t. A server that announced different
thresholds to different devices (say infinity to all but one, to read that one's bit from the
count) gives them different setup hashes, and they cannot take part in the same sum at all. The
vector length, with or without the bit's slot, is in the setup hash already; a device checks it
against the slot it expects (`check_layout`) before it sends anything.
"""

from __future__ import annotations

import numpy as np

from dpfleet.jsonio import SPACED, canonical_sha256
from dpfleet.secagg.encoding import Discretizer
from dpfleet.secagg.errors import ProtocolViolationError
from dpfleet.secagg.params import RoundSetup

TERMS_LABEL = b"dpfleet/secagg/terms/v1"


def input_length(disc: Discretizer, count_threshold: float | None) -> int:
    """The masked vector's length: the model's ring part, plus the bit's slot with a threshold."""
    return disc.padded_length + (count_threshold is not None)


def terms_digest(disc: Discretizer, count_threshold: float | None) -> bytes:
    """SHA-256 of what every input of the round means: the discretizer's parameters and the
    clipped-count threshold (None: no bit). Floats go in as `repr`, which round-trips exactly."""
    terms = {"length": disc.length, "clip_norm": repr(float(disc.clip_norm)), "bits": disc.bits,
             "clients": disc.clients, "seed": disc.seed, "block_size": disc.block_size,
             "count_threshold": None if count_threshold is None else repr(float(count_threshold))}
    return canonical_sha256(terms, TERMS_LABEL, separators=SPACED).digest()  # signed: bytes kept


def check_layout(setup: RoundSetup, disc: Discretizer, count_threshold: float | None,
                 terms: bytes | None = None) -> None:
    """What a device checks before its first message: the announced length is the model part
    plus exactly the slot it will fill, and the setup binds these very terms (`terms`: the ones
    the device computed itself, `round_terms.bind_round` over these and the model and plan it
    received; None: these alone); else `ProtocolViolationError` (the device refuses the round)."""
    want = input_length(disc, count_threshold)
    if setup.length != want:
        raise ProtocolViolationError(
            f"setup announces {setup.length} ring elements, the discretizer and clipped-count "
            f"slot make {want}")
    if setup.terms != (terms_digest(disc, count_threshold) if terms is None else terms):
        raise ProtocolViolationError("setup does not bind this round's discretizer, "
                                     "clipped-count threshold, model and plan")


def append_bit(values: np.ndarray, bit: int) -> np.ndarray:
    """The ring vector with the bit (0 or 1) as its last element."""
    if bit not in (0, 1):
        raise ValueError(f"the clipped bit is 0 or 1, got {bit}")
    out = np.empty(values.size + 1, dtype=values.dtype)
    out[:-1] = values
    out[-1] = bit
    return out


def split_count(total: np.ndarray, model_length: int, summed: int,
                bits: int) -> tuple[np.ndarray, int, bool]:
    """(the model's ring sum, the clipped count, whether the count was out of range).

    Honest devices' bits sum to a count in [0, summed]; anything else (a device that put another
    value in its slot) is mapped into that range, and flagged. The map is the ring distance from
    0, min(raw, 2^bits - raw), capped at `summed`: it moves by at most 1 when the ring value
    moves by 1, also across the wrap. Why not a plain clamp of the unsigned value: a device that
    knows the other bits can put v = -1 - (their sum) in its slot, so the sum is 2^bits - 1
    (clamped to `summed`) with the target's bit 0 and 0 with it 1; one honest bit would then move
    the count by a whole round, not the 1 the count noise is calibrated for (test:
    tests/test_count_slot_attack.py). A malicious device still steers the count anywhere in
    [0, summed] (robustness, not privacy: THREAT_MODEL.md)."""
    if total.size != model_length + 1:
        raise ValueError(f"sum has {total.size} elements, expected {model_length} + 1")
    modulus = 1 << int(bits)
    raw = int(total[-1]) % modulus
    count = min(raw, modulus - raw, summed)
    return total[:model_length], count, count != raw
