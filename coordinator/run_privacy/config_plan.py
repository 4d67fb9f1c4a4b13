"""`dp.target_epsilon`: a run config that states its privacy target and lets the planner choose.

Why: the noise, cohort size and participation limits that meet an epsilon are not something a
user should hand-tune (docs/benchmarks/main-job.md, "What privacy costs here"); `dpfleet plan`
already chooses them.
With `dp.target_epsilon > 0` the simulation plans once the training population N is known:
report goal and the largest MinS / worst-case MaxP it allows (`make_plan`), each mechanism
optimised for them with the z that meets the target (`mechanism_rows`), and `dp.mechanism =
"auto"` takes the least model noise. The planned keys make a new config (`apply_run_plan`: the
config is frozen; uniform participation enforced by the coordinator's MinS / MaxP guard), and the
run directory gets plan.json. A planned key the config states itself must agree with the plan,
else the run is refused: a config never says one thing while the run does another.

What the config states of the planned keys, and a run's config.json's mechanism pin, are no
settings: they are kept beside the config, in a `RunPlan` (`read_run_config`), with the plan.

The accountant still reads the participation log: the plan sets the limits, it does not
replace the accounting (privacy.json's eps is the observed run's, at most the target).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from dpfleet.coordinator.accounting.ledger import stated_epsilon
from dpfleet.coordinator.accounting.planner import candidates, make_plan, mechanism_rows, pick_mechanism
from dpfleet.coordinator.accounting.zcdp import zcdp_for_epsilon
from dpfleet.coordinator.config import (
    SimulationConfig,
    config_values,
    given_planned_keys,
    parse_config,
    split_binding,
    validate,
)
from dpfleet.coordinator.config_overrides import with_values
from dpfleet.coordinator.mechanisms.registry import entry, source
from dpfleet.coordinator.run_privacy.run_accountant import conversion_for
from dpfleet.errors import DpfleetError

Z_TOLERANCE = 1e-6  # relative: a stated noise multiplier agrees with the plan's within this


@dataclass(frozen=True)
class RunPlan:
    """What a run is planned and pinned by, beside its frozen config (never attached to it).

    `given`: the planned keys the config itself states ("dp.report_goal" -> value), which the
    plan must agree with; `binding`: a run's config.json pin of its mechanism ({name, sha256},
    `mechanism_binding.run_mechanism` checks the run's mechanism against it); `record`: plan.json
    once dp.target_epsilon is planned (None: not planned), whose keys `chosen` gives."""

    given: Mapping[str, Any] = field(default_factory=dict)
    binding: Mapping[str, str] | None = None
    record: Mapping[str, Any] | None = None

    @property
    def chosen(self) -> dict[str, Any]:
        """The planner's values of the planned keys ({} before planning)."""
        return {} if self.record is None else planned_values(self.record)


def read_run_config(values: dict) -> tuple[SimulationConfig, RunPlan]:
    """Raw config values (a TOML file's, a dict's, or a run's config.json) as the checked config
    and what it states beside its settings (`RunPlan`, not yet planned)."""
    settings, binding = split_binding(values)
    return parse_config(settings), RunPlan(given=given_planned_keys(settings), binding=binding)


def load_run_config(path: Path, overrides: Mapping[str, object] | None = None,
                    python: bool = False) -> tuple[SimulationConfig, RunPlan]:
    """`read_run_config` of the file at `path` with `overrides` (`config.config_values`)."""
    return read_run_config(config_values(path, overrides, python))


