"""Privacy accounting while a run goes: observed MinS / MaxP, eps after every round, the budget.

The round engine tells the accountant who contributed to each round (the same records it writes
to participation.jsonl). After each round the accountant gives the zCDP of the worst case over
every participation pattern with the MinS / MaxP observed so far (the exact tree sensitivity, as
the headline of `accounting.account_participation_log`) and its eps by the run's conversion, the
one the final report uses (PLD for Gaussian noise, RDP for discrete or a caller's): so the progress
bar, metrics.jsonl and privacy.json state one figure, and the last round's is the report's. A PLD
conversion costs ~40 ms, so it is cached by rho: a run's sensitivity takes few distinct values
(5 in the main job's 20 rounds), and a replay of the log (resume, the service's live report)
converts each once.

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
from typing import TYPE_CHECKING, Protocol

import numpy as np

from dpfleet.coordinator.accounting.ledger import (
    DP_VOCABULARY,
    TRAINING,
    Entry,
    Ledger,
    epsilon_of,
    mechanism_entry,
    release_entry,
    vocabulary_entry,
)
from dpfleet.coordinator.accounting.privacy_report import (
    HONEST_ONLY,
    noise_mechanism,
)
from dpfleet.coordinator.accounting.zcdp import (
    zcdp_for_epsilon,
)
from dpfleet.coordinator.config import SimulationConfig, honest_participants_only, public_words, resolve_noise
from dpfleet.coordinator.mechanisms.base import Mechanism
from dpfleet.coordinator.mechanisms.matrix import as_mechanism
from dpfleet.coordinator.mechanisms.registry import source
from dpfleet.coordinator.run_privacy.not_covered import nonprivate_vocabulary, not_covered, vocabulary_source
from dpfleet.coordinator.run_privacy.projection import projected_privacy
from dpfleet.edge.devices import SlottedDevices
from dpfleet.errors import DpfleetError

if TYPE_CHECKING:
    from dpfleet.coordinator.mechanisms.ring_noise import RingPlan


class RunAccountant:
    """Observed participation of a running simulation and its privacy after each round: the one
    place a run's privacy is computed, for every mechanism (`mechanisms.base.Mechanism`), as the
    run's ledger (`accounting.ledger`)."""

    def __init__(self, noise_multiplier: float, delta: float, budget_epsilon: float = 0.0,
                 conversion: str = "pld", *, vocabulary: dict | None = None,
                 count_stddev: float | None = None, mechanism: Mechanism | None = None,
                 declared: bool = False):
        """`vocabulary`: the DP vocabulary's summary (`dp_vocabulary`), spent before training and
        counted against the budget; `count_stddev`: adaptive clipping's clipped-count noise
        sigma_b (its share of z, a ledger entry of its own); `conversion`: "rdp" for noise whose
        zCDP the Gaussian PLD does not bound (discrete, or a caller's); `mechanism`: default the
        tree; `declared`: its sensitivity is a caller's claim (dpfleet converts it, cannot verify
        it)."""
        if budget_epsilon and noise_multiplier <= 0:
            raise DpfleetError("a privacy budget needs dp.noise_multiplier > 0 (z = 0 means eps = inf)")
        self.noise_multiplier, self.delta = float(noise_multiplier), float(delta)
        self.mechanism, self.conversion, self.declared = as_mechanism(mechanism), conversion, declared
        self.vocabulary, self.count_stddev = vocabulary, count_stddev
        self.spent: tuple[Entry, ...] = (vocabulary_entry(vocabulary),) if vocabulary else ()
        self.budget_epsilon = float(budget_epsilon)
        self.rho_budget = (zcdp_for_epsilon(budget_epsilon, delta, conversion) - Ledger(self.spent).zcdp
                           if budget_epsilon else math.inf)
        self.rounds = 0
        self.restarts: list[int] = []
        self.last: dict[str, int] = {}
        self.count: dict[str, int] = {}
        self.min_separation: int | None = None  # observed; None until a device took part twice
        self.max_participation = 0

    def fresh(self) -> RunAccountant:
        """The same accountant before any round (to replay a log of committed rounds)."""
        return RunAccountant(self.noise_multiplier, self.delta, self.budget_epsilon, self.conversion,
                             vocabulary=self.vocabulary, count_stddev=self.count_stddev,
                             mechanism=self.mechanism, declared=self.declared)

    def _observed_after(self, devices: Sequence[str]) -> tuple[int, int | None]:
        """(MaxP, MinS) if `devices` took part in the next round."""
        maxp, mins = self.max_participation, self.min_separation
        for d in devices:
            maxp = max(maxp, self.count.get(d, 0) + 1)
            if d in self.last:
                gap = self.rounds - self.last[d] - 1
                mins = gap if mins is None else min(mins, gap)
        return maxp, mins

    def sensitivity_squared(self, rounds: int, maxp: int, mins: int | None, restarts: Sequence[int]) -> float:
        """The mechanism's worst-case sens^2 for this participation, checked: a finite real >= 0,
        and > 0 once a device took part (a mechanism claiming 0 would report eps 0 for releases
        that carry a device's update)."""
        s = self.mechanism.sensitivity_squared(rounds, mins, maxp, restarts)
        if isinstance(s, bool) or not isinstance(s, int | float | np.integer | np.floating) \
                or not math.isfinite(s) or s < 0 or (maxp > 0 and s == 0):
            raise DpfleetError(
                f"noise mechanism {self.mechanism.name!r}: sensitivity_squared({rounds}, {mins}, {maxp}) "
                f"returned {s!r}; it must be a finite number >= 0, and > 0 once a device took part")
        return s

    def training(self, rounds: int, maxp: int, mins: int | None,
                 restarts: Sequence[int]) -> tuple[float, Entry]:
        """(sens^2, the ledger's DP-FTRL entry) for this participation: the mechanism's own event
        (`ledger.mechanism_entry`, checked against the checked sens^2), the model noise and, with
        adaptive clipping, the clipped-count noise (2 sigma_b), together of multiplier z."""
        s = self.sensitivity_squared(rounds, maxp, mins, restarts) if rounds else 0.0  # 0: nothing released
        count = None if self.count_stddev is None else 2.0 * self.count_stddev
        return s, mechanism_entry(self.mechanism, self.noise_multiplier, s,
                                  (rounds, mins, maxp, list(restarts)), count)

    def zcdp_after(self, devices: Sequence[str], restart: bool) -> float:
        """Worst-case zCDP after the next round if `devices` take part in it."""
        maxp, mins = self._observed_after(devices)
        restarts = self.restarts + [self.rounds] * restart
        return self.training(self.rounds + 1, maxp, mins, restarts)[1].zcdp

    def would_exceed(self, devices: Sequence[str], restart: bool) -> bool:
        return self.zcdp_after(devices, restart) > self.rho_budget

    def record(self, devices: Sequence[str], restart: bool) -> dict:
        """Add one round; returns the privacy after it (zcdp, eps as privacy.json converts it,
        observed MinS / MaxP)."""
        self.max_participation, self.min_separation = self._observed_after(devices)
        if restart and self.rounds > 0:
            self.restarts.append(self.rounds)
        for d in devices:
            self.last[d] = self.rounds
            self.count[d] = self.count.get(d, 0) + 1
        self.rounds += 1
        s, training = self._training_now()
        return {"zcdp": training.zcdp, "epsilon": Ledger((training,)).epsilon(self.delta, self.conversion),
                "sensitivity_squared": s,
                "min_separation": self.min_separation, "max_participation": self.max_participation}

    def epsilon_of(self, rho: float) -> float:
        """eps at the run's delta by the run's conversion: the figure privacy.json states."""
        return epsilon_of(rho, self.delta, self.conversion)

    def check_first_round(self) -> None:
        """A budget that no round fits is an error before any round, not a run of 0 rounds: the
        first round's worst case (one participation, whoever takes part) plus what was spent
        before training (a DP vocabulary) against `budget_epsilon`."""
        if not self.budget_epsilon or self.rounds:
            return
        first = self.training(1, 1, None, [])[1]
        if first.zcdp <= self.rho_budget:
            return
        eps = Ledger((first, *self.spent)).epsilon(self.delta, self.conversion)
        vocabulary = " with the DP vocabulary's share" if self.spent else ""
        raise DpfleetError(
            f"dp.budget_epsilon = {self.budget_epsilon:g} stops the run before round 1: one round "
            f"already costs eps {eps:.3g} at delta {self.delta:g}{vocabulary} (noise multiplier "
            f"{self.noise_multiplier:g}, {self.mechanism.name} noise); raise dp.budget_epsilon or "
            "dp.noise_multiplier")

    def _training_now(self) -> tuple[float, Entry]:
        return self.training(self.rounds, self.max_participation, self.min_separation, self.restarts)

    def ledger(self, releases: Sequence[dict] = ()) -> Ledger:
        """The run's ledger now: DP-FTRL for the worst case of the participation so far, the DP
        vocabulary, then the other releases ({name, zcdp, delta, what}, `ledger.release_entry`)."""
        return Ledger((self._training_now()[1], *self.spent,
                       *(release_entry(r) for r in releases)))

    def figures(self) -> dict:
        """The observed run's headline: sens^2, rho, eps (by `conversion`) and eps by RDP."""
        s, entry = self._training_now()
        training = Ledger((entry,))
        return {"sensitivity_squared": s, "zcdp": training.zcdp,
                "epsilon": training.epsilon(self.delta, self.conversion),
                "epsilon_rdp": training.epsilon(self.delta, "rdp")}

    def enforced_figures(self, rounds: int, min_separation: int, max_participation: int) -> dict:
        """The worst case the config enforces over its planned `rounds` (MinS / MaxP the strategy
        was optimised for, `mechanism_binding.accounted_participation`), with the restarts so far."""
        s, entry = self.training(rounds, max_participation, min_separation, self.restarts)
        training = Ledger((entry,))
        return {"rounds": rounds, "min_separation": min_separation, "restarts": list(self.restarts),
                "max_participation": max_participation, "sensitivity_squared": s,
                "zcdp": training.zcdp, "epsilon": training.epsilon(self.delta, self.conversion)}

    def with_vocabulary(self) -> dict | None:
        """Training composed with the DP vocabulary, from the ledger (None without one)."""
        if not self.spent:
            return None
        ledger = self.ledger().only([TRAINING, DP_VOCABULARY])
        return {**ledger.total(self.delta, self.conversion),
                "vocabulary_epsilon": ledger.only([DP_VOCABULARY]).epsilon(self.delta, self.conversion)}


