"""What keeps a run from being fully private, said first wherever the run is shown.

`run_caveats` reads a run's facts (the fields privacy.json holds, or `config_facts` for a service
that has only its config) and returns the caveats: a short first line naming every reason, then
each reason's longer statement. `with_caveats` puts them into the run's privacy summary, from
which privacy.json and summary.json (`caveats`, `fully_private`), the first lines of
privacy_report.md (the one renderer), the `dpfleet simulate` summary and the service's status
page all show that one list, so they cannot disagree and none opens with a DP statement the run
lacks.

Whether the stated eps is a guarantee at all:

* kept, caveat first: a projection (`projection.py`: the stated eps is the run's own, its
  projected eps a labelled simulation), research mode (it holds against everyone without the
  seed), honest-only noise (it holds when every participant is honest), a custom or plugin
  mechanism's declared sensitivity (dpfleet converts it but cannot verify it; a mechanism that
  declares none is refused), a word vocabulary chosen without DP and un-noised debug telemetry (eps covers the
  model's training, not these: they ship or sit beside it);
* none: a deliberately broken audit run (`dpfleet audit --break`: its noise or clipping is not
  what the accountant assumes), a generated population (users repeat, each copy accounted as a
  different person), noise multiplier 0.
  privacy.json's epsilon, epsilon_rdp and zcdp are then null (inf in memory, as for no noise) and
  the accountant's figures move to `accounted_not_a_guarantee`, which the audit compares against.
"""

from __future__ import annotations

import math

from dpfleet.coordinator.run_privacy.projection import projection_caveat

FIGURES = ("epsilon", "epsilon_rdp", "zcdp")  # what privacy.json states as the guarantee


def broken_reason(audit_break: dict) -> str:
    """The reason a broken audit run is not private (also the checkpoint's refusal)."""
    return f"deliberately broken audit run (--break {audit_break['mode']})"


def run_caveats(facts: dict) -> tuple[list[str], bool]:
    """(caveats, whether the stated eps is a guarantee): [] and True for a fully private run, else
    a short first line naming every reason (those that void eps first), then the statements."""
    voiding, keeping = [], []  # (reason, statement)
    if facts.get("audit_break"):
        b = facts["audit_break"]
        voiding.append((broken_reason(b), f"DELIBERATELY BROKEN RUN (--break {b['mode']}): {b['what']}. "
                                          "Its model is not private (audit only) and its checkpoint "
                                          "does not export."))
    if facts.get("accounted_by_dpfleet") is False:
        name = facts.get("mechanism")
        if facts.get("mechanism_source") == "plugin":
            keeping.append((f"eps as declared by the plugin {name!r}, not verified by dpfleet",
                            f"DECLARED ACCOUNTING: the noise mechanism {name!r} is an installed plugin "
                            f"(entry point group 'dpfleet.mechanisms'), not one dpfleet ships: it "
                            "declared its sensitivity; dpfleet converted it to eps (by RDP) and "
                            "cannot verify it."))
        else:
            keeping.append(("eps as declared by the custom mechanism, not verified by dpfleet",
                            f"DECLARED ACCOUNTING: the custom noise mechanism {name!r} declared its "
                            "sensitivity; dpfleet converted it to eps (by RDP) and cannot verify it."))
    if facts.get("generated_population"):
        voiding.append(("generated population (real users repeat as several clients)",
                        facts["generated_population"]["statement"]))
    if facts.get("noise_multiplier") == 0 and facts.get("rounds") != 0:  # 0 rounds: nothing released
        voiding.append(("no noise (dp.noise_multiplier = 0)",
                        "NO DP NOISE: dp.noise_multiplier = 0, so the run is not differentially "
                        "private (eps = inf)."))
    if facts.get("noise_seed") is not None:
        keeping.append((f"research mode (dp.noise_seed = {facts['noise_seed']})", facts["noise"]))
    if facts.get("nonprivate_vocabulary"):
        keeping.append(("non-private vocabulary (tokenizer.allow_nonprivate_vocabulary = true)",
                        "NON-PRIVATE VOCABULARY: the word vocabulary was chosen from the training "
                        "clients' text without DP. A word only one client wrote can be in it, and it "
                        "ships with the checkpoint and every export; eps covers the model's training "
                        "only."))
    if facts.get("debug_nonprivate_file"):
        keeping.append(("un-noised debug telemetry (debug_nonprivate = true)",
                        "UN-NOISED TELEMETRY: debug_nonprivate.jsonl holds each round's mean train "
                        "loss, update norm and clipped fraction of its few clients without noise; "
                        "eps does not cover it: never publish it."))
    if facts.get("projection"):  # the run's eps holds; the projected one is a simulation
        keeping.append(projection_caveat(facts["projection"]))
    if facts.get("honest_participants_only"):
        keeping.append(("private only against honest participants",
                        facts["honest_participants_only_statement"]))
    reasons = voiding + keeping
    if not reasons:
        return [], True
    names = "; ".join(r for r, _ in reasons)
    first = (f"NOT PRIVATE: {names}: the stated eps is no guarantee" if voiding else
             f"NOT FULLY PRIVATE: {names}: eps holds only as said below")
    return [first, *(s for _, s in reasons)], not voiding


