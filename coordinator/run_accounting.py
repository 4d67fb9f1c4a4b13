"""Privacy accounting while a run goes: observed MinS / MaxP, eps after every round, the budget.

The round engine tells the accountant who contributed to each round (the same records it writes
to participation.jsonl). After each round the accountant gives the zCDP of the worst case over
every participation pattern with the MinS / MaxP observed so far (the exact tree sensitivity, as
the headline of `accounting.account_participation_log`) and its eps by RDP: fast, cached by the
integer sensitivity S, and in disjoint mode exactly paper 000's single-participation figures.
The run's final report converts with PLD (tighter) through `privacy_report`.

Budget: `would_exceed` is asked *before* a round, with the devices selected for it, whether the
worst case after that round would pass the budget. The budget is an eps at delta by PLD (the
report's conversion); eps grows with rho, so it becomes a rho threshold once, and each check is
exact and cheap. Stopping depends only on who takes part, never on their data.

At the end, `write_run_privacy` writes privacy_report.md (paper 002 App. C, PLD, from the
participation log: observed MinS / MaxP, and the worst case the timer / coordinator MinS implies)
and privacy.json with the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from dpfleet.coordinator.accounting import (
    epsilon_from_zcdp,
    zcdp_for_epsilon,
    zcdp_from_sensitivity,
)
from dpfleet.coordinator.config import SimulationConfig
from dpfleet.coordinator.participation import Participation
from dpfleet.coordinator.privacy_report import summarize_privacy, write_privacy_report
from dpfleet.coordinator.run_dir import atomic_write
from dpfleet.coordinator.tree_sensitivity import tree_sensitivity_squared
from dpfleet.errors import DpfleetError


class RunAccountant:
    """Observed participation of a running simulation and its privacy after each round."""

    def __init__(self, noise_multiplier: float, delta: float, budget_epsilon: float = 0.0,
                 conversion: str = "pld"):
        if budget_epsilon and noise_multiplier <= 0:
            raise DpfleetError("a privacy budget needs dp.noise_multiplier > 0 (z = 0 means eps = inf)")
        self.noise_multiplier, self.delta = float(noise_multiplier), float(delta)
        self.budget_epsilon = float(budget_epsilon)
        # "rdp" for discrete noise, whose zCDP the Gaussian PLD does not bound (privacy_report)
        self.rho_budget = (zcdp_for_epsilon(budget_epsilon, delta, conversion) if budget_epsilon
                           else math.inf)
        self.rounds = 0
        self.restarts: list[int] = []
        self.last: dict[str, int] = {}
        self.count: dict[str, int] = {}
        self.min_separation: int | None = None  # observed; None until a device took part twice
        self.max_participation = 0
        self._eps_rdp: dict[int, float] = {}

    def _observed_after(self, devices: Sequence[str]) -> tuple[int, int | None]:
        """(MaxP, MinS) if `devices` took part in the next round."""
        maxp, mins = self.max_participation, self.min_separation
        for d in devices:
            maxp = max(maxp, self.count.get(d, 0) + 1)
            if d in self.last:
                gap = self.rounds - self.last[d] - 1
                mins = gap if mins is None else min(mins, gap)
        return maxp, mins

    def _sensitivity(self, rounds: int, maxp: int, mins: int | None, restarts: list[int]) -> int:
        if maxp == 0:  # nobody took part: nothing about anyone was released
            return 0
        return tree_sensitivity_squared(rounds, maxp, mins, restarts)

    def _zcdp(self, s: int) -> float:
        if s == 0:
            return 0.0
        return math.inf if self.noise_multiplier == 0 else zcdp_from_sensitivity(self.noise_multiplier, s)

    def zcdp_after(self, devices: Sequence[str], restart: bool) -> float:
        """Worst-case zCDP after the next round if `devices` take part in it."""
        maxp, mins = self._observed_after(devices)
        restarts = self.restarts + [self.rounds] * restart
        return self._zcdp(self._sensitivity(self.rounds + 1, maxp, mins, restarts))

    def would_exceed(self, devices: Sequence[str], restart: bool) -> bool:
        return self.zcdp_after(devices, restart) > self.rho_budget

    def record(self, devices: Sequence[str], restart: bool) -> dict:
        """Add one round; returns the privacy after it (zcdp, eps by RDP, observed MinS/MaxP)."""
        self.max_participation, self.min_separation = self._observed_after(devices)
        if restart and self.rounds > 0:
            self.restarts.append(self.rounds)
        for d in devices:
            self.last[d] = self.rounds
            self.count[d] = self.count.get(d, 0) + 1
        self.rounds += 1
        s = self._sensitivity(self.rounds, self.max_participation, self.min_separation, self.restarts)
        rho = self._zcdp(s)
        if s not in self._eps_rdp:
            self._eps_rdp[s] = epsilon_from_zcdp(rho, self.delta, "rdp")
        return {"zcdp": rho, "epsilon": self._eps_rdp[s], "sensitivity_squared": s,
                "min_separation": self.min_separation, "max_participation": self.max_participation}


def _report_setting(cfg: SimulationConfig, participation: Participation, rounds: int,
                    population: int) -> dict:
    """The `privacy_report` setting of a simulation run."""
    dp, part = cfg.dp, cfg.participation
    clip = (f"adaptive: initial {dp.clip_norm:g}, target quantile {dp.target_quantile:g}, "
            "adopted at tree restarts" if dp.adaptive_clipping else dp.clip_norm)
    setting = {
        "noise_multiplier": dp.noise_multiplier, "delta": dp.delta, "clip_norm": clip,
        "report_goal": dp.report_goal, "population": population, "rounds": rounds,
        "secagg": cfg.aggregation.kind == "secagg", "adaptive_clipping": dp.adaptive_clipping,
    }
    if dp.noise == "discrete":
        setting.update(noise="discrete", method="rdp")
    if cfg.tokenizer.kind == "sentencepiece" and not cfg.tokenizer.path:
        setting["public_data"] = f"{cfg.tokenizer.corpus}, for the SentencePiece vocabulary"
    mins = participation.min_separation
    if part.mode == "timer":
        slots = participation.fleet.timer_slots
        setting["timer_min_separation"] = mins
        setting["timer_period"] = (f"{part.timer_period:g} h = {slots} rounds of "
                                   f"{part.round_minutes:g} min: nominal MinS {slots - 1}; "
                                   f"enforced MinS {mins}")
    elif part.mode == "uniform" and mins > 0:
        setting["timer_min_separation"] = mins
        setting["timer_period"] = f"no timer here: uniform sampling, enforced MinS {mins}"
    return setting


def _trivial_report(run_dir: Path, statement: str) -> None:
    atomic_write(run_dir / "privacy_report.md", f"# Privacy report\n\n**Formal statement.** {statement}\n")


def write_run_privacy(run_dir: Path, cfg: SimulationConfig, participation: Participation,
                      accountant: RunAccountant, population: int, *,
                      model_noise_multiplier: float, stopped_early: str | None) -> dict:
    """privacy_report.md and privacy.json of a finished (or stopped) run; returns the JSON dict."""
    setting = _report_setting(cfg, participation, max(accountant.rounds, 1), population)
    privacy = {
        "accounting": "rho-zCDP of DP-FTRL's tree aggregation with the exact worst-case sensitivity "
                      "over every participation pattern with the observed MinS / MaxP (zero-out, "
                      "device level); " + ("epsilon and epsilon_rdp by RDP (discrete noise: the "
                                           "Gaussian PLD is no bound for it)"
                                           if cfg.dp.noise == "discrete" else
                                           "epsilon by PLD, epsilon_rdp by RDP"),
        "participation": cfg.participation.mode,
        "min_separation_enforced": participation.min_separation,
        "max_participation_enforced": cfg.participation.max_participation or None,
        "model_noise_multiplier": model_noise_multiplier,
        "planned_rounds": cfg.rounds,
        "budget_epsilon": cfg.dp.budget_epsilon or None,
        "stopped_early": stopped_early,
        **{k: v for k, v in setting.items() if k not in ("rounds", "timer_period")},
        "rounds": accountant.rounds,
        "min_separation": accountant.min_separation,
        "max_participation": accountant.max_participation,
        "restarts": accountant.restarts,
    }
    if accountant.rounds == 0 or cfg.dp.noise_multiplier == 0:
        eps = 0.0 if accountant.rounds == 0 else math.inf
        privacy.update(zcdp=eps, epsilon=eps, epsilon_rdp=eps, timer_worst_case=None)
        _trivial_report(run_dir, "No round ran, so nothing about any device was released (eps = 0)."
                        if accountant.rounds == 0 else
                        "None: the noise multiplier is 0, so the run is not differentially "
                        "private (eps = inf).")
        return privacy
    summary = summarize_privacy(run_dir, setting)
    obs, timer = summary["observed"], summary["timer"]
    privacy.update(
        zcdp=obs["zcdp"], epsilon=obs["epsilon"],
        epsilon_rdp=epsilon_from_zcdp(obs["zcdp"], cfg.dp.delta, "rdp"),
        sensitivity_squared=obs["sensitivity_squared"], worst_device=obs["worst_device"],
        timer_worst_case=None if timer is None else {
            k: timer[k] for k in ("rounds", "min_separation", "max_participation",
                                  "sensitivity_squared", "zcdp", "epsilon")},
    )
    write_privacy_report(run_dir, setting)
    return privacy
