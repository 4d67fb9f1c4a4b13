"""Privacy accounting of DP-FTRL runs: zCDP from the exact tree sensitivity, then (eps, delta).

A DP-FTRL run (with or without tree restarts) is one Gaussian mechanism: its releases are the
noised tree nodes, the L2 sensitivity is sqrt(S) * C (S from `tree_sensitivity`, times 4 under
replace-one adjacency) and the noise std is z * C, so it is rho-zCDP with rho = S / (2 z^2).
`nodes` picks the node set ("all", the published analysis and the default; "prefix", exact and
tighter for the plain streaming tree of `tree_noise`), see `tree_sensitivity`.

(eps, delta) conversions, `method`:
  "pld"         the Gaussian's privacy loss distribution (dp-accounting PLDAccountant), the
                tightest; valid because rho always comes from one Gaussian mechanism here.
                Where the PLD overflows (rho in the hundreds, eps ~ 700), the exact analytic
                Gaussian of that one release (`analytic_gaussian`, Balle & Wang 2018) instead.
                Paper 002 converts this way (Table 2, App. C: zCDP 0.25 -> eps 4.49, 1.86 ->
                13.69 at delta = 1e-10; it converts the zCDP *rounded to two decimals*).
  "rdp"         dp-accounting's RdpAccountant on ZCDpEvent(rho) (RDP of order a is a * rho).
                Paper 000's figures use this (T = 1600, single participation, delta = 1e-6:
                z = 8.83 -> eps 1.77, z = 1.13 -> eps 18.71).
  "zcdp_bound"  rho + 2 sqrt(rho log(1/delta)) (Bun & Steinke 2016, Prop. 1.3), the loosest.

Participation log (`participation.jsonl` in a run directory, written by the round engine): one
JSON object per round, {"round": int (0-based), "devices": [str], "restart": bool (a fresh tree
starts at this round)}. Observed MinS uses the same convention as the accountant: the fewest
rounds strictly between two participations of one device.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import dp_accounting
import numpy as np
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpfleet.coordinator.accounting.analytic_gaussian import analytic_gaussian_epsilon
from dpfleet.coordinator.mechanisms.base import ADJACENCY, Mechanism
from dpfleet.coordinator.mechanisms.tree import TreeMechanism
from dpfleet.coordinator.mechanisms.tree_sensitivity import check_int, normalize_restarts
from dpfleet.errors import DpfleetError

METHODS = ("pld", "rdp", "zcdp_bound")
MIN_SEPARATION_CONVENTION = "rounds strictly between two participations of one device"


# adaptive clipping's split of z (engine/adaptive_clipping.py, Thm. 1): here, with the zCDP it
# adds up (1 / z^2 = 1 / z_delta^2 + 1 / (2 sigma_b)^2 is rho_model + rho_count = rho), so the
# config can check it without the engine
def default_count_stddev(report_goal: int) -> float:
    """sigma_b = m / 20 (paper 002 Alg. 1)."""
    return report_goal / 20.0


def model_noise_multiplier(noise_multiplier: float, count_stddev: float) -> float:
    """z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2): the model's noise so that the whole is z (Thm. 1).

    z = 0 (no DP) gives 0. Raises when sigma_b is too small to leave room: 2 sigma_b <= z.
    """
    z, sigma_b = float(noise_multiplier), float(count_stddev)
    if z < 0 or sigma_b < 0:
        raise DpfleetError("noise multiplier and clipped-count stddev must be >= 0")
    if z == 0:
        return 0.0
    if 2.0 * sigma_b <= z:
        raise DpfleetError(
            f"adaptive clipping needs 2 * clip_count_stddev > noise_multiplier, got sigma_b = "
            f"{sigma_b:g} for z = {z:g}: the clipped counts would use up all of the privacy budget"
        )
    return (z**-2 - (2.0 * sigma_b) ** -2) ** -0.5


def _check_positive(value: float, name: str) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise DpfleetError(f"{name} must be a number, got {value!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise DpfleetError(f"{name} must be a positive finite number, got {value}")
    return value


def _check_delta(delta: float) -> float:
    delta = _check_positive(delta, "delta")
    if delta >= 1:
        raise DpfleetError(f"delta must be in (0, 1), got {delta}")
    return delta


def _check_method(method: str) -> str:
    if method not in METHODS:
        raise DpfleetError(f"unknown accounting method {method!r}; use one of {', '.join(METHODS)}")
    return method


def _adjacency_factor(adjacency: str) -> int:
    if adjacency not in ADJACENCY:
        raise DpfleetError(f"unknown adjacency {adjacency!r}; use one of {', '.join(ADJACENCY)}")
    return ADJACENCY[adjacency]


def zcdp_from_sensitivity(noise_multiplier: float, sensitivity_squared: float) -> float:
    """rho = S / (2 z^2) for a Gaussian mechanism with squared sensitivity S (units of C^2)."""
    z = _check_positive(noise_multiplier, "noise multiplier")
    if sensitivity_squared < 0:
        raise DpfleetError(f"sensitivity must be >= 0, got {sensitivity_squared}")
    if z * z == 0.0:  # 1e-300 squared underflows: rho would divide by zero
        raise DpfleetError(f"noise multiplier {z:g} is too small to account (its square is 0 in floats)")
    return float(sensitivity_squared) / (2.0 * z * z)


def noise_for_zcdp(target_zcdp: float, sensitivity_squared: float) -> float:
    """The noise multiplier z with S / (2 z^2) = target rho."""
    rho = _check_positive(target_zcdp, "target zCDP")
    return math.sqrt(float(sensitivity_squared) / (2.0 * rho))


def zcdp_from_noise(noise_multiplier: float, rounds: int, max_participation: int = 1,
                    min_separation: int | None = None, restarts: Sequence[int] | None = None,
                    *, adjacency: str = "zero-out", nodes: str = "all",
                    mechanism: Mechanism | None = None) -> float:
    """Worst-case rho-zCDP given MaxP and MinS of `mechanism` (default the tree over `nodes`):
    its sensitivity (the mechanism's own) over 2 z^2, the one rule every worst case uses."""
    mechanism = TreeMechanism(nodes) if mechanism is None else mechanism
    s = _worst_sensitivity(mechanism, rounds, max_participation, min_separation,
                           normalize_restarts(int(rounds), restarts), adjacency)
    return zcdp_from_sensitivity(noise_multiplier, s)


def _worst_sensitivity(mechanism: Mechanism, rounds: int, max_participation: int,
                       min_separation: int | None, restarts: Sequence[int], adjacency: str) -> float:
    """The mechanism's sens^2 under MaxP / MinS and restarts, times the adjacency's factor."""
    s = mechanism.sensitivity_squared(rounds, min_separation, max_participation, list(restarts))
    return s * _adjacency_factor(adjacency)


def epsilon_from_zcdp(rho: float, delta: float, method: str = "pld") -> float:
    """eps at `delta` of the Gaussian mechanism that is rho-zCDP (see module docstring)."""
    delta, method = _check_delta(delta), _check_method(method)
    rho = float(rho)
    if not rho >= 0:
        raise DpfleetError(f"zCDP must be >= 0, got {rho}")
    if rho == 0:
        return 0.0
    if math.isinf(rho):
        return math.inf
    if method == "zcdp_bound":
        return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))
    if method == "rdp":
        acc = rdp_privacy_accountant.RdpAccountant()
        acc.compose(dp_accounting.ZCDpEvent(rho))
        return float(acc.get_epsilon(delta))
    # PLD grid step relative to the eps scale (the zCDP bound): the pessimistic rounding it
    # adds is < 1e-4 relative, and the grid size stays bounded for tiny and for huge rho
    scale = epsilon_from_zcdp(rho, delta, "zcdp_bound")
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4 * scale)
    with warnings.catch_warnings():  # the PLD's overflow is handled below
        warnings.simplefilter("ignore", RuntimeWarning)
        acc.compose(dp_accounting.GaussianDpEvent(1.0 / math.sqrt(2.0 * rho)))
        eps = float(acc.get_epsilon(delta))
    return eps if math.isfinite(eps) else analytic_gaussian_epsilon(rho, delta)