def config_facts(cfg) -> dict:
    """The facts a config alone gives (what privacy.json would say of them), for a service that
    shows a run before it has a privacy.json. Its mechanism is known by name: a plugin's (not one
    dpfleet ships) is declared."""
    from dpfleet.coordinator.mechanisms.registry import source
    from dpfleet.coordinator.run_privacy.not_covered import nonprivate_vocabulary
    from dpfleet.coordinator.run_privacy.run_accountant import (
        generated_population_statement,
        noise_fields,
        noise_statement,
    )

    mechanism = cfg.dp.mechanism
    # "auto" not yet planned: a plugin only with dp.auto_plugins (then said, to be safe)
    auto = "plugin" if cfg.dp.auto_plugins else "built-in"
    kind = auto if mechanism == "auto" else source(mechanism)
    facts = {**noise_fields(cfg), "noise": noise_statement(cfg),
             "noise_seed": cfg.dp.noise_seed if cfg.dp.noise_seed >= 0 else None,
             "mechanism": mechanism, "mechanism_source": kind, "accounted_by_dpfleet": kind == "built-in",
             "nonprivate_vocabulary": nonprivate_vocabulary(cfg),
             "debug_nonprivate_file": bool(cfg.debug_nonprivate)}
    if not cfg.dp.target_epsilon:  # a planned run's multiplier is chosen later, never 0
        facts["noise_multiplier"] = cfg.dp.noise_multiplier
    if cfg.data.generated_population:
        facts["generated_population"] = {"statement": generated_population_statement(cfg)}
    return facts


def caveat_fields(facts: dict) -> dict:
    """`fully_private` and `caveats`, for summary.json and the service's public status."""
    caveats, _ = run_caveats(facts)
    return {"fully_private": not caveats, "caveats": caveats}


def with_caveats(privacy: dict, audit_break: dict | None = None) -> dict:
    """The run's privacy summary with `fully_private`, `caveats` and, where eps is no guarantee,
    its figures moved to `accounted_not_a_guarantee` (inf in memory, null in privacy.json)."""
    privacy = dict(privacy)
    if audit_break:
        privacy["audit_break"] = audit_break
    caveats, guarantee = run_caveats(privacy)
    if not guarantee:  # every eps privacy.json states moves out of the way
        moved = dict(privacy.get("accounted_not_a_guarantee") or {})
        stated = {k: privacy.get(k) for k in FIGURES}
        if any(isinstance(v, int | float) and math.isfinite(v) for v in stated.values()):
            moved.update(stated)
        if privacy.get("total_with_vocabulary") is not None:
            moved["total_with_vocabulary"] = privacy.pop("total_with_vocabulary")
        if privacy.get("timer_worst_case") is not None:
            moved["timer_worst_case"], privacy["timer_worst_case"] = privacy["timer_worst_case"], None
        if moved:
            privacy["accounted_not_a_guarantee"] = moved
        privacy.update(dict.fromkeys(FIGURES, math.inf))  # strict JSON: null
    privacy.update(fully_private=not caveats, epsilon_is_a_guarantee=guarantee, caveats=caveats)
    return privacy
