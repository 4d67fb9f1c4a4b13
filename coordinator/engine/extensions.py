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
* `Mechanism` (what noise each round's sum gets, and its sensitivity: `coordinator/mechanisms/
  base.py`). Built in: `TreeMechanism` (the online tree), `MatrixMechanism` (banded / BLT matrix
  factorization); the config's `dp.mechanism` builds one. A caller's subclass is the same kind of
  object and runs on every path a built-in runs (ring noise if it has `ring_stream`, restarts if
  `supports_restarts`, adaptive clipping, resume, bound to the run by its fingerprint), or is
  refused naming the missing part. dpfleet converts its declared sensitivity to (eps, delta) by
  RDP and says in privacy.json and the report that it cannot verify the declaration.
* `ParticipationPolicy` (who of the eligible devices takes part). Built in: `UniformPolicy`,
  `DisjointPolicy` (`participation.mode`). The coordinator's guard still decides who is eligible
  (MinS / MaxP) and checks every choice (`check_selection`); the accountant reads who actually
  took part, so no policy can make the reported epsilon wrong.

Examples of each: `examples/extensions.py` (run by tests/test_extensions.py), shown in
docs/extending.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from dpfleet.coordinator.engine.participation import (
    DisjointPolicy,
    Eligible,
    UniformPolicy,
    check_selection,
)
from dpfleet.coordinator.mechanisms.base import Mechanism, NoiseStream
from dpfleet.coordinator.mechanisms.matrix import MatrixMechanism
from dpfleet.coordinator.mechanisms.tree import TreeMechanism
from dpfleet.edge.clipping import clip_l2, norm64
from dpfleet.edge.runtime import LocalSGD
from dpfleet.errors import DpfleetError

__all__ = [
    "ClippingRule", "DisjointPolicy", "Eligible", "LocalSGD", "LocalUpdate", "MatrixMechanism",
    "Mechanism", "NoiseStream", "ParticipationPolicy", "TreeMechanism", "UniformPolicy",
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
class ParticipationPolicy(Protocol):
    """Choose `count` distinct devices of round `round_idx` from `eligible` (the devices the
    guard allows, ascending; `eligible.count` of them, `eligible.at(positions)` gives them;
    `eligible.keys(devices)` their user keys, the ones given to `simulate(users=...)` or the
    dataset's user ids). Return their indices. Seed any randomness from the round, so a rerun
    selects the same."""

    def select(self, round_idx: int, eligible: Eligible, count: int) -> Sequence[int] | np.ndarray: ...


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


def install(engine, *, participation: object = None) -> None:
    """Put a caller's `ParticipationPolicy` into a run's engine before its first round (the guard
    and the participation log stay the engine's). A caller's `Mechanism` goes to the engine's
    constructor (`noise_mechanism`), where the config's would be built."""
    if participation is not None:
        if not isinstance(participation, ParticipationPolicy):
            raise DpfleetError(f"participation must have select(round_idx, eligible, count), not "
                               f"{type(participation).__name__}")
        if engine.cfg.participation.mode != "uniform":
            raise DpfleetError("a custom participation policy runs with participation.mode = 'uniform' "
                               f"(its guard's MinS / MaxP apply), not {engine.cfg.participation.mode!r}")
        engine.participation.policy = participation


def noise_mechanism(cfg, noise: object) -> Mechanism | None:
    """A caller's noise mechanism for the engine (None: the config's `dp.mechanism`): a
    `Mechanism`, which the engine binds to the run and runs on every path (refusing, naming the
    missing part, one it cannot run on); `dp.mechanism` must be left at its default."""
    if noise is None:
        return None
    if not isinstance(noise, Mechanism):
        raise DpfleetError(f"noise must be a dpfleet.extensions.Mechanism (identity(), "
                           f"sensitivity_squared(...), stream(...)), not {type(noise).__name__}")
    if cfg.dp.mechanism not in ("tree", noise.name):
        raise DpfleetError(f"the config asks for dp.mechanism = {cfg.dp.mechanism!r} and noise= passes "
                           f"{noise.name!r}: leave dp.mechanism at 'tree' (its default) or drop noise=")
    if cfg.dp.target_epsilon:
        raise DpfleetError(f"dp.target_epsilon plans the registered mechanisms (dp.mechanism), not a "
                           f"caller's object ({noise.name}): set dp.noise_multiplier, or register it "
                           "(dpfleet.coordinator.mechanisms.registry.register)")
    return noise
