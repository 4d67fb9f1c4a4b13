"""Secure aggregation: sans-I/O pairwise-mask protocol, crypto, encoding.

Bonawitz et al. 2017 (pairwise + self masks, Shamir-shared keys, dropout recovery, optional
signatures and consistency round), the SecAgg+ sparse graph of Bell et al. 2020, and the
discretization of Kairouz, Liu and Steinke 2021 that lets DP-FTRL sum real vectors in Z_(2^b).

- `crypto`: X25519 + HKDF, AES-GCM shares, Shamir over GF(2^31 - 1), AES-CTR mask PRG
- `messages`: typed messages, versioned strict binary encoding, Ed25519 envelope signatures
- `graph`: complete / Harary masking graphs and the derivation of k and t
- `params`: what all parties agree on for a round (`RoundSetup`, its `setup_hash`,
  `plan_round`) and the commit-and-reveal graph seed
- `policy`: what a device insists on before it takes part (`ClientPolicy`, pinned keys)
- `fleet`: an emulated fleet's identity keys in a key file the coordinator cannot rewrite
- `client`, `server`: the two state machines (bytes in, addressed bytes out)
- `inprocess`: one round with every party in this process, dropouts and message tampering
- `encoding`: rotation, scaling, conditional rounding, element-wise clip, Z_(2^b) and back
- `aggregator`: `SecAggAggregator`, the round engine's `Aggregator`
- `round_sum`: a round's sum for `simulate` and the service alike (plain sum; SecAgg decode,
  clipped-count split and the `aggregation` record); `sums`: what an aggregation returns
- `bench`, `cli`: `dpfleet secagg bench`
- `errors`: one exception class per reason a message is refused

THREAT_MODEL.md says what each mode (signed / unsigned) resists and what it does not.
"""