def zcdp_for_epsilon(epsilon: float, delta: float, method: str = "pld") -> float:
    """The largest rho whose eps (by `method`) is <= `epsilon` (relative precision 1e-7)."""
    epsilon = _check_positive(epsilon, "target epsilon")
    delta, method = _check_delta(delta), _check_method(method)
    log_inv = math.log(1.0 / delta)
    if method == "zcdp_bound":
        return (math.sqrt(log_inv + epsilon) - math.sqrt(log_inv)) ** 2
    if method == "pld":  # the exact Gaussian calibration lands within ~1e-7 of the PLD answer
        guess = 0.5 / dp_accounting.get_sigma_gaussian(epsilon, delta) ** 2
    else:
        guess = zcdp_for_epsilon(epsilon, delta, "zcdp_bound")
    lo, hi, step = guess, guess, 1e-6
    while epsilon_from_zcdp(lo, delta, method) > epsilon:
        lo, step = lo / (1.0 + step), step * 4
    while epsilon_from_zcdp(hi, delta, method) <= epsilon:
        hi, step = hi * (1.0 + step), step * 4
    while hi / lo - 1.0 > 1e-7:
        mid = math.sqrt(lo * hi)
        if epsilon_from_zcdp(mid, delta, method) <= epsilon:
            lo = mid
        else:
            hi = mid
    return lo


