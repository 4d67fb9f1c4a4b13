"""Extension points: the four parts of a DP-FTRL run researchers change, as typed protocols.

Pass your own to `dpfleet.simulate(config, client_update=..., clipping=..., noise=...,
participation=...)`. Each protocol has a built-in implementation, and the run (CLI or Python)
calls the same protocol whether the object is built in or yours:

* `LocalUpdate` (the client update: local optimiser, steps). Built in: `LocalSGD`, one epoch of
  plain SGD, through the sequential eager trainer (`edge.runtime.EagerRuntime`); the cohort
  trainer and the exported phone programs are batched / compiled forms of that same loop, used
  only while the built-in one is in place. Yours runs through the sequential eager trainer.
* `ClippingRule` (delta -> clipped delta with L2 norm <= the bound). Built in: `clip_l2`. Both
  trainers clip with the run's rule, and every clipped update is checked before aggregation
  (`check_clipped`): a rule that returns a norm above the bound the accountant assumes is one
  clear error, never a silently voided guarantee.
* `NoiseMechanism` (what noise each round's sum gets, and its accounting). Built in:
  `TreeMechanism` (the online tree) and `MatrixMechanism` (banded / BLT matrix factorization);
  the config's `dp.mechanism` runs them inside the round engine (with ring noise, restarts,
  resume). Yours replaces the noise stream and must declare its accounting (`zcdp`); without a
  declaration privacy.json and privacy_report.md say the run is NOT accounted by dpfleet.
* `ParticipationPolicy` (who of the eligible devices takes part). Built in: `UniformPolicy`,
  `DisjointPolicy` (`participation.mode`). The coordinator's guard still decides who is eligible
  (MinS / MaxP) and checks every choice (`check_selection`); the accountant reads who actually
  took part, so no policy can make the reported epsilon wrong.

Examples of each: `examples/extensions.py` (run by tests/test_extensions.py), shown in
docs/extending.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from dpfleet.coordinator.accounting.run_accountant import RunAccountant
from dpfleet.coordinator.accounting.zcdp import epsilon_from_zcdp
from dpfleet.coordinator.engine.participation import (
    DisjointPolicy,
    Eligible,
    UniformPolicy,
    check_selection,
)
from dpfleet.edge.clipping import clip_l2, norm64
from dpfleet.edge.runtime import LocalSGD
from dpfleet.errors import DpfleetError

__all__ = [
    "ClippingRule", "DisjointPolicy", "Eligible", "LocalSGD", "LocalUpdate", "MatrixMechanism",
    "NoiseMechanism", "NoiseStream", "ParticipationPolicy", "TreeMechanism", "UniformPolicy",
    "check_clipped", "check_selection", "clip_l2",
]


@runtime_checkable
class LocalUpdate(Protocol):
    """One device's local training in a round.

    Called with the module holding the round's model, the user's rows (int64 [n, L + 1]: each row
    is L + 1 token ids, inputs `rows[:, :-1]`, targets `rows[:, 1:]`, PAD = 0 targets unscored),
    the config's `client.lr` / `client.batch_size` and a seed fixed per (round, device). Train the
    module in place; return the mean training loss (it goes to debug_nonprivate.jsonl only). The
    delta (weights after minus before) is then clipped by the run's `ClippingRule`.
    """

    def __call__(self, model: torch.nn.Module, rows: torch.Tensor, *, lr: float, batch_size: int,
                 seed: int) -> float: ...


@runtime_checkable
class ClippingRule(Protocol):
    """Clip one device's delta (flat float32 vector over the model's parameters, in
    `model.parameters()` order) to L2 norm <= `bound`; return (clipped delta, L2 norm before
    clipping). The norm before is adaptive clipping's quantile signal. The accountant assumes
    each device moves the sum by at most `bound` in L2: `check_clipped` enforces it."""

    def __call__(self, delta: np.ndarray, bound: float) -> tuple[np.ndarray, float]: ...


@runtime_checkable
class NoiseStream(Protocol):
    """One noise segment: `next_residual()` is round t's noise vector (float32, the model's size),
    added to round t's sum of clipped deltas before the server optimiser (t = 1, 2, ...)."""

    def next_residual(self) -> np.ndarray: ...


