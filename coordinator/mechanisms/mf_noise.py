"""Matrix-factorization DP-FTRL noise (dp.mechanism "banded" / "blt"): the streaming (C^{-1} z)_t.

The server releases per-round values g_t + (C^{-1} z)_t (`MFNoise.next_residual`), so the prefix
sums of what it releases are A g + A C^{-1} z = A g + B z: the matrix mechanism B (C g + z) for the
prefix-sum workload A = B C, exactly as the tree's residuals give the tree-noised prefix sums. Any
server optimizer (momentum) is post-processing of those prefix sums.

Noise: z_t = std * N(0, I) (float32, like the tree's nodes) is the AES-256-CTR keystream of the run's
secret noise key under its own domain `MF_DOMAIN`, at position (segment, t): NodeStream(tree_id =
segment, level 0, index = t). The streaming generator (`blt.BLTNoise`: buffers x dim,
`blt.BandedNoise`: (bands - 1) x dim, float64) turns z_t into (C^{-1} z)_t. Its state is a function of
z_1..z_t of the segment, so a resume point stores only (segment, t) and the key (resume/, 0600,
deleted at finish) and `from_state` rebuilds the state by replaying z_1..z_t: no noise vector is
ever written to disk. A crash that loses released rounds goes on in a fresh segment (a fresh tree id
of the release log), whose positions no release has used.

The mechanism around it (strategy, sensitivity, ring form, accounting) is `matrix.MatrixMechanism`.
"""

from __future__ import annotations

import numpy as np

from dpfleet.coordinator.mechanisms.blt import BandedNoise
from dpfleet.coordinator.mechanisms.noise_stream import GaussianNodes
from dpfleet.coordinator.mechanisms.spec import MechanismSpec
from dpfleet.errors import DpfleetError

MF_DOMAIN = b"mf"  # NodeStream domain of the z_t (separate from the tree's b"gauss")
MF_COUNT_DOMAIN = b"mfcount"  # adaptive clipping's clipped-count z_t (`adaptive_clipping`)


def noise_generator(spec: MechanismSpec, dim: int):
    """The streaming (C^{-1} z)_t generator of a banded or BLT strategy."""
    if spec.kind == "blt":
        return spec.blt().noise(dim)
    if spec.kind == "banded":
        return BandedNoise(np.asarray(spec.coefficients), dim)
    raise DpfleetError(f"the {spec.kind} mechanism has no matrix-factorization noise")


class MFNoise:
    """One segment's correlated noise, with `TreeNoise`'s interface for `DPFTRLServer`
    (`next_residual`, `t`, `tree_id` = the segment, `state_dict` / `from_state`)."""

    def __init__(self, spec: MechanismSpec, dim: int, key: bytes, std: float, segment: int = 0,
                 domain: bytes = MF_DOMAIN):
        self.spec, self.dim, self.tree_id = spec, int(dim), int(segment)
        self.z = GaussianNodes(key, std, self.dim, domain)
        self.stream = noise_generator(spec, self.dim)
        self.t = 0

    def fresh(self, t: int) -> np.ndarray:
        """z_t of this segment (1-based t): std * N(0, I), float32."""
        return self.z(self.tree_id, 0, t)

    def next_exact(self) -> np.ndarray:
        """Round t's noise (C^{-1} z)_t as the stream computes it (float64)."""
        if self.t >= self.spec.rounds:
            raise DpfleetError(f"the {self.spec.kind} strategy covers {self.spec.rounds} rounds")
        self.t += 1
        return self.stream.next(self.fresh(self.t))

    def next_residual(self) -> np.ndarray:
        """Round t's noise (C^{-1} z)_t, float32, to add to round t's sum."""
        return self.next_exact().astype(np.float32)

    def state_dict(self) -> dict:
        """Position only: the state is rebuilt from the key (no noise vector is ever saved)."""
        return {"dim": self.dim, "tree_id": self.tree_id, "t": self.t, "mechanism": self.spec.kind}

    @classmethod
    def from_state(cls, state: dict, spec: MechanismSpec, key: bytes, std: float,
                   domain: bytes = MF_DOMAIN) -> MFNoise:
        if state.get("mechanism") != spec.kind:
            raise DpfleetError(f"the resume point's noise is {state.get('mechanism', 'tree')!r}, the "
                               f"run's mechanism {spec.kind!r}")
        noise = cls(spec, state["dim"], key, std, state["tree_id"], domain)
        for _ in range(int(state["t"])):  # replay z_1..z_t from the key
            noise.next_residual()
        return noise
