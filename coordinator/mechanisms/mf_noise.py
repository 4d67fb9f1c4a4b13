"""Matrix-factorization DP-FTRL noise (dp.mechanism "banded" / "blt") in a run: noise, state, accounting.

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

Accounting (`MFAccountant`): rho = sens^2 / (2 z^2) per segment, sens^2 = `mechanisms.sensitivity_
squared` of the strategy over its n rounds for the OBSERVED MinS / MaxP (an upper bound for any
prefix of the rounds; a device seen once has MaxP 1, for which any separation holds); segments
(fresh streams after a crash) add up. The strategy itself is optimised at run start for the
participation the config enforces (`accounted_participation`) and stored in mechanism.json.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from dpfleet.coordinator.accounting.privacy_report import RING_MF_MECHANISM
from dpfleet.coordinator.accounting.run_accountant import RunAccountant
from dpfleet.coordinator.accounting.zcdp import epsilon_from_zcdp, zcdp_from_sensitivity
from dpfleet.coordinator.mechanisms.blt import BandedNoise
from dpfleet.coordinator.mechanisms.mf_sensitivity import gap_from_min_separation, true_max_participations
from dpfleet.coordinator.mechanisms.noise_stream import GaussianNodes
from dpfleet.coordinator.mechanisms.spec import MechanismSpec, optimize_mechanism, sensitivity_squared
from dpfleet.coordinator.state.run_dir import atomic_write
from dpfleet.errors import DpfleetError

MF_DOMAIN = b"mf"  # NodeStream domain of the z_t (separate from the tree's b"gauss")
MF_COUNT_DOMAIN = b"mfcount"  # adaptive clipping's clipped-count z_t (`adaptive_clipping`)
MECHANISM_FILE = "mechanism.json"


def accounted_participation(cfg, min_separation: int) -> tuple[int, int]:
    """(MinS, MaxP) the config enforces, for optimising the strategy.

    Disjoint: each device at most once, so MaxP = 1 and any MinS holds (n - 1: banded may use all
    n bands). Uniform / timer: the coordinator's enforced MinS (`Participation.min_separation`) and
    max_participation, or the most that MinS allows over the rounds when uncapped.
    """
    n = cfg.rounds
    if cfg.participation.mode == "disjoint":
        return n - 1, 1
    gap = gap_from_min_separation(min_separation)
    return min_separation, true_max_participations(n, gap, cfg.participation.max_participation or None)


def run_mechanism(cfg, min_separation: int, run_path: Path, resume: bool) -> tuple[MechanismSpec, dict]:
    """The run's strategy and the participation it was optimised for: optimised and written to
    mechanism.json at a fresh start, read back on resume (the noise must continue with the same C)."""
    path = run_path / MECHANISM_FILE
    if resume and path.is_file():
        saved = json.loads(path.read_text())
        spec = MechanismSpec.from_json(saved["spec"])
        if spec.kind != cfg.dp.mechanism or spec.rounds != cfg.rounds:
            raise DpfleetError(f"{path} holds a {spec.kind} strategy for {spec.rounds} rounds, the "
                               f"config asks for {cfg.dp.mechanism} over {cfg.rounds}")
        return spec, saved["optimised_for"]
    mins, maxp = accounted_participation(cfg, min_separation)
    spec = optimize_mechanism(cfg.dp.mechanism, cfg.rounds, mins, maxp)
    optimised_for = {"min_separation": mins, "max_participation": maxp,
                     "participation": cfg.participation.mode}
    atomic_write(path, json.dumps({"spec": spec.to_json(), "optimised_for": optimised_for}, indent=2))
    return spec, optimised_for


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
        return {"dim": self.dim, "tree_id": self.tree_id, "t": self.t, "nodes": [], "noise": [],
                "mechanism": self.spec.kind}

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


def dense_noise(spec: MechanismSpec, z: np.ndarray) -> np.ndarray:
    """C^{-1} Z by a dense triangular solve (rows of z are z_1..z_T): the reference for the stream."""
    from scipy.linalg import solve_triangular

    t = z.shape[0]
    if spec.kind == "blt":
        c = spec.blt().matrix(t)
    else:
        from dpfleet.coordinator.mechanisms.blt import banded_toeplitz_matrix

        c = banded_toeplitz_matrix(np.asarray(spec.coefficients), t)
    return solve_triangular(c, np.asarray(z, dtype=np.float64), lower=True)


class MFAccountant(RunAccountant):
    """`RunAccountant` with the strategy's sensitivity: segments x sens^2(observed MinS, MaxP)."""

    def __init__(self, spec: MechanismSpec, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.spec = spec

    def segment_sensitivity(self, maxp: int, mins: int | None) -> float:
        if maxp <= 1:  # nobody took part twice: any separation holds (exact banded formula)
            mins = self.spec.rounds - 1
        return sensitivity_squared(self.spec, 0 if mins is None else mins, maxp)

    def _sensitivity(self, rounds: int, maxp: int, mins: int | None, restarts: list[int]) -> float:
        if maxp == 0:
            return 0.0
        return (1 + len(restarts)) * self.segment_sensitivity(maxp, mins)

    def _zcdp(self, s: float) -> float:
        if s == 0:
            return 0.0
        return math.inf if self.noise_multiplier == 0 else zcdp_from_sensitivity(self.noise_multiplier, s)


def mechanism_fields(spec: MechanismSpec, optimised_for: dict) -> dict:
    return {"mechanism": spec.kind, "mechanism_spec": spec.to_json(),
            "mechanism_optimised_for": optimised_for}


def mf_privacy(run_dir: Path, cfg, accountant: MFAccountant, optimised_for: dict, privacy: dict) -> dict:
    """privacy.json's fields and privacy_report.md for a matrix-factorization run, replacing the
    tree's figures `write_run_privacy` computed (everything else of `privacy` is kept)."""
    spec, delta, z = accountant.spec, cfg.dp.delta, cfg.dp.noise_multiplier
    privacy = {**privacy, **mechanism_fields(spec, optimised_for)}
    privacy["accounting"] = (f"rho-zCDP of {spec.kind} matrix-factorization DP-FTRL: rho = sens^2 / "
                             "(2 z^2), sens^2 the worst case over every participation pattern with the "
                             "observed MinS / MaxP (zero-out, device level), summed over noise segments; "
                             "epsilon by PLD, epsilon_rdp by RDP")
    if privacy.get("noise_kind") == "discrete":  # `mf_ring`: rounded in the ring, ring units
        privacy["noise_mechanism"] = RING_MF_MECHANISM
        privacy["accounting"] += ("; in the SecAgg ring: sens in units of one device's ring L2 bound "
                                  "Delta_s, noise sigma >= z Delta_s, rounded to integers and reduced "
                                  "mod 2^bits (post-processing of the continuous Gaussian)")
    if cfg.dp.adaptive_clipping:  # `adaptive_clipping`: counts on the same strategy, C_t per round
        privacy["accounting"] += ("; adaptive clipping: each round's sum normalised by its clip norm "
                                  "C_t (chosen from earlier releases), model noise z_delta and clipped-"
                                  "count noise 2 sigma_b on the same strategy: one MF mechanism of "
                                  "multiplier z (1 / z^2 = 1 / z_delta^2 + 1 / (2 sigma_b)^2)")
    privacy["tree_sensitivity_squared_not_used"] = privacy.pop("sensitivity_squared", None)
    privacy.pop("worst_device", None)
    segments = 1 + len(accountant.restarts)
    if accountant.rounds and z > 0:
        s = accountant._sensitivity(accountant.rounds, accountant.max_participation,
                                    accountant.min_separation, accountant.restarts)
        rho = zcdp_from_sensitivity(z, s)
        mins, maxp = optimised_for["min_separation"], optimised_for["max_participation"]
        s_cfg = segments * sensitivity_squared(spec, mins, maxp)
        rho_cfg = zcdp_from_sensitivity(z, s_cfg)
        privacy.update(zcdp=rho, epsilon=epsilon_from_zcdp(rho, delta, "pld"),
                       epsilon_rdp=epsilon_from_zcdp(rho, delta, "rdp"), sensitivity_squared=s,
                       noise_segments=segments,
                       timer_worst_case={"rounds": cfg.rounds, "min_separation": mins,
                                         "max_participation": maxp, "sensitivity_squared": s_cfg,
                                         "zcdp": rho_cfg,
                                         "epsilon": epsilon_from_zcdp(rho_cfg, delta, "pld")})
        atomic_write(run_dir / "privacy_report.md", _report(cfg, privacy, spec))
    return privacy


def _ring_lines(p: dict) -> list[str]:
    """With secure aggregation: where the noise went and in which units (`mf_ring`)."""
    ring = p.get("ring")
    if not ring or p.get("noise_kind") != "discrete":
        return []
    return [f"In the SecAgg ring ({ring['bits']} bits, scale {ring['scale']:.6g}): round t's ring sum "
            f"gets round_half_up(sigma (C^-1 z)_t) with sigma^2 = {ring['sigma_sq']} >= (z Delta_s)^2, "
            f"Delta_s = {ring['delta_s']:.6g} one device's ring L2 bound, before decoding, so a "
            "co-participant parking the sum at the ring's wrap gains nothing (rounding, the modular "
            "reduction and decoding are post-processing of the continuous MF Gaussian).", ""]


def _report(cfg, p: dict, spec: MechanismSpec) -> str:
    params = (f"{spec.bands} bands, coefficients {', '.join(f'{c:.4g}' for c in spec.coefficients)}"
              if spec.kind == "banded" else
              f"{len(spec.theta)} buffers, theta {', '.join(f'{t:.6g}' for t in spec.theta)}, "
              f"omega {', '.join(f'{w:.4g}' for w in spec.omega)}")
    name = {"banded": "banded matrix factorization (BandMF, Choquette-Choo et al. 2023)",
            "blt": "buffered linear Toeplitz matrix factorization (BLT, McMahan et al. 2024)"}[spec.kind]
    opt, worst = p["mechanism_optimised_for"], p["timer_worst_case"]
    lines = [
        "# Privacy report", "",
        f"**Noise: {p['noise_mechanism']}, correlated by {name}.**", "",
        f"**Formal statement.** This training run satisfies rho-zCDP with rho = {p['zcdp']:.4g} "
        f"(device-level, zero-out adjacency; from observed participation), hence (eps, delta)-DP "
        f"with eps = {p['epsilon']:.4g} at delta = {cfg.dp.delta:g}.", "",
        "## Mechanism", "",
        f"DP-FTRL with the matrix mechanism: round t's sum gets (C^-1 z)_t, z_t ~ N(0, (z C)^2 I) "
        f"from the secret noise key, so the released prefix sums are A x + B z with A = B C. "
        f"Strategy C over {spec.rounds} rounds: {params}. Optimised for MinS {opt['min_separation']} "
        f"/ MaxP {opt['max_participation']} ({opt['participation']} participation). "
        f"Noise segments: {p['noise_segments']} (a crash that lost released rounds starts a fresh "
        "one; their zCDP adds).", "",
        *_ring_lines(p),
        "## Accounting", "",
        "rho = sens^2 / (2 z^2) per segment, sens^2 = max over participation patterns with the "
        "observed MinS / MaxP of ||C u||^2 (min-separation sensitivity: exact banded column-norm DP, "
        "or the Toeplitz theorem for non-increasing coefficients, else an upper bound); eps by "
        "PLD of the Gaussian mechanism.", "",
        "| | observed | enforced by the config |", "|---|---|---|",
        f"| rounds | {p['rounds']} | {worst['rounds']} |",
        f"| MinS | {'n/a' if p['min_separation'] is None else p['min_separation']} | "
        f"{worst['min_separation']} |",
        f"| MaxP | {p['max_participation']} | {worst['max_participation']} |",
        f"| sensitivity^2 (C^2) | {p['sensitivity_squared']:.6g} | {worst['sensitivity_squared']:.6g} |",
        f"| zCDP rho | {p['zcdp']:.4g} | {worst['zcdp']:.4g} |",
        f"| eps at delta = {cfg.dp.delta:g} | {p['epsilon']:.4g} | {worst['epsilon']:.4g} |", "",
        "## Parameters", "", "| parameter | value |", "|---|---|",
        f"| mechanism | {spec.kind} |",
        f"| noise multiplier z | {cfg.dp.noise_multiplier:g} |",
        f"| clip norm | {cfg.dp.clip_norm:g}"
        + (" initial; adaptive: the quantile estimate, every round |" if cfg.dp.adaptive_clipping else " |"),
        f"| report goal | {cfg.dp.report_goal} |", "",
    ]
    if p.get("not_covered"):
        lines += ["## Not covered by the guarantee", "", *[f"- {x}" for x in p["not_covered"]], ""]
    opening = [f"**{p['noise']}**", ""] if cfg.dp.noise_seed >= 0 else []
    if p.get("generated_population"):
        opening += [f"**{p['generated_population']['statement']}**", ""]
    return "\n".join(opening + lines)