@runtime_checkable
class NoiseMechanism(Protocol):
    """A DP-FTRL noise mechanism and its privacy accounting.

    `stream(dim, std, key)` gives the run's noise: `std` = z * C (times secure aggregation's
    norm inflation), the per-round std of the tree's nodes; `key` is the run's secret 32-byte
    noise key (draw from it, e.g. with `dpfleet.coordinator.mechanisms.noise_stream.GaussianNodes`, so reruns
    get fresh noise and `dp.noise_seed` reproduces it).

    `zcdp(noise_multiplier, rounds, min_separation, max_participation)` declares the rho-zCDP of
    the `rounds` released so far for a device that took part at most `max_participation` times
    with at least `min_separation` rounds strictly between two participations (None: nobody took
    part twice), with each device's contribution bounded by C in L2. Return None when you do not
    account it: the run then says plainly it is NOT accounted by dpfleet. dpfleet converts the
    declared rho to (eps, delta) and stops at `dp.budget_epsilon`; it cannot verify the claim.
    """

    name: str

    def stream(self, dim: int, std: float, key: bytes) -> NoiseStream: ...

    def zcdp(self, noise_multiplier: float, rounds: int, min_separation: int | None,
             max_participation: int) -> float | None: ...


@runtime_checkable
class ParticipationPolicy(Protocol):
    """Choose `count` distinct devices of round `round_idx` from `eligible` (the devices the
    guard allows, ascending; `eligible.count` of them, `eligible.at(positions)` gives them).
    Return their indices. Seed any randomness from the round, so a rerun selects the same."""

    def select(self, round_idx: int, eligible: Eligible, count: int) -> Sequence[int] | np.ndarray: ...


# --- built-in noise mechanisms, as protocol objects ---------------------------------------------

class TreeMechanism:
    """The online binary tree (Kairouz et al. 2021), dpfleet's default, as a `NoiseMechanism`:
    the same nodes from the same key as `dp.mechanism = "tree"` and the accountant's exact
    tree sensitivity (`tree_sensitivity.tree_sensitivity_squared`, no restarts)."""

    name = "tree"

    def stream(self, dim: int, std: float, key: bytes) -> NoiseStream:
        from dpfleet.coordinator.mechanisms.noise_stream import GaussianNodes
        from dpfleet.coordinator.mechanisms.tree_noise import TreeNoise

        return TreeNoise(dim, GaussianNodes(key, std, dim))

    def zcdp(self, noise_multiplier: float, rounds: int, min_separation: int | None,
             max_participation: int) -> float | None:
        from dpfleet.coordinator.accounting.zcdp import zcdp_from_sensitivity
        from dpfleet.coordinator.mechanisms.tree_sensitivity import tree_sensitivity_squared

        if max_participation == 0:
            return 0.0
        s = tree_sensitivity_squared(rounds, max_participation, min_separation)
        return zcdp_from_sensitivity(noise_multiplier, s)


class MatrixMechanism:
    """A banded / BLT matrix-factorization strategy (`mechanisms.MechanismSpec`, e.g. from
    `mechanisms.optimize_mechanism`) as a `NoiseMechanism`: `mf_noise.MFNoise`'s stream and the
    strategy's min-separation sensitivity (`mechanisms.sensitivity_squared`), as the run's
    `MFAccountant` gives for one segment."""

    def __init__(self, spec):
        self.spec, self.name = spec, spec.kind

    def stream(self, dim: int, std: float, key: bytes) -> NoiseStream:
        from dpfleet.coordinator.mechanisms.mf_noise import MFNoise

        return MFNoise(self.spec, dim, key, std)

    def zcdp(self, noise_multiplier: float, rounds: int, min_separation: int | None,
             max_participation: int) -> float | None:
        from dpfleet.coordinator.accounting.zcdp import zcdp_from_sensitivity
        from dpfleet.coordinator.mechanisms.spec import sensitivity_squared

        if max_participation == 0:
            return 0.0
        mins = self.spec.rounds - 1 if max_participation <= 1 else (min_separation or 0)
        return zcdp_from_sensitivity(noise_multiplier, sensitivity_squared(self.spec, mins,
                                                                           max_participation))