class EnforcedParticipation(Protocol):
    """What a run's privacy reads of its participation (`engine.participation.Participation`):
    the MinS the coordinator enforces and the fleet whose timer it runs (timer mode). A protocol,
    not the class: this layer sits below the engine that owns participation."""

    min_separation: int
    fleet: SlottedDevices | None


def conversion_for(cfg: SimulationConfig, cls: type[Mechanism], declared: bool) -> str:
    """How a run of mechanism class `cls` converts zCDP to eps: by RDP (valid for any rho-zCDP
    mechanism) for discrete ring noise that is no rounded Gaussian, and for a declared mechanism,
    whose noise dpfleet cannot see is Gaussian; else by the Gaussian's PLD. The run's accountant
    and the planner use this one rule, so a plan's z meets its target as the run accounts it."""
    if declared or (resolve_noise(cfg) == "discrete" and not cls.ring_is_rounded_gaussian):
        return "rdp"
    return "pld"


def _public_data(cfg: SimulationConfig, public_data: Sequence[str]) -> list[str]:
    """Every public input of the run: the SentencePiece corpus or public word file, and the
    caller's."""
    tok = cfg.tokenizer
    spm = tok.kind == "sentencepiece" and not tok.path
    words = tok.kind == "word" and not tok.path and public_words(tok)
    return ([f"{tok.corpus}, for the SentencePiece vocabulary"] * spm
            + [f"{public_words(tok)}, for the word vocabulary"] * bool(words) + list(public_data))