def worst_case_zcdp(noise_multiplier: float, rounds: int, max_participation: int = 1,
                    min_separation: int | None = None,
                    restarts: Sequence[int] | None = None, delta: float = 1e-10,
                    method: str = "pld", *, adjacency: str = "zero-out",
                    nodes: str = "all", mechanism: Mechanism | None = None) -> dict:
    """zCDP of the worst participation pattern allowed by MaxP / MinS, as one dict, for
    `mechanism` (default the tree over `nodes`). Its eps is the ledger's to state
    (`ledger.account_worst_case`): this layer converts nothing it prints."""
    _check_positive(noise_multiplier, "noise multiplier")
    _check_delta(delta), _check_method(method)
    check_int(max_participation, "max_participation", 1)
    mechanism = TreeMechanism(nodes) if mechanism is None else mechanism
    restarts = list(normalize_restarts(int(rounds), restarts))  # MF: fresh segments after a crash
    s = _worst_sensitivity(mechanism, rounds, max_participation, min_separation, restarts, adjacency)
    rho = zcdp_from_sensitivity(noise_multiplier, s)
    return {
        "mechanism": mechanism.name,
        "mechanism_identity": mechanism.identity(),
        "rounds": int(rounds),
        "max_participation": int(max_participation),
        "min_separation": None if min_separation is None else int(min_separation),
        "min_separation_convention": MIN_SEPARATION_CONVENTION,
        "restarts": restarts,
        "noise_segments": 1 + len(restarts),
        "noise_multiplier": float(noise_multiplier),
        "adjacency": adjacency,
        "nodes": getattr(mechanism, "nodes", None),
        "sensitivity_squared": s,
        "zcdp": rho,
        "delta": float(delta),
        "method": method,
    }


@dataclass(frozen=True)
class ObservedParticipation:
    """Who took part when, as read from a participation log."""

    rounds: int  # rounds in the log: 0 .. rounds-1
    restarts: tuple[int, ...]  # rounds (> 0) at which a fresh tree started
    devices: list[str]  # device ids, aligned with `patterns`
    patterns: list[list[int]]  # ascending rounds of each device's participations
    max_participation: int  # observed MaxP (0 when nobody took part)
    min_separation: int | None  # observed MinS; None when no device took part twice


def read_participation_log(path: str | Path) -> list[dict]:
    """The records of a `participation.jsonl` file (one JSON object per line)."""
    path = Path(path)
    if not path.is_file():
        raise DpfleetError(f"participation log {path} does not exist")
    records = []
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DpfleetError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
    return records


