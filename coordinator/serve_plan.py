"""What `service serve` asks of a config before it starts, and the plan a coordinator's state
directory keeps: shared by the service and by `fleet run`, which refuses in the service's words
before it starts anything, and by `fleet emulate`, whose devices follow the coordinator's plan.

Why in the coordinator and not in the service: these are facts about a config and its run plan
(what a network run may not promise, what a restart may not re-plan), not about serving HTTP, and
the emulated fleet may import nothing of the service (its devices know only the wire protocol).
"""

from __future__ import annotations

import json
from pathlib import Path

from dpfleet.coordinator.config import SimulationConfig
from dpfleet.coordinator.run_privacy.config_plan import RunPlan, apply_run_plan
from dpfleet.edge.wire.protocol import PLAN_FILE
from dpfleet.errors import DpfleetError


def check_service_config(cfg: SimulationConfig) -> None:
    """What the service refuses up front (clear errors, never a silent weaker guarantee)."""
    if cfg.participation.over_selection != 1:  # simulate's race to the goal (`participation`)
        raise DpfleetError("participation.over_selection races simulated finishing times to the report "
                           "goal in `simulate`; serve keeps every assigned device in the round: "
                           "over-select with service.overselect")
    if cfg.data.generated_population:
        raise DpfleetError("data.generated_population cycles real users for scale tests; its epsilon "
                           "protects nobody, so the service refuses it: use `dpfleet simulate`")
    if cfg.projection.noise_cohort:
        raise DpfleetError("a [projection] is a simulation of DP at a planned population: its noise "
                           "is too small for the devices it trains, so the service refuses it: use "
                           "`dpfleet simulate`")
    if cfg.backend.kind != "local":
        raise DpfleetError("the service trains nothing itself: backend.kind must be 'local'")


def check_secret_noise(cfg: SimulationConfig) -> None:
    """The service adds secret noise only: `dp.noise_seed` (research mode) lets anyone with the
    seed rebuild the noise and subtract it from every release, so `serve` refuses it."""
    if cfg.dp.noise_seed >= 0:
        raise DpfleetError(f"dp.noise_seed = {cfg.dp.noise_seed} is research mode (anyone with the "
                           "seed can rebuild the noise and read the clients' sum); the service "
                           "refuses it: remove dp.noise_seed from the config")


def check_serve_config(cfg: SimulationConfig) -> None:
    """Everything `service serve` refuses before it starts (`fleet run` asks it before it
    starts anything): research-mode noise, and what `check_service_config` refuses."""
    check_secret_noise(cfg)
    check_service_config(cfg)


PLAN_KEPT = ("target_epsilon", "delta", "rounds", "mechanism_choice")  # what the plan was made for


def check_kept_plan(cfg: SimulationConfig, state: Path) -> dict | None:
    """A restart keeps the first start's plan (STATE/plan.json), so a config whose target differs
    from it is refused in one line, before the state is opened; the kept plan (None: none yet).

    Why refuse rather than ignore: ignoring would run a plan the config no longer states (the
    config says one thing, the run does another), and re-planning mid-run would change the noise
    and the participation limits under rounds already released with the old ones."""
    path = Path(state) / PLAN_FILE
    return checked_plan(cfg, path) if path.is_file() else None


def checked_plan(cfg: SimulationConfig, path: Path, kept: tuple[str, ...] = PLAN_KEPT) -> dict:
    """The plan at `path` (a coordinator's plan.json) if `cfg` is the config it was made for (in
    the `kept` fields)."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise DpfleetError(f"cannot read the plan {path}: {exc}") from None
    now = {"target_epsilon": cfg.dp.target_epsilon, "delta": cfg.dp.delta, "rounds": cfg.rounds,
           "mechanism_choice": cfg.dp.mechanism if cfg.dp.target_epsilon > 0 else None}
    changed = [k for k in kept if record.get(k) != now[k]]
    if changed:
        said = ", ".join(f"{k} {record.get(k)!r} -> {now[k]!r}" for k in changed)
        raise DpfleetError(f"{Path(path).parent} was planned at its first start for dp.target_epsilon = "
                           f"{record.get('target_epsilon'):g} ({Path(path).name}); the config now differs "
                           f"({said}): a restart never re-plans, so continue with the config it "
                           "was started with, or choose a new --state")
    return record


def follow_plan(cfg: SimulationConfig, record: dict, plan: RunPlan | None = None
                ) -> tuple[SimulationConfig, RunPlan]:
    """A kept plan's keys in a new config (`apply_run_plan`: a planned key the config states
    differently, `plan.given`, is one error; the new config is checked as a whole)."""
    return apply_run_plan(cfg, plan or RunPlan(), record)