# --- the guards -------------------------------------------------------------------------------

def check_clipped(updates: Sequence, bound: float, dim: int, rule: object = None,
                  round_idx: int = 0) -> None:
    """Every clipped delta must be one flat float32 vector of the model's length `dim` (numpy
    would broadcast a `[C]` into every coordinate of the sum: C * sqrt(dim) from one device) with
    L2 norm <= `bound` (float64), the bound the noise is calibrated to: else one `DpfleetError`
    naming the rule and the shape or norm, before the round's sum is formed, so nothing of the
    round is released. Runs for every rule, the built-in one too."""
    name = (getattr(rule, "__qualname__", None) or type(rule).__name__) if rule else "clip_l2"
    for pos, update in enumerate(updates):
        delta = np.asarray(update.delta)
        if delta.dtype != np.float32 or delta.shape != (dim,):
            raise DpfleetError(
                f"round {round_idx + 1}: the clipping rule {name} returned a delta of {delta.dtype} "
                f"and shape {delta.shape} for client {pos} of the round; it must return one flat "
                f"float32 vector of the model's shape ({dim},)")
        norm = norm64(delta)  # the built-in clip's own norm
        if not norm <= bound:  # NaN fails too
            raise DpfleetError(
                f"round {round_idx + 1}: the clipping rule {name} returned a delta of L2 norm "
                f"{norm:.9g} for client {pos} of the round, above the bound {bound:.9g} the noise is "
                "calibrated to (each device must move the sum by at most the bound)")


# --- a caller's noise mechanism in a run --------------------------------------------------------

class _CheckedStream:
    """A caller's stream with what the engine reads of a noise tree (`t`, `tree_id`,
    `state_dict`); every vector is checked (shape, float32-able, finite)."""

    def __init__(self, inner: NoiseStream, dim: int, name: str):
        self.inner, self.dim, self.name = inner, dim, name
        self.t, self.tree_id = 0, 0

    def next_residual(self) -> np.ndarray:
        out = np.asarray(self.inner.next_residual(), dtype=np.float32)
        if out.shape != (self.dim,) or not np.isfinite(out).all():
            raise DpfleetError(f"noise mechanism {self.name}: round {self.t + 1}'s noise must be a finite "
                               f"vector of shape ({self.dim},), got shape {out.shape}")
        self.t += 1
        return out

    def state_dict(self) -> dict:
        """Position only: a custom mechanism's run does not resume (`check_custom_noise`)."""
        return {"dim": self.dim, "tree_id": 0, "t": self.t, "nodes": [], "noise": [],
                "mechanism": f"custom:{self.name}"}


class DeclaredAccountant(RunAccountant):
    """`RunAccountant` whose zCDP is the mechanism's own declaration for the observed MinS / MaxP,
    carried as the Gaussian-equivalent sensitivity 2 z^2 rho (so rho, the budget check and the
    per-round records take the base class's path); inf when the mechanism declares none."""

    def __init__(self, mechanism: NoiseMechanism, *args, **kwargs):
        super().__init__(*args, conversion="rdp", **kwargs)
        self.mechanism = mechanism

    def _sensitivity(self, rounds: int, maxp: int, mins: int | None, restarts: list[int]) -> float:
        if maxp == 0:
            return 0
        rho = self.mechanism.zcdp(self.noise_multiplier, rounds, mins, maxp)
        if rho is None:
            return math.inf
        rho = float(rho)
        if not rho >= 0:
            raise DpfleetError(f"noise mechanism {self.mechanism.name}: zcdp() must be >= 0 or None, "
                               f"got {rho}")
        return 2 * self.noise_multiplier**2 * rho

    def privacy(self, run_dir, cfg, privacy: dict) -> dict:
        """The run's privacy.json figures and report (`custom_noise_privacy`), for the engine's
        finish."""
        return custom_noise_privacy(run_dir, cfg, self, privacy)