def observe_participation(records: Iterable[Mapping]) -> ObservedParticipation:
    """Validate log records (every round 0..n-1 exactly once) and extract MaxP / MinS."""
    by_round: dict[int, Mapping] = {}
    for rec in records:
        if not isinstance(rec, Mapping) or not {"round", "devices"} <= rec.keys():
            raise DpfleetError(f"participation record needs 'round' and 'devices': {rec!r}")
        r, devices = rec["round"], rec["devices"]
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise DpfleetError(f"participation record has a bad round {r!r}")
        if r in by_round:
            raise DpfleetError(f"round {r} appears twice in the participation log")
        if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
            raise DpfleetError(f"round {r}: 'devices' must be a list of string ids")
        if len(set(devices)) != len(devices):
            raise DpfleetError(f"round {r}: a device is listed twice")
        if not isinstance(rec.get("restart", False), bool):
            raise DpfleetError(f"round {r}: 'restart' must be true or false")
        by_round[r] = rec
    if not by_round:
        raise DpfleetError("the participation log is empty")
    rounds = max(by_round) + 1
    if len(by_round) != rounds:
        missing = sorted(set(range(rounds)) - by_round.keys())
        raise DpfleetError(f"the participation log misses rounds {missing[:5]}"
                           f"{' ...' if len(missing) > 5 else ''}")
    patterns: dict[str, list[int]] = {}
    for r in range(rounds):
        for device in by_round[r]["devices"]:
            patterns.setdefault(device, []).append(r)
    gaps = [b - a - 1 for p in patterns.values() for a, b in zip(p, p[1:], strict=False)]
    return ObservedParticipation(
        rounds=rounds,
        restarts=tuple(r for r in range(1, rounds) if by_round[r].get("restart", False)),
        devices=list(patterns),
        patterns=list(patterns.values()),
        max_participation=max((len(p) for p in patterns.values()), default=0),
        min_separation=min(gaps) if gaps else None,
    )


def observe_participation_log(path_or_records: str | Path | Iterable[Mapping],
                              rounds: int | None = None) -> ObservedParticipation:
    """`observe_participation` of a log file (or records), of its first `rounds` rounds if given."""
    records = (read_participation_log(path_or_records)
               if isinstance(path_or_records, str | Path) else list(path_or_records))
    if rounds is not None:
        rounds = check_int(rounds, "rounds", 1)
        logged = observe_participation(records).rounds
        if rounds > logged:
            raise DpfleetError(f"rounds ({rounds}) is more than the log holds ({logged})")
        records = [rec for rec in records if rec["round"] < rounds]
    return observe_participation(records)


def participation_log_zcdp(path_or_records: str | Path | Iterable[Mapping],
                           noise_multiplier: float, delta: float, method: str = "pld", *,
                           rounds: int | None = None, adjacency: str = "zero-out",
                           nodes: str = "all", mechanism: Mechanism | None = None) -> dict:
    """zCDP of a run (or, with `rounds`, the model after its first `rounds` rounds) from its log,
    for `mechanism` (default the tree over `nodes`); the ledger states its eps
    (`ledger.account_participation_log`).

    The headline (`sensitivity_squared`, `zcdp`, `epsilon`) is the worst case over every
    pattern with the observed MaxP and MinS, as paper 002 reports it. `worst_device` (the tree
    only) is the exact figure of the worst participation pattern that actually occurred.
    """
    _check_positive(noise_multiplier, "noise multiplier")
    _check_delta(delta), _check_method(method), _adjacency_factor(adjacency)
    mechanism = TreeMechanism(nodes) if mechanism is None else mechanism
    obs = observe_participation_log(path_or_records, rounds)
    worst = worst_case_zcdp(noise_multiplier, obs.rounds, max(obs.max_participation, 1),
                               obs.min_separation, obs.restarts, delta, method,
                             adjacency=adjacency, mechanism=mechanism)
    worst.update(
        max_participation=obs.max_participation,
        devices=len(obs.devices),
        participations=sum(len(p) for p in obs.patterns),
        worst_device=None,
    )
    if not obs.devices:  # nobody took part: nothing was released about anyone
        worst.update(sensitivity_squared=0, zcdp=0.0)
        return worst
    per_device = getattr(mechanism, "device_sensitivity_squared", None)
    if per_device is None:
        return worst
    per_device = per_device(obs.patterns, obs.rounds, obs.restarts) * _adjacency_factor(adjacency)
    i = int(np.argmax(per_device))
    rho = zcdp_from_sensitivity(noise_multiplier, int(per_device[i]))
    worst["worst_device"] = {
        "device": obs.devices[i],
        "participations": len(obs.patterns[i]),
        "sensitivity_squared": int(per_device[i]),
        "zcdp": rho,
    }
    return worst