def _report_setting(cfg: SimulationConfig, participation: EnforcedParticipation, rounds: int,
                    population: int, public_data: Sequence[str] = ()) -> dict:
    """The `privacy_report` setting of a simulation run."""
    dp, part = cfg.dp, cfg.participation
    clip = (f"adaptive: initial {dp.clip_norm:g}, target quantile {dp.target_quantile:g}, "
            "adopted at tree restarts" if dp.adaptive_clipping else dp.clip_norm)
    setting = {
        "noise_multiplier": dp.noise_multiplier, "delta": dp.delta, "clip_norm": clip,
        "report_goal": dp.report_goal, "population": population, "rounds": rounds,
        "secagg": cfg.aggregation.kind == "secagg", "adaptive_clipping": dp.adaptive_clipping,
    }
    public = _public_data(cfg, public_data)
    if public:
        setting["public_data"] = "; ".join(public)
    if resolve_noise(cfg) == "discrete":
        setting.update(noise="discrete", method="rdp")
    mins = participation.min_separation
    if part.mode == "timer":
        slots = participation.slotted.timer_slots
        setting["timer_min_separation"] = mins
        setting["timer_period"] = (f"{part.timer_period:g} h = {slots} rounds of "
                                   f"{part.round_minutes:g} min: nominal MinS {slots - 1}; "
                                   f"enforced MinS {mins}")
    elif part.mode == "uniform" and mins > 0:
        setting["timer_min_separation"] = mins
        setting["timer_period"] = f"no timer here: uniform sampling, enforced MinS {mins}"
    return setting