def check_custom_noise(cfg, noise: object) -> None:
    """A caller's mechanism runs on the float path of one noise segment: refused with ring noise,
    another `dp.mechanism`, restarts, adaptive clipping, z = 0, and a budget it does not account."""
    from dpfleet.coordinator.config import resolve_noise

    if not isinstance(noise, NoiseMechanism):
        raise DpfleetError(f"noise must be a dpfleet.extensions.NoiseMechanism (name, stream(dim, std, "
                           f"key), zcdp(...)), not {type(noise).__name__}")
    problems = [
        (cfg.dp.mechanism == "tree", f"dp.mechanism = {cfg.dp.mechanism!r} (leave it 'tree')"),
        (resolve_noise(cfg) == "gaussian", "ring noise (with secure aggregation set dp.noise = "
                                           "'gaussian': honest participants only)"),
        (not cfg.dp.restart_rounds and not cfg.dp.adaptive_clipping,
         "tree restarts or adaptive clipping (one noise segment)"),
        (cfg.dp.noise_multiplier > 0, "dp.noise_multiplier = 0"),
        (not getattr(cfg.dp, "target_epsilon", 0), "dp.target_epsilon (the planner knows the "
                                                   "built-in mechanisms only)"),
    ]
    for ok, what in problems:
        if not ok:
            raise DpfleetError(f"a custom noise mechanism ({noise.name}) cannot run with {what}")


def install_noise(engine, noise: NoiseMechanism) -> None:
    """Put a caller's mechanism into a fresh engine: its stream replaces the server's tree (one
    segment: no restart is configured), its declaration the accountant."""
    check_custom_noise(engine.cfg, noise)
    server, cfg = engine.server, engine.cfg
    dim = server.theta.size
    server.tree = _CheckedStream(noise.stream(dim, server.noise_std, server.noise_key), dim, noise.name)
    spent = (engine.vocabulary or {}).get("zcdp", 0)
    engine.accountant = DeclaredAccountant(noise, cfg.dp.noise_multiplier, cfg.dp.delta,
                                           cfg.dp.budget_epsilon, spent_zcdp=spent)
    if cfg.dp.budget_epsilon and engine.accountant._sensitivity(1, 1, None, []) == math.inf:
        raise DpfleetError(f"dp.budget_epsilon needs an accounted mechanism: {noise.name}.zcdp() "
                           "returns None")


def custom_noise_privacy(run_dir, cfg, accountant: DeclaredAccountant, privacy: dict) -> dict:
    """privacy.json's figures and privacy_report.md for a caller's mechanism, replacing the tree's:
    the declared rho converted by RDP (valid for any rho-zCDP mechanism), or, undeclared, a plain
    statement that dpfleet did not account the run."""
    from dpfleet.coordinator.state.run_dir import atomic_write

    mech = accountant.mechanism
    rho = accountant._zcdp(accountant._sensitivity(accountant.rounds, accountant.max_participation,
                                                   accountant.min_separation, []))
    accounted = math.isfinite(rho)
    privacy = {k: v for k, v in privacy.items()
               if k not in ("sensitivity_squared", "worst_device", "timer_worst_case")}
    eps = epsilon_from_zcdp(rho, cfg.dp.delta, "rdp") if accounted else math.inf
    statement = (
        f"This run satisfies rho-zCDP with rho = {rho:.4g} (device-level), hence (eps, delta)-DP with "
        f"eps = {eps:.4g} at delta = {cfg.dp.delta:g}, AS DECLARED by the custom noise mechanism "
        f"{mech.name!r} for the observed MinS / MaxP: dpfleet did not derive this and cannot verify it."
        if accounted else
        f"NOT ACCOUNTED BY DPFLEET: the custom noise mechanism {mech.name!r} declares no privacy "
        "accounting (zcdp() returned None), so this run has no stated guarantee.")
    privacy.update(
        noise_mechanism=f"custom: {mech.name}", accounted_by_dpfleet=False,
        accounting_declared_by_mechanism=accounted, statement=statement,
        accounting=("rho-zCDP declared by the mechanism for the observed MinS / MaxP; epsilon by the "
                    "zCDP -> RDP conversion" if accounted else "none"),
        zcdp=rho, epsilon=eps, epsilon_rdp=eps,
    )
    mins = privacy.get("min_separation")
    lines = ["# Privacy report", "", f"**Formal statement.** {statement}", "",
             "| | observed |", "|---|---|", f"| rounds | {privacy.get('rounds')} |",
             f"| MinS | {'n/a' if mins is None else mins} |",
             f"| MaxP | {privacy.get('max_participation')} |",
             f"| noise multiplier z | {cfg.dp.noise_multiplier:g} |", f"| clip norm | {cfg.dp.clip_norm:g} |",
             f"| report goal | {cfg.dp.report_goal} |", ""]
    if privacy.get("not_covered"):
        lines += ["## Not covered", "", *[f"- {x}" for x in privacy["not_covered"]], ""]
    atomic_write(run_dir / "privacy_report.md", "\n".join(lines))
    return privacy


