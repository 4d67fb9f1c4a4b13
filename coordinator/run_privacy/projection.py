"""A projection to a production-size population: the planned mechanism's eps beside the run's own.

pfl-research estimates a launch's accuracy on a laptop by training a small cohort and adding the
noise of the large one (its `noise_cohort_size`: the noise on the sum is scaled by
cohort_size / noise_cohort_size, its accountant's `noise_scale`, and the accountant is run for
the noise cohort over the planned population; its StackOverflow benchmark trains 400 and adds the
noise of 5,000 at a population of 10^6). A `[projection]` run does the same
(`config.projection_factor`), and so has two privacy figures that must never be confused:

* the *projected* one: the planned mechanism, multiplier z (dp.noise_multiplier) on cohorts of
  M_noise over the planned population N, accounted as the planner and the run's accountant
  would for that launch (MinS = N // M_noise - 1, the worst-case MaxP over the planned rounds, or
  the MinS and MaxP cap a plan over an availability trace enforces (`projection.min_separation`,
  `max_participation`),
  the run's mechanism's sens^2, the run's zCDP-to-eps conversion). It is a simulation of DP at
  population N: nobody in this run is protected by it.
* the run's *own* guarantee: its actual noise on its actual sum, multiplier z M_train / M_noise,
  over its real users and their observed participation. privacy.json's top-level figures, the
  metrics log's eps and the Result's are this one; the projection is a block labelled `LABEL`.
"""

from __future__ import annotations

from collections.abc import Sequence

from dpfleet.coordinator.accounting.ledger import Ledger, mechanism_entry
from dpfleet.coordinator.accounting.planner import capped_max_participation, max_min_separation
from dpfleet.coordinator.config import SimulationConfig, projection_factor
from dpfleet.coordinator.mechanisms.base import Mechanism

REAL = "this run's own guarantee: its actual noise on its actual sum, over its real users"


def projection_label(population: int) -> str:
    """How every projected figure is labelled, wherever it is shown."""
    return f"projection: a simulation of DP at population {population:,}, not a guarantee"


def projected_privacy(cfg: SimulationConfig, mechanism: Mechanism, conversion: str,
                      restarts: Sequence[int] = ()) -> dict | None:
    """The planned launch's figures (module docstring), for privacy.json's `projection` block;
    None without a projection."""
    proj, dp = cfg.projection, cfg.dp
    if not proj.noise_cohort:
        return None
    mins = (proj.min_separation if proj.min_separation >= 0
            else max_min_separation(proj.population, proj.noise_cohort))
    maxp = capped_max_participation(cfg.rounds, mins, proj.max_participation)
    s = mechanism.sensitivity_squared(cfg.rounds, mins, maxp, list(restarts))
    # the one-entry ledger of the mechanism's own event for the planned launch's participation
    entry = mechanism_entry(mechanism, dp.noise_multiplier, s, (cfg.rounds, mins, maxp, restarts))
    planned = Ledger((entry,))
    return {
        "label": projection_label(proj.population), "epsilon_is_a_guarantee": False,
        "population": proj.population, "noise_cohort": proj.noise_cohort, "train_cohort": dp.report_goal,
        "noise_multiplier": dp.noise_multiplier, "noise_scale": projection_factor(cfg),
        "rounds": cfg.rounds, "min_separation": mins, "max_participation": maxp,
        "sensitivity_squared": s, "zcdp": planned.zcdp, "delta": dp.delta, "method": conversion,
        "epsilon": planned.epsilon(dp.delta, conversion),
    }


def projection_summary(privacy: dict) -> dict | None:
    """summary.json's `projection`: the projected figures and the run's own, each saying what it
    is (None without a projection)."""
    p = privacy.get("projection")
    if p is None:
        return None
    keys = ("epsilon", "zcdp", "delta", "noise_multiplier")
    return {"label": p["label"],
            "projected": {"what": p["label"], "population": p["population"],
                          "cohort": p["noise_cohort"], **{k: p[k] for k in keys}},
            "real": {"what": REAL, "population": privacy["population"], "cohort": privacy["report_goal"],
                     **{k: privacy.get(k) for k in keys}}}


def projection_caveat(projection: dict) -> tuple[str, str]:
    """(reason, statement) for `caveats.run_caveats`: the run's eps holds as stated, the projected
    one is no guarantee (kept, not voiding)."""
    label = projection["label"]
    return (f"projection to a population of {projection['population']:,} (its eps is a simulation)",
            f"{label[0].upper()}{label[1:]}. The run trained {projection['train_cohort']} devices a "
            f"round with the noise of {projection['noise_cohort']} (noise scaled by "
            f"{projection['noise_scale']:g}); its projected eps estimates that launch. The eps stated "
            "as this run's is its own guarantee, for its real users.")
