"""The run's noise mechanism, bound to the run: built once, recorded, and checked on every resume.

Why: a mechanism's noise and its accounting must be the same object for the whole run. Before
this binding, a run with a custom mechanism resumed without it was re-accounted as the tree (eps 16.86
for rounds that had no noise), and a `mechanism.json` edited between a crash and the resume was
taken as the strategy (sens^2 6.02 reported where the noise used needs >= 7.07). Now the
mechanism's fingerprint (`Mechanism.fingerprint`: a hash of its name and strategy) is written to
`mechanism.json` and `config.json` at the start, into every release record and into the resume
point; a resume whose mechanism differs from any of them is refused with one line.

mechanism.json: {"name", "sha256", "identity", "custom", "source" (built-in, plugin or custom:
`registry.source`), "optimised_for", and for banded / BLT "spec" (what `dpfleet account
--mechanism-spec` reads)}. A plugin's run resumes from the registry when the same plugin is
installed; a caller's object (custom) must be handed in again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from dpfleet.coordinator.mechanisms.base import Mechanism
from dpfleet.coordinator.mechanisms.mf_sensitivity import gap_from_min_separation, true_max_participations
from dpfleet.coordinator.mechanisms.registry import build, is_built_in, rebuild, source
from dpfleet.errors import DpfleetError
from dpfleet.jsonio import write_json

MECHANISM_FILE = "mechanism.json"


def accounted_participation(cfg, min_separation: int) -> tuple[int, int]:
    """(MinS, MaxP) the config enforces, for optimising a strategy.

    Disjoint: each device at most once, so MaxP = 1 and any MinS holds (n - 1: banded may use all
    n bands). Uniform / timer: the coordinator's enforced MinS (`Participation.min_separation`) and
    max_participation, or the most that MinS allows over the rounds when uncapped.
    """
    n = cfg.rounds
    if cfg.participation.mode == "disjoint":
        return n - 1, 1
    gap = gap_from_min_separation(min_separation)
    return min_separation, true_max_participations(n, gap, cfg.participation.max_participation or None)


def binding(mechanism: Mechanism) -> dict:
    """What config.json, the release records and the resume point say of the mechanism."""
    return {"name": mechanism.name, "sha256": mechanism.fingerprint()}


def check_bound(mechanism: Mechanism, bound: dict | None, where: str) -> None:
    """One line when `mechanism` is not the one `bound` (a `binding`; None: `where` carries no
    fingerprint, which a resumed run's files always do, so that is refused too)."""
    if bound is None:
        raise DpfleetError(f"{where} has no mechanism fingerprint (a run of a dpfleet before the "
                           "binding, or an edited file): it cannot be resumed; start it again")
    if bound.get("sha256") == mechanism.fingerprint():
        return
    raise DpfleetError(
        f"{where} was made with the noise mechanism {bound.get('name')!r} (fingerprint "
        f"{str(bound.get('sha256'))[:12]}), this resume would use {mechanism.name!r} (fingerprint "
        f"{mechanism.fingerprint()[:12]}): resume with the mechanism, strategy and custom parts the "
        "run was started with")


def _record(mechanism: Mechanism, custom: bool, optimised_for: dict) -> dict:
    out = {**binding(mechanism), "identity": mechanism.identity(), "custom": custom,
           "source": source(mechanism), "optimised_for": optimised_for}
    if mechanism.name in ("banded", "blt") and not custom:
        out["spec"] = mechanism.identity()
    return out


def run_mechanism(cfg, min_separation: int, run_path: Path, resume: bool,
                  given: Mechanism | None = None, pin: Mapping[str, str] | None = None
                  ) -> tuple[Mechanism, dict]:
    """The run's mechanism and the participation it was optimised for: built (the config's, or
    `given`, a caller's) and written to mechanism.json at a fresh start; on resume rebuilt from
    mechanism.json (or `given` again) and checked against the fingerprint recorded there and in
    config.json (the release records and resume point are checked by `resume`). `pin`: the
    binding of the config.json the config was read from (`config_plan.RunPlan.binding`), which
    the mechanism built at a fresh start must match."""
    path = run_path / MECHANISM_FILE
    if resume and path.is_file():
        saved = json.loads(path.read_text())
        if not isinstance(saved, dict) or "sha256" not in saved:
            raise DpfleetError(f"{path} has no mechanism fingerprint (a run of a dpfleet before the "
                               "binding, or an edited file): it cannot be resumed with its noise "
                               "accounted for sure; start it again")
        if saved.get("custom") and saved.get("source") != "plugin" and given is None:
            raise DpfleetError(f"{run_path} was started with the custom noise mechanism "
                               f"{saved.get('name')!r}: resume it with the same mechanism "
                               "(dpfleet.simulate(..., noise=...)), not with the config's")
        # a plugin (or built-in) from the registry: the same installed plugin rebuilds it
        mechanism = given if given is not None else rebuild(saved["name"], saved["identity"])
        check_bound(mechanism, saved, str(path))
        if (run_path / "config.json").is_file():  # the service's state store keeps none
            check_bound(mechanism, _config_binding(run_path), str(run_path / "config.json"))
        return mechanism, saved["optimised_for"]
    mins, maxp = accounted_participation(cfg, min_separation)
    mechanism = given if given is not None else build(cfg.dp.mechanism, cfg.rounds, mins, maxp)
    if pin is not None:  # a run's config.json: its pin holds
        check_bound(mechanism, dict(pin), "the config's mechanism binding")
    optimised_for = {"min_separation": mins, "max_participation": maxp,
                     "participation": cfg.participation.mode}
    write_json(path, _record(mechanism, not is_built_in(mechanism), optimised_for), indent=2)
    _bind_config(run_path, mechanism)
    return mechanism, optimised_for


def saved_config(run_path: Path) -> dict:
    """A run directory's config.json (with its `mechanism` binding: a pin `read_run_config` keeps
    beside the config)."""
    return json.loads((run_path / "config.json").read_text())


def _config_binding(run_path: Path) -> dict | None:
    """config.json's binding (None: it has none, which `check_bound` refuses)."""
    return json.loads((run_path / "config.json").read_text()).get("mechanism")


def _bind_config(run_path: Path, mechanism: Mechanism) -> None:
    """config.json (the resolved config) gets the mechanism's binding, as `mechanism`."""
    path = run_path / "config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    config["mechanism"] = binding(mechanism)
    write_json(path, config, indent=2)


def check_supported(cfg, mechanism: Mechanism) -> None:
    """A mechanism runs on every path the config asks for, or the run is refused before anything
    is drawn, naming the missing part (ring noise is checked when the ring stream is built)."""
    from dpfleet.coordinator.config import resolve_noise

    problems = []
    if cfg.dp.restart_rounds and not mechanism.supports_restarts:
        problems.append("dp.restart_rounds (it has no restarts: supports_restarts is False)")
    if cfg.dp.adaptive_clipping and not (mechanism.supports_restarts or mechanism.adapts_every_round):
        problems.append("adaptive clipping (a new clip norm needs restarts or adapts_every_round)")
    if resolve_noise(cfg) == "discrete" and type(mechanism).ring_stream is Mechanism.ring_stream:
        problems.append("ring noise with secure aggregation (it has no ring_stream; set dp.noise = "
                        "'gaussian' for honest participants only)")
    if problems:
        raise DpfleetError(f"the noise mechanism {mechanism.name!r} cannot run with "
                           + "; ".join(problems))