def make_run_plan(cfg: SimulationConfig, population: int) -> dict:
    """plan.json for this config and a training population of `population` clients."""
    target = cfg.dp.target_epsilon
    rho = zcdp_for_epsilon(target, cfg.dp.delta)
    plan = make_plan(population, cfg.rounds, rho, delta=cfg.dp.delta)
    asked = cfg.dp.mechanism
    # auto: with dp.restart_rounds only mechanisms that restart (config.mechanism_checks); plugins
    # only with dp.auto_plugins
    kinds = candidates(asked, bool(cfg.dp.restart_rounds), cfg.dp.auto_plugins)
    rows = [row for kind in kinds
            for row in mechanism_rows(plan.chosen, cfg.rounds, _target_zcdp(cfg, kind, rho), (kind,))]
    picked = pick_mechanism(rows) if asked == "auto" else next(r for r in rows if r.mechanism == asked)
    c = plan.chosen
    return {
        "population": population, "rounds": cfg.rounds, "target_epsilon": target,
        "delta": cfg.dp.delta, "target_zcdp": rho,
        "epsilon_of_target_zcdp": stated_epsilon(rho, cfg.dp.delta),
        "mechanism_choice": asked,
        "chosen": {"report_goal": c.report_goal, "min_separation": c.min_separation,
                   "max_participation": c.max_participation, "mechanism": picked.mechanism,
                   "noise_multiplier": picked.noise_multiplier,
                   "noise_per_report": picked.noise_multiplier / c.report_goal,
                   "model_noise_per_report": picked.model_noise_per_report},
        "mechanisms": [asdict(r) for r in rows],
        "report_goals": [{**asdict(r), "noise_per_report": r.noise_per_report} for r in plan.rows],
        "why": "report goal: the smallest within 10% of the best tree z / M on the grid; MinS: the "
               "largest it allows (N // M - 1); MaxP: ceil(T / (MinS + 1)); mechanism: "
               + ("least model noise at the target" if asked == "auto" else "as the config asks"),
    }


def _target_zcdp(cfg: SimulationConfig, kind: str, rho: float) -> float:
    """The zCDP that meets the target as a run of `kind` converts it (`conversion_for`): `rho`
    (by PLD), or less where the run accounts by RDP (a plugin's declared noise, discrete ring
    noise), so the run's claimed eps is within the target, never above it."""
    conversion = conversion_for(cfg, entry(kind).cls, source(kind) != "built-in")
    return rho if conversion == "pld" else zcdp_for_epsilon(cfg.dp.target_epsilon, cfg.dp.delta, conversion)


def plan_line(record: dict) -> str:
    """The `plan:` line a planned run prints (simulate, and serve at every start)."""
    c = record["chosen"]
    return (f"plan: eps {record['target_epsilon']:g} at delta {record['delta']:g}, N "
            f"{record['population']}, {record['rounds']} rounds -> report goal {c['report_goal']}, "
            f"MinS {c['min_separation']}, MaxP {c['max_participation']}, {c['mechanism']} noise z "
            f"{c['noise_multiplier']:.4g} (plan.json)")


def planned_values(record: dict) -> dict[str, Any]:
    c = record["chosen"]
    return {"dp.report_goal": c["report_goal"], "dp.noise_multiplier": c["noise_multiplier"],
            "dp.mechanism": c["mechanism"], "participation.mode": "uniform",
            "participation.min_separation": c["min_separation"],
            "participation.max_participation": c["max_participation"]}


def _agrees(key: str, stated: Any, planned: Any, asked_mechanism: str) -> bool:
    if key == "dp.mechanism":
        return stated in ("auto", planned) or (stated == asked_mechanism == planned)
    if key == "dp.noise_multiplier":
        return math.isclose(float(stated), planned, rel_tol=Z_TOLERANCE)
    return stated == planned


def apply_run_plan(cfg: SimulationConfig, plan: RunPlan, record: Mapping[str, Any]
                   ) -> tuple[SimulationConfig, RunPlan]:
    """A new config with the plan's keys (validated: it is a new config) and the plan holding
    `record`; a key the config stated differently (`plan.given`) is one error."""
    values = planned_values(record)
    for key, stated in plan.given.items():
        if not _agrees(key, stated, values[key], record["mechanism_choice"]):
            raise DpfleetError(
                f"config states {key} = {stated!r} but dp.target_epsilon = {record['target_epsilon']:g} "
                f"plans {values[key]!r} (N {record['population']}, {record['rounds']} rounds): remove "
                f"{key} to take the plan, or remove dp.target_epsilon to set the keys yourself")
    planned = with_values(cfg, values)
    validate(planned)
    return planned, replace(plan, record=record)