def noise_statement(cfg: SimulationConfig) -> str:
    """How the DP noise was drawn; in research mode, that the guarantee is void for seed holders."""
    if cfg.dp.noise_seed >= 0:
        return (f"RESEARCH MODE (dp.noise_seed = {cfg.dp.noise_seed}): the DP guarantee below does "
                "NOT hold against anyone who knows the noise seed: they can rebuild and subtract "
                "all the noise.")
    return ("Noise: AES-256-CTR keystream under a secret 256-bit key drawn for this run from the "
            "OS CSPRNG (never derived from the seed, never stored with the released model).")


def noise_fields(cfg: SimulationConfig, ring: RingPlan | None = None, mechanism: str | None = None) -> dict:
    """Which noise the run used, for privacy.json and summary.json: the mechanism in words,
    whether the guarantee needs every participant honest, and the ring's discretization."""
    noise = resolve_noise(cfg)
    fields = {"noise_kind": noise,
              "noise_mechanism": noise_mechanism(noise, cfg.aggregation.kind == "secagg",
                                                 mechanism or cfg.dp.mechanism),
              "honest_participants_only": honest_participants_only(cfg)}
    if fields["honest_participants_only"]:
        fields["honest_participants_only_statement"] = HONEST_ONLY
    if ring is not None:
        from dpfleet.coordinator.mechanisms.ring_noise import ring_summary

        fields["ring"] = ring_summary(ring, cfg.aggregation.bits, cfg.dp.clip_norm)
    return fields


def generated_population_statement(cfg: SimulationConfig) -> str:
    return (f"GENERATED POPULATION (data.generated_population = {cfg.data.generated_population:,}): "
            "the clients are real users cycled to that size, so users repeat and each copy is "
            "accounted as a different person. The epsilon below is NOT a guarantee for any real "
            "person in this run; the run measures speed and memory only.")


def _accounting_words(accountant: RunAccountant, cfg: SimulationConfig) -> str:
    """privacy.json's `accounting`: what the figures are, in words."""
    mechanism = accountant.mechanism
    conversion = {"pld": "epsilon by PLD of the Gaussian mechanism, epsilon_rdp by RDP",
                  "rdp": "epsilon and epsilon_rdp by RDP (valid for any rho-zCDP mechanism; the "
                         "Gaussian PLD is no bound for discrete or undeclared noise)"}[accountant.conversion]
    words = (f"rho-zCDP of DP-FTRL with {mechanism.name} noise: rho = sens^2 / (2 z^2), sens^2 the "
             "worst case over every participation pattern with the observed MinS / MaxP (zero-out, "
             "device level)" + ("; segments (restarts) included" if accountant.restarts else ""))
    if accountant.declared:
        words += "; sens^2 AS DECLARED by the custom mechanism (not derived by dpfleet)"
    if cfg.dp.adaptive_clipping:
        words += ("; adaptive clipping: model noise z_delta and clipped-count noise 2 sigma_b on the "
                  "same strategy are one mechanism of multiplier z (1 / z^2 = 1 / z_delta^2 + "
                  "1 / (2 sigma_b)^2, paper 002 Thm. 1)")
    return f"{words}; {conversion}"