# --- wiring a run -------------------------------------------------------------------------------

def custom_trainer(cfg, trainer, model_cfg, model: torch.nn.Module, client_update: object = None,
                   clipping: object = None):
    """The round trainer with a caller's `LocalUpdate` / `ClippingRule`: a custom local update
    runs through the sequential eager trainer (the cohort trainer is a batched `LocalSGD` only);
    a clipping rule is set on whichever trainer runs (sequential or cohort). Returns (trainer,
    note for summary.json or None)."""
    from dpfleet.coordinator.engine.backends import SequentialTrainer
    from dpfleet.edge.runtime import EagerRuntime

    note = None
    if client_update is not None:
        if not isinstance(client_update, LocalUpdate):
            raise DpfleetError(f"client_update must be callable as (model, rows, *, lr, batch_size, seed) "
                               f"-> loss, not {type(client_update).__name__}")
        if cfg.client.runtime != "eager" or cfg.backend.kind != "local" or cfg.client.trainer == "cohort":
            raise DpfleetError("a custom client_update trains with client.runtime = 'eager', backend.kind "
                               f"= 'local' and client.trainer 'auto' or 'sequential', not "
                               f"{cfg.client.runtime!r} / {cfg.backend.kind!r} / {cfg.client.trainer!r}")
        import copy

        trainer = SequentialTrainer(EagerRuntime(model_cfg, threads=cfg.client.threads,
                                                 model=copy.deepcopy(model), local_update=client_update))
        note = f"client_update {type(client_update).__qualname__}: the sequential eager trainer"
    if clipping is not None:
        if not isinstance(clipping, ClippingRule):
            raise DpfleetError(f"clipping must be callable as (delta, bound) -> (clipped, norm), not "
                               f"{type(clipping).__name__}")
        if not hasattr(trainer, "clip"):
            raise DpfleetError(f"a custom clipping rule runs with the sequential or cohort trainer, not "
                               f"{trainer.name!r} (backend.kind = 'local')")
        trainer.clip = clipping
    return trainer, note


def install(engine, *, participation: object = None, noise: object = None, resume: bool = False) -> None:
    """Put a caller's `ParticipationPolicy` and `NoiseMechanism` into a run's engine before its
    first round (the guard and the participation log stay the engine's)."""
    if participation is not None:
        if not isinstance(participation, ParticipationPolicy):
            raise DpfleetError(f"participation must have select(round_idx, eligible, count), not "
                               f"{type(participation).__name__}")
        if engine.cfg.participation.mode != "uniform":
            raise DpfleetError("a custom participation policy runs with participation.mode = 'uniform' "
                               f"(its guard's MinS / MaxP apply), not {engine.cfg.participation.mode!r}")
        engine.participation.policy = participation
    if noise is not None:
        if resume:
            raise DpfleetError("a run with a custom noise mechanism cannot be resumed (its stream's "
                               "state is the caller's)")
        install_noise(engine, noise)
