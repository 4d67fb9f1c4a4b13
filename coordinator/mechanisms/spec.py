"""DP-FTRL noise mechanisms as one choice: the online tree, banded and BLT matrix factorization.

A `MechanismSpec` is everything needed to regenerate a mechanism's noise and to account it:
the kind, the rounds n it was built for and its strategy C (banded: the Toeplitz band
coefficients; BLT: buffer decays theta and output scales omega; see `coordinator/mechanisms/blt.py`).
Accounting is one Gaussian mechanism in every case, rho = sens^2 / (2 z^2), with sens^2 the
worst case over the participation the timers enforce: min separation MinS (dpfleet's
convention, rounds strictly between; the literature's gap b = MinS + 1) and at most MaxP
participations. The tree's sens^2 is `tree_sensitivity_squared` (nodes "all", as the accountant),
the others `mf_sensitivity`'s min-sep formulas (exact, or an upper bound where their assumptions
fail). Callers must pass the MinS the run ENFORCES: a larger one understates the sensitivity.

Noise on the model: round t's released prefix sum carries noise of std z * C * ||B_t||, with B the
prefix-sum decoder (tree: popcount(t) node noises). `noise_factor` is the worst round's ||B_t||
relative to the tree's at EQUAL noise multiplier, so z * noise_factor compares mechanisms'
model noise; `relative_noise` folds in each mechanism's z at equal zCDP (the sqrt(loss ratio) of
`mf_optimize`, independent of rho).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.signal import lfilter

from dpfleet.coordinator.mechanisms.base import ADJACENCY
from dpfleet.coordinator.mechanisms.blt import BLT, prefix_error_per_round, tree_prefix_error_per_round
from dpfleet.coordinator.mechanisms.mf_optimize import (
    banded_sensitivity_squared_toeplitz,
    blt_inverse_coefs,
    optimize_banded,
    optimize_blt,
)
from dpfleet.coordinator.mechanisms.mf_sensitivity import (
    gap_from_min_separation,
    toeplitz_minsep_sensitivity_squared,
    true_max_participations,
)
from dpfleet.coordinator.mechanisms.tree_sensitivity import check_int, tree_sensitivity_squared
from dpfleet.errors import DpfleetError

MECHANISMS = ("tree", "banded", "blt")
DESCRIPTIONS = {
    "tree": "online binary tree (Kairouz et al. 2021): log2(n) node noises per prefix sum;\n"
            "no optimisation, exact sensitivity by dynamic program (today's default).",
    "banded": "banded Toeplitz matrix factorization (BandMF, Choquette-Choo et al. 2023):\n"
              "MinS + 1 bands optimised for (n, MinS, MaxP); memory bands x model.",
    "blt": "buffered linear Toeplitz (McMahan et al. 2024): a few decaying buffers\n"
           "optimised for (n, MinS, MaxP); memory buffers x model, any n.",
}
BLT_BUFFERS = (1, 2, 3, 4)  # the optimiser tries each, keeps the least loss
# banded: at most this many bands (fewer than the separation keeps the sensitivity exact); the
# finite-difference optimiser's cost grows ~ bands^2 (256 bands at n = 1900: 1.4 s, 1 thread)
MAX_BANDS = 256
REDUCTION = "max"  # the worst round's prefix-sum variance: the figure optimised and compared


def _floats(values: object, name: str) -> tuple[float, ...]:
    try:
        out = tuple(float(v) for v in values)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise DpfleetError(f"mechanism {name} must be a list of numbers, got {values!r}") from None
    if not all(math.isfinite(v) for v in out):
        raise DpfleetError(f"mechanism {name} must be finite, got {list(out)}")
    return out


@dataclass(frozen=True)
class MechanismSpec:
    """A noise mechanism for `rounds` rounds; banded/blt carry their optimised strategy."""

    kind: str
    rounds: int
    bands: int = 0
    coefficients: tuple[float, ...] = ()
    theta: tuple[float, ...] = ()
    omega: tuple[float, ...] = ()

    def __post_init__(self):
        if self.kind not in MECHANISMS:
            raise DpfleetError(f"unknown mechanism {self.kind!r}; use one of {', '.join(MECHANISMS)}")
        check_int(self.rounds, "mechanism rounds", 1)
        check_int(self.bands, "mechanism bands", 0)
        for name in ("coefficients", "theta", "omega"):
            object.__setattr__(self, name, _floats(getattr(self, name), name))
        c, theta, omega = self.coefficients, self.theta, self.omega
        if self.kind == "tree" and (self.bands or c or theta or omega):
            raise DpfleetError("a tree mechanism has no bands, coefficients, theta or omega")
        if self.kind == "banded":
            if theta or omega:
                raise DpfleetError("a banded mechanism has no theta/omega")
            if not 1 <= self.bands <= self.rounds or len(c) != self.bands:
                raise DpfleetError(f"a banded mechanism needs 1 <= bands <= rounds ({self.rounds}) "
                                   f"and one coefficient per band, got bands {self.bands} and "
                                   f"{len(c)} coefficients")
            if c[0] == 0:
                raise DpfleetError("banded coefficient 0 (the diagonal) must be nonzero")
        if self.kind == "blt":
            if self.bands or c:
                raise DpfleetError("a BLT mechanism has no bands/coefficients")
            if not theta or len(theta) != len(omega):
                raise DpfleetError(f"a BLT needs theta and omega of one length >= 1, got "
                                   f"{len(theta)} and {len(omega)}")
            if not all(0 < t < 1 for t in theta) or not all(w > 0 for w in omega):
                raise DpfleetError("a BLT needs decays theta in (0, 1) and output scales omega > 0")

    def to_json(self) -> dict:
        out: dict = {"kind": self.kind, "rounds": self.rounds}
        if self.kind == "banded":
            out.update(bands=self.bands, coefficients=list(self.coefficients))
        elif self.kind == "blt":
            out.update(theta=list(self.theta), omega=list(self.omega))
        return out

    @classmethod
    def from_json(cls, d: dict) -> MechanismSpec:
        if not isinstance(d, dict) or "kind" not in d or "rounds" not in d:
            raise DpfleetError(f"a mechanism needs 'kind' and 'rounds', got {d!r}")
        unknown = set(d) - {"kind", "rounds", "bands", "coefficients", "theta", "omega"}
        if unknown:
            raise DpfleetError(f"unknown mechanism keys: {', '.join(sorted(unknown))}")
        return cls(**d)

    def blt(self) -> BLT:
        return BLT(np.asarray(self.theta), np.asarray(self.omega))


def _participation(rounds: int, min_separation: int | None,
                   max_participation: int | None) -> tuple[int, int]:
    """(gap b, k): b = MinS + 1 (None -> 1), k = MaxP (None -> the most b allows), capped."""
    gap = gap_from_min_separation(0 if min_separation is None else min_separation)
    k = None if max_participation is None else check_int(max_participation, "max_participation", 1)
    return gap, true_max_participations(rounds, gap, k)


@functools.lru_cache(maxsize=128)
def optimize_mechanism(kind: str, rounds: int, min_separation: int,
                       max_participation: int | None) -> MechanismSpec:
    """The mechanism of `kind` optimised for (n, MinS, MaxP) (deterministic; cached).

    banded: min(MinS + 1, n, MAX_BANDS) bands. With MaxP 1 any separation holds, so both are
    optimised for single participation (banded: min(n, MAX_BANDS) bands).
    """
    if kind not in MECHANISMS:
        raise DpfleetError(f"unknown mechanism {kind!r}; use one of {', '.join(MECHANISMS)}")
    rounds = check_int(rounds, "rounds", 1)
    gap, k = _participation(rounds, min_separation, max_participation)
    if k == 1:
        gap = rounds
    if kind == "tree":
        return MechanismSpec("tree", rounds)
    if kind == "banded":
        coef = optimize_banded(rounds, gap, k, bands=min(gap, MAX_BANDS),
                               reduction=REDUCTION).params["coef"]
        return MechanismSpec("banded", rounds, bands=len(coef), coefficients=tuple(coef))
    best = min((optimize_blt(rounds, gap, k, buffers=d, reduction=REDUCTION) for d in BLT_BUFFERS),
               key=lambda r: r.loss)
    return MechanismSpec("blt", rounds, theta=tuple(best.params["theta"]),
                         omega=tuple(best.params["omega"]))


def _check_spec(spec: object) -> MechanismSpec:
    if not isinstance(spec, MechanismSpec):
        raise DpfleetError(f"expected a MechanismSpec, got {type(spec).__name__}")
    return spec


def sensitivity_squared(spec: MechanismSpec, min_separation: int | None,
                        max_participation: int | None, *, restarts: Sequence[int] | None = None,
                        adjacency: str = "zero-out") -> float:
    """Worst-case sens^2 (clip-norm units) under MinS / MaxP, on the tree's scale.

    MinS None = 0 (consecutive rounds allowed); MaxP None = the most MinS allows. `restarts`
    (fresh trees) exist only for the tree.
    """
    spec = _check_spec(spec)
    if adjacency not in ADJACENCY:
        raise DpfleetError(f"unknown adjacency {adjacency!r}; use one of {', '.join(ADJACENCY)}")
    n = spec.rounds
    gap, k = _participation(n, min_separation, max_participation)
    if spec.kind == "tree":  # TreeMechanism().sensitivity_squared (nodes "all"), without the class
        s = float(tree_sensitivity_squared(n, k, gap - 1, list(restarts or []), nodes="all"))
    else:
        if restarts:
            raise DpfleetError(f"restarts are a tree feature; the {spec.kind} mechanism has none")
        # one participation: any separation holds, and the exact formulas need gap >= bands
        s = _mf_sensitivity_squared(spec, n if k == 1 else gap, k)
    return s * ADJACENCY[adjacency]


@functools.lru_cache(maxsize=256)
def _mf_sensitivity_squared(spec: MechanismSpec, gap: int, k: int) -> float:
    if spec.kind == "banded":  # exact if bands <= gap, else the Toeplitz majorant (upper) bound
        return banded_sensitivity_squared_toeplitz(np.asarray(spec.coefficients), spec.rounds, gap, k)
    return toeplitz_minsep_sensitivity_squared(spec.blt().coefs(spec.rounds), spec.rounds, gap, k)


@functools.lru_cache(maxsize=256)
def prefix_error(spec: MechanismSpec) -> float:
    """The worst round's prefix-sum noise variance at unit noise multiplier (||B_t||^2 max)."""
    n = spec.rounds
    if spec.kind == "tree":
        err = tree_prefix_error_per_round(n)
    elif spec.kind == "banded":
        err = prefix_error_per_round(lfilter([1.0], np.asarray(spec.coefficients), np.eye(1, n)[0]))
    else:
        err = prefix_error_per_round(blt_inverse_coefs(spec.blt(), n))
    value = float(err.max())
    if not math.isfinite(value):
        raise DpfleetError(f"the {spec.kind} strategy is numerically unstable over {n} rounds")
    return value


def noise_factor(spec: MechanismSpec) -> float:
    """Model noise std relative to the tree's at EQUAL noise multiplier (tree: 1).

    The std on the worst round's prefix sum is z * C * sqrt(prefix_error); compare mechanisms
    at equal epsilon by z_needed * noise_factor (see `relative_noise`).
    """
    spec = _check_spec(spec)
    return math.sqrt(prefix_error(spec) / prefix_error(MechanismSpec("tree", spec.rounds)))


def relative_noise(spec: MechanismSpec, min_separation: int | None,
                   max_participation: int | None) -> float:
    """Model noise std relative to the tree's at EQUAL zCDP: sqrt(loss / tree loss), any rho."""
    tree = MechanismSpec("tree", spec.rounds)
    ratio = (sensitivity_squared(spec, min_separation, max_participation)
             / sensitivity_squared(tree, min_separation, max_participation))
    return math.sqrt(ratio) * noise_factor(spec)