def run_privacy(cfg: SimulationConfig, participation: EnforcedParticipation, accountant: RunAccountant,
                population: int, *, model_noise_multiplier: float, stopped_early: str | None,
                optimised_for: dict, vocabulary: dict | None = None, public_data: Sequence[str] = (),
                ring: RingPlan | None = None, debug_file: bool = False,
                releases: Sequence[dict] = ()) -> dict:
    """The run's privacy summary (privacy.json; `privacy_report.render_privacy_report` renders it)
    for any mechanism, from the accountant's observed participation. Writes nothing.

    `optimised_for`: the MinS / MaxP the config enforces (`mechanism_binding`), for the enforced
    worst case over the planned rounds; `vocabulary`: the DP word vocabulary's summary
    (dp_vocabulary.py; the accountant composes the one it was given into its ledger);
    `public_data`: public data the caller trained on (listed, not accounted); `ring`: the ring
    noise's plan; `debug_file`: un-noised telemetry was written (listed as not covered);
    `releases`: other DP releases about the same devices ({name, zcdp, delta, what}, e.g. FreD
    statistics), composed with training and the vocabulary. privacy.json's "ledger" holds
    every release as a DpEvent, and every figure here is its conversion (`accounting.ledger`)."""
    setting = _report_setting(cfg, participation, max(accountant.rounds, 1), population,
                              public_data)
    mechanism = accountant.mechanism
    privacy = {
        "accounting": _accounting_words(accountant, cfg),
        "participation": cfg.participation.mode,
        "min_separation_enforced": participation.min_separation,
        "max_participation_enforced": cfg.participation.max_participation or None,
        "model_noise_multiplier": model_noise_multiplier,
        "planned_rounds": cfg.rounds,
        "budget_epsilon": cfg.dp.budget_epsilon or None,
        "stopped_early": stopped_early,
        **{k: v for k, v in setting.items() if k not in ("rounds", "noise")},
        # the multiplier of the noise on the actual sum (z M_train / M_noise in a projection)
        "noise_multiplier": accountant.noise_multiplier,
        "method": accountant.conversion,
        "not_covered": not_covered(cfg, public_data=_public_data(cfg, public_data), debug_file=debug_file),
        "vocabulary": vocabulary,
        "nonprivate_vocabulary": nonprivate_vocabulary(cfg),
        "vocabulary_source": vocabulary_source(cfg),
        "mechanism": mechanism.name, "mechanism_sha256": mechanism.fingerprint(),
        "mechanism_identity": mechanism.identity(), "mechanism_description": mechanism.describe(),
        "mechanism_optimised_for": optimised_for, "adapts_every_round": mechanism.adapts_every_round,
        "accounted_by_dpfleet": not accountant.declared,
        "mechanism_source": source(mechanism),  # built-in, plugin or custom (caveats.py)
        "rounds": accountant.rounds,
        "min_separation": accountant.min_separation,
        "max_participation": accountant.max_participation,
        "restarts": accountant.restarts,
        "noise_segments": 1 + len(accountant.restarts),  # fresh noise segments (restarts, crashes)
        "noise": noise_statement(cfg),
        "noise_seed": cfg.dp.noise_seed if cfg.dp.noise_seed >= 0 else None,
        "guarantee_holds_against_seed_holders": cfg.dp.noise_seed < 0,
        "debug_nonprivate_file": debug_file,
        **noise_fields(cfg, ring, mechanism.name),
    }
    if mechanism.name in ("banded", "blt"):  # what `dpfleet account --mechanism-spec` reads
        privacy["mechanism_spec"] = mechanism.identity()
    if cfg.data.generated_population:
        privacy["generated_population"] = {"clients": cfg.data.generated_population,
                                           "users_repeat": True, "epsilon_is_a_guarantee": False,
                                           "statement": generated_population_statement(cfg)}
    projection = projected_privacy(cfg, mechanism, accountant.conversion, accountant.restarts)
    if projection is not None:  # the planned launch's figures, labelled: never this run's
        privacy["projection"] = projection
    ledger = accountant.ledger(releases)
    privacy["ledger"] = ledger.to_json(accountant.delta, accountant.conversion)
    if accountant.rounds == 0 or cfg.dp.noise_multiplier == 0:
        eps = 0.0 if accountant.rounds == 0 else math.inf
        privacy.update(zcdp=eps, epsilon=eps, epsilon_rdp=eps, timer_worst_case=None)
        return privacy
    privacy.update(accountant.figures())
    privacy["timer_worst_case"] = accountant.enforced_figures(
        cfg.rounds, optimised_for["min_separation"], optimised_for["max_participation"])
    total = accountant.with_vocabulary()
    if total is not None:
        privacy["total_with_vocabulary"] = total
    if releases:
        privacy["other_releases"] = list(releases)
        privacy["total_with_releases"] = ledger.total(accountant.delta, accountant.conversion)
    return privacy
