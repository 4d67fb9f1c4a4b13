"""A result that means nothing says so: the warnings of a run, one line each.

Why: a run can finish normally and still mean nothing, a model no better than word counts, a
guarantee too weak to protect anyone, noise that drowns every update, and a newcomer reads the
numbers as a result. Each warning is one line that opens with what is wrong, built here once and
shown the same everywhere: a `warning:` line in the log at plan time (the noise, before any
training), a `WARNING` line in the `dpfleet simulate` summary (after the caveats), `warnings` in
summary.json (the simulation's and the service's, `RoundEngine.finish`) and `Result.warnings`.

* "noise drowns the updates" (also at plan time, before any training): z / M (noise multiplier
  z over report goal M, or over projection.noise_cohort in a projection: the noise std on every
  round's averaged update, in clip norms) at or above
  `NOISE_PER_REPORT_LIMIT`, where the main job stops learning (measured, see there).
* "below the unigram baseline": held-out accuracy at or below the unigram baseline's (a model
  that predicts every token by its frequency alone, fitted on other held-out users).
* "eps above dp.warn_epsilon": eps (with the DP vocabulary or other releases when the run has
  them) above `dp.warn_epsilon` (default 10; 0 turns it off).

A budget that stops the run before round 1 is no warning but an error
(`RunAccountant.check_first_round`). A run whose eps is no guarantee at all (no noise, research
mode, a generated population, a broken audit) says so in its caveats (`caveats.py`), not here.
"""

from __future__ import annotations

import math

from dpfleet.coordinator.config import SimulationConfig

# z / M from which a run learns nothing. Measured on the main job with only dp.target_epsilon
# changed (benchmarks/noise_limit.py, results/noise_limit.json: M stays 319, z grows; unigram 0.073):
#   eps     8       2      1      0.7    0.5     0.3     0.1     0.03
#   z / M   0.0062  0.021  0.040  0.056  0.076   0.12    0.34    1.06
#   acc.    0.200   0.167  0.123  0.058  0.0025  0.0022  0.0013  0.0005
# (a second seed of 1 / 0.7 / 0.5: 0.114 / 0.054 / 0.002). Below the unigram baseline from 0.056
# on, the pretrained model wrecked (perplexity 6e10 to e^50) from 0.076: the limit sits between
# the last z / M that learned and the first that did not.
NOISE_PER_REPORT_LIMIT = 0.05


def plan_warnings(cfg: SimulationConfig) -> list[str]:
    """What the config's noise already says before any training (with a target eps: the plan's
    z and M, so call it once the plan is in `cfg`)."""
    dp = cfg.dp
    if dp.noise_multiplier <= 0 or dp.report_goal <= 0:
        return []
    # a projection's average carries z / M_noise (`config.projection_factor`), not z / M_train
    cohort, name = ((cfg.projection.noise_cohort, "projection.noise_cohort") if cfg.projection.noise_cohort
                    else (dp.report_goal, "report goal"))
    per_report = dp.noise_multiplier / cohort
    if per_report < NOISE_PER_REPORT_LIMIT:
        return []
    return [f"noise drowns the updates: noise multiplier / {name} = {dp.noise_multiplier:.4g} / "
            f"{cohort} = {per_report:.3g} (the noise std on each round's averaged update, in "
            f"clip norms) is at or above {NOISE_PER_REPORT_LIMIT:g}, where the main job stops "
            "learning (measured: 0.056 ends below the unigram baseline, 0.040 does not); raise the "
            "target eps or the report goal"]


def result_warnings(cfg: SimulationConfig, final: dict, baseline: dict, privacy: dict) -> list[str]:
    """Every warning of a finished run: the plan's, then the model's, then the guarantee's."""
    warnings = plan_warnings(cfg)
    accuracy, unigram = final.get("accuracy"), baseline.get("accuracy")
    if _finite(accuracy) and _finite(unigram) and accuracy <= unigram:
        warnings.append(f"below the unigram baseline: held-out accuracy {accuracy:.4f} <= "
                        f"{unigram:.4f}, the model predicts no better than word frequencies alone, "
                        "so this run learned nothing usable")
    eps, what = _headline_epsilon(privacy)
    if "projection" in privacy:  # never read as the projected launch's eps
        what += " (this run's own; the projected eps is a simulation)"
    limit = cfg.dp.warn_epsilon
    if limit > 0 and _finite(eps) and eps > limit:
        warnings.append(f"eps above dp.warn_epsilon: eps = {eps:.2f}{what} at delta = "
                        f"{privacy.get('delta', cfg.dp.delta):g} > {limit:g}, a guarantee this weak "
                        "says little about any one user; lower the target eps (more noise, more "
                        "devices per round or fewer rounds)")
    return warnings


def _headline_epsilon(privacy: dict) -> tuple[float | None, str]:
    """The eps the run's guarantee stands at: with every other release about the same devices."""
    for key, what in (("total_with_releases", " (with the other releases)"),
                      ("total_with_vocabulary", " (with the DP vocabulary)")):
        if isinstance(privacy.get(key), dict):
            return privacy[key].get("epsilon"), what
    return privacy.get("epsilon"), ""


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
