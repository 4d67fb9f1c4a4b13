"""`privacy_report.md` of a run, in the shape of paper 002 App. C (Ponomareva et al. 2023, 5.3):
the ONE renderer of a run's privacy, for every mechanism.

`render_privacy_report(privacy)` turns the run's privacy summary (the dict `run_accountant.
run_privacy` computes and privacy.json holds) into markdown; it reads no file and writes none (the
engine writes the run directory; the service renders its live report from the same dict).
Mechanism-specific words come from the summary (`mechanism_description`, `accounting`), never from
a second writer.
"""

from __future__ import annotations

import math

from dpfleet.coordinator.accounting.zcdp import MIN_SEPARATION_CONVENTION
from dpfleet.coordinator.mechanisms.registry import ring_is_rounded

HONEST_ONLY = ("PRIVATE ONLY AGAINST HONEST PARTICIPANTS: the noise is continuous Gaussian added "
               "after decoding the secure-aggregation sum (dp.noise = \"gaussian\" with "
               "aggregation.kind = \"secagg\"). A dishonest co-participant can park the ring sum "
               "at its wrap, where one honest device's small update moves the decoded release by "
               "about 2^bits / scale per coordinate, far beyond the sensitivity the noise is "
               "calibrated for. The statement below holds only if every participant is honest; "
               "the default (dp.noise = \"auto\") puts discrete noise in the ring instead.")


RING_MF_MECHANISM = "matrix-factorization Gaussian, rounded, in the SecAgg ring"  # `mf_ring`


def noise_mechanism(noise: str, secagg: bool, mechanism: str = "tree") -> str:
    """Where the noise was added, in the words every output uses. In the ring, a mechanism whose
    ring form is its continuous Gaussian rounded (`Mechanism.ring_is_rounded_gaussian`: banded /
    blt, `mf_ring`) says so; the others add a discrete Gaussian."""
    if noise == "discrete":
        return RING_MF_MECHANISM if ring_is_rounded(mechanism) else "discrete Gaussian in the SecAgg ring"
    return "continuous Gaussian after decoding" if secagg else "continuous Gaussian on the plain sum"


def honest_only(noise: str, secagg: bool) -> bool:
    """Whether the guarantee needs every participant honest (continuous noise after SecAgg)."""
    return secagg and noise != "discrete"


UNITS = {
    "device": "Device-level DP: adjacency concerns everything one client device contributes "
              "(its local dataset may be arbitrarily large). For a user with a single device "
              "this is user-level DP; for a shared device it is stronger; for a user whose "
              "several devices all take part it is weaker (group privacy then gives a "
              "user-level bound).",
    "user": "User-level DP: adjacency concerns everything one user contributes across all of "
            "their devices (each participation is one device's update of that user).",
}
ADJACENCY_TEXT = {
    "zero-out": "Zero-out (Kairouz et al. 2021): a special form of add/remove in which an "
                "absent device's model update is replaced by the all-zeros vector, so "
                "neighbouring datasets have the same number of records.",
    "replace-one": "Replace-one: a device's data is swapped for arbitrary other data; each "
                   "contribution can move by twice the clip norm (4x the squared sensitivity).",
}




def _participation_sentence(p: dict) -> str:
    """How participation was bounded: by device timers, or by selecting each device once."""
    if p.get("timer_min_separation") is None:
        return ("No timer was configured: the bound is what the participation log shows "
                "(with disjoint selection, each device at most once).")
    period = f" ({p['timer_period']})" if p.get("timer_period") else ""
    return (f"Participation is limited by a timer on each device{period} and the coordinator "
            "refuses a device that would break MinS.")


def _cell(result: dict | None, key: str, fmt: str = "{}") -> str:
    if result is None:
        return "-"
    value = result.get(key)
    if value is None:
        return "none" if key != "min_separation" else "n/a (no device took part twice)"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    return fmt.format(value)


def _ring_lines(p: dict) -> list[str]:
    """The discretization behind ring noise: the bound it is calibrated to."""
    ring = p.get("ring")
    if not ring or p.get("noise_kind") != "discrete":
        return []
    return [f"Discretization: a {ring['bits']}-bit ring sized for {ring['ring_clients']} clients, "
            f"scale s = {ring['scale']:.6g}; one device's rounded vector has L2 norm <= Delta_s = "
            f"{ring['delta_s']:.6g} (the clip norm's s C = {ring['scaled_clip']:.6g} inflated by "
            f"conditional randomized rounding, factor {ring['norm_inflation']:.6g}); the noise "
            f"variance is sigma^2 = {ring['sigma_sq']} >= (z Delta_s)^2, rounded up to an "
            f"integer (effective z = sigma / Delta_s = {ring['effective_z']:.6g}). The accounting "
            "uses the configured z, which this sigma meets; rounding, the modular reduction and "
            "decoding are post-processing, so a co-participant parking the sum at the ring's wrap "
            "gains nothing.", ""]


def _statement(p: dict) -> str:
    if p["rounds"] == 0:
        return "No round ran, so nothing about any device was released (eps = 0)."
    if p["noise_multiplier"] == 0:
        return "None: the noise multiplier is 0, so the run is not differentially private (eps = inf)."
    if not p.get("epsilon_is_a_guarantee", True):
        return "None: this run states no DP guarantee (see the first lines)."
    declared = (f", AS DECLARED by the custom noise mechanism {p['mechanism']!r}: dpfleet converted "
                "its declared sensitivity and cannot verify it" if not p["accounted_by_dpfleet"] else "")
    return (f"This training run satisfies rho-zCDP with rho = {p['zcdp']:.4g} (device-level, "
            f"zero-out adjacency; from observed participation), hence (eps, delta)-DP with eps = "
            f"{p['epsilon']:.4g} at delta = {p['delta']:g}{declared}.")


def _projection_lines(p: dict) -> list[str]:
    """A projection's planned launch, under its label: never the formal statement above (the run's
    own guarantee, `projection.py`)."""
    q = p.get("projection")
    if not q:
        return []
    return [f"**{q['label']}.** The planned mechanism (noise multiplier {q['noise_multiplier']:g} on "
            f"cohorts of {q['noise_cohort']:,} over {q['population']:,} devices, {q['rounds']} rounds, "
            f"MinS {q['min_separation']:,}, MaxP {q['max_participation']}) would give rho = "
            f"{q['zcdp']:.4g}, eps = {q['epsilon']:.4g} at delta = {q['delta']:g} "
            f"({q['method'].upper()}). This run trained {q['train_cohort']:,} devices a round with "
            f"that noise scaled by {q['noise_scale']:g}: the statement above is its own guarantee "
            "(multiplier z times that scale, on its real users).", ""]


def render_privacy_report(p: dict) -> str:
    """Markdown in the shape of paper 002 App. C from the run's privacy summary."""
    lines = [*(line for c in p.get("caveats", []) for line in (f"**{c}**", "")), "# Privacy report", "",
             f"**Noise: {p['noise_mechanism']}; {p['mechanism_description']}.**", "",
             f"**Formal statement.** {_statement(p)}", "", *_projection_lines(p)]
    if p["rounds"] == 0 or p["noise_multiplier"] == 0 or not p.get("epsilon_is_a_guarantee", True):
        return "\n".join(lines + _not_covered_section(p) + _audit_section(p))
    return "\n".join(lines + _vocabulary_source_line(p) + _vocabulary_statement(p) + _setting_sections(p)
                     + _accounting_section(p)
                     + _vocabulary_section(p) + _releases_section(p) + _ledger_section(p)
                     + _not_covered_section(p)
                     + _audit_section(p)
                     + _parameters_section(p))


def _setting_sections(p: dict) -> list[str]:
    """App. C sections 1 and 2: who is trusted with what, and what the definition covers."""
    lines = ["## 1. DP setting", "",
             "Central DP: the service provider is trusted to run the mechanism as specified "
             "(clipping every update to the clip norm and adding DP-FTRL's noise)."]
    if p["secagg"]:
        lines.append("Updates were summed with secure aggregation: the server sees only sums "
                     "over at least the report goal's devices. The DP guarantee does not rely "
                     "on it" + (", and holds whatever the other participants send." if
                                p["noise_kind"] == "discrete" else ", but on every participant "
                                "encoding honestly (the noise comes after decoding: see the warning "
                                "above)."))
    return lines + _ring_lines(p) + [
        "",
        "## 2. Instantiating the DP definition",
        "",
        "- (a) *Data accesses covered*: every participation of every well-behaved device in "
        "this single training run. Hyperparameter tuning is not accounted."
        + (f" Public data ({p['public_data']}) is not private and not covered."
           if p.get("public_data") else ""),
        "- (b) *Final mechanism output*: the full sequence of noised releases, so every "
        "intermediate model (including those sent to devices) is protected, not only the "
        "final checkpoint.",
        f"- (c) *Unit of privacy*: {UNITS['device']}",
        f"- (d) *Adjacency*: {ADJACENCY_TEXT['zero-out']}",
        "",
    ]


def _accounting_section(p: dict) -> list[str]:
    """App. C section 3: the accounting, observed against what the config enforces."""
    obs, enforced = p, p.get("timer_worst_case")
    lines = [
        "## 3. Privacy accounting details",
        "",
        f"- (a) *Type of accounting*: {p['accounting']}.",
        f"- (b) *Accounting assumptions*: each device takes part at most MaxP times with at "
        f"least MinS rounds between two participations (MinS counts the {MIN_SEPARATION_CONVENTION}"
        "). " + _participation_sentence(p),
        f"- (c) *Formal DP statement*: rho = {p['zcdp']:.4g}; eps = {p['epsilon']:.4g} "
        f"at delta = {p['delta']:g}.",
        "",
        "| | observed (participation log) | enforced by the config |",
        "|---|---|---|",
        f"| rounds | {_cell(obs, 'rounds')} | {_cell(enforced, 'rounds')} |",
        f"| MinS | {_cell(obs, 'min_separation')} | {_cell(enforced, 'min_separation')} |",
        f"| MaxP | {_cell(obs, 'max_participation')} | {_cell(enforced, 'max_participation')} |",
        f"| restarts (fresh noise segments) | {_cell(obs, 'restarts')} | {_cell(enforced, 'restarts')} |",
        f"| sensitivity^2 (C^2) | {_cell(obs, 'sensitivity_squared', '{:.6g}')} | "
        f"{_cell(enforced, 'sensitivity_squared', '{:.6g}')} |",
        f"| zCDP rho | {_cell(obs, 'zcdp', '{:.4g}')} | {_cell(enforced, 'zcdp', '{:.4g}')} |",
        f"| eps at delta = {p['delta']:g} | {_cell(obs, 'epsilon', '{:.4g}')} | "
        f"{_cell(enforced, 'epsilon', '{:.4g}')} |",
        "",
    ]
    if (enforced and obs["min_separation"] is not None
            and obs["min_separation"] < enforced["min_separation"]):
        lines += [f"**Warning**: the observed MinS ({obs['min_separation']}) is below the "
                  f"enforced one ({enforced['min_separation']}): participation was not limited as "
                  "configured; the observed figures are the valid ones.", ""]
    return lines


def _parameters_section(p: dict) -> list[str]:
    adaptive = ("yes (clip norm adopted every round)" if p.get("adapts_every_round") else
                "yes (clip norm adopted at restarts)") if p["adaptive_clipping"] else "no"
    return [
        "## Parameters",
        "",
        "| parameter | value |",
        "|---|---|",
        f"| mechanism | {p['mechanism']} |",
        f"| mechanism fingerprint | {p['mechanism_sha256'][:16]} |",
        f"| noise multiplier z | {p['noise_multiplier']:g} |",
        f"| clip norm | {'-' if p.get('clip_norm') is None else p['clip_norm']} |",
        f"| adaptive clipping | {adaptive} |",
        f"| report goal | {'-' if p.get('report_goal') is None else p['report_goal']} |",
        f"| population | {'-' if p.get('population') is None else p['population']} |",
        f"| secure aggregation | {'yes' if p['secagg'] else 'no'} |",
        f"| noise | {p['noise_mechanism']} |",
        "| unit / adjacency | device / zero-out |",
        f"| accounting | zCDP; eps by {p['method']} |",
        "",
    ]


def _vocabulary_source_line(p: dict) -> list[str]:
    """One line: where the vocabulary came from and whether the statement covers it."""
    v = p.get("vocabulary_source")
    if not v:  # a privacy.json written before the field existed
        return []
    covered = {True: "covered", False: "NOT covered", None: "covered only if it was public"}[v["covered"]]
    return [f"**Vocabulary:** {v['source']}; {covered} (privacy cost: {v['privacy_cost']}).", ""]


def _vocabulary_statement(p: dict) -> list[str]:
    total = p.get("total_with_vocabulary")
    if p.get("nonprivate_vocabulary"):
        return ["**Warning: the word vocabulary was built from the private training clients "
                "without DP** (tokenizer.allow_nonprivate_vocabulary = true). It ships with the "
                "model and is not covered by this statement: a word used by one client can be "
                "in it.", ""]
    if total is None:
        return []
    return [f"**With the DP vocabulary** the run as a whole (vocabulary + training) satisfies "
            f"rho = {total['zcdp']:.4g} zCDP on the Gaussian parts and (eps, delta)-DP with "
            f"eps = {total['epsilon']:.4g} at delta = {total['delta']:.4g} (dp.delta "
            f"{p['delta']:g} + the vocabulary's thresholding delta {p['vocabulary']['delta']:g}). "
            "See 'Vocabulary'.", ""]


def _vocabulary_section(p: dict) -> list[str]:
    total = p.get("total_with_vocabulary")
    if total is None:
        return []
    v = p["vocabulary"]
    return [
        "## Vocabulary (DP partition selection)",
        "",
        f"The word vocabulary was chosen with {v['mechanism']}: each client contributes at most "
        f"k = {v['words_per_user']} distinct words with weight 1/sqrt(k) (L2 norm <= 1), "
        f"Gaussian noise sigma = {v['noise']:g} is added to each word's weight, and a word is "
        f"kept if its noisy weight passes {v['threshold']:.4g}, chosen so that words only one "
        f"client used are kept with probability <= {v['delta']:g}. {v['kept']} of "
        f"{v['candidates']} candidate words were kept. Gaussian mechanisms compose by adding "
        "zCDP (exactly, through their PLD); the thresholding delta adds to delta.",
        "",
        "| part | zCDP rho | eps | delta |",
        "|---|---|---|---|",
        f"| vocabulary (Gaussian part) | {v['zcdp']:.4g} | {total['vocabulary_epsilon']:.4g} | "
        f"{p['delta']:g} |",
        f"| vocabulary (thresholding) | - | 0 | {v['delta']:g} |",
        f"| DP-FTRL training | {p['zcdp']:.4g} | {p['epsilon']:.4g} | {p['delta']:g} |",
        f"| **total** | **{total['zcdp']:.4g}** | **{total['epsilon']:.4g}** | "
        f"**{total['delta']:.4g}** |",
        "",
        "The per-round `epsilon` / `zcdp` in metrics.jsonl are the training part only.",
        "",
    ]


def _releases_section(p: dict) -> list[str]:
    """Other DP releases about the same devices (FreD statistics, ...), composed with training."""
    total = p.get("total_with_releases")
    if total is None:
        return []
    rows = [f"| {r['name']} | {r['zcdp']:.4g} | {r.get('delta', 0.0):g} | {r.get('what', '')} |"
            for r in p["other_releases"]]
    return ["## Other DP releases about the same devices", "",
            "| release | zCDP rho | delta | what |", "|---|---|---|---|", *rows,
            f"| DP-FTRL training | {p['zcdp']:.4g} | {p['delta']:g} | this run |", "",
            f"**All together** (training{', the DP vocabulary' if p.get('vocabulary') else ''} and the "
            f"releases above): rho = {total['zcdp']:.4g} zCDP, (eps, delta)-DP with eps = "
            f"{total['epsilon']:.4g} at delta = {total['delta']:.4g} (Gaussian mechanisms compose by "
            "adding zCDP; eps by " + p["method"] + ").", ""]


def _ledger_section(p: dict) -> list[str]:
    """privacy.json's ledger (`ledger.Ledger.to_json`): every release as its DpEvent, and their
    composition, which every figure above converts."""
    ledger = p.get("ledger")
    if not ledger:  # a privacy.json written before the ledger
        return []

    def event(e: dict) -> str:
        if e["class_name"] == "ComposedDpEvent":
            return " + ".join(event(x) for x in e["events"])
        fields = ", ".join(f"{k} = {v:.4g}" for k, v in e.items() if k not in ("module_name", "class_name"))
        return f"{e['class_name']}({fields})"

    rows = [f"| {indent}{r['name']} | {event(r['event'])} | {r['zcdp']:.4g} | {r['epsilon']:.4g} | "
            f"{r['delta']:g} |" for e in ledger["entries"]
            for r, indent in [(e, ""), *((x, "- ") for x in e.get("parts", ()))]]
    return ["## Privacy ledger", "",
            "Every release about the devices as a dp_accounting event (privacy.json's `ledger`); "
            f"eps at delta {ledger['epsilon_at_delta']:g} by {ledger['conversion']}.", "",
            "| release | event | zCDP rho | eps | added delta |", "|---|---|---|---|---|", *rows,
            f"| **composed** | | **{ledger['zcdp']:.4g}** | **{ledger['epsilon']:.4g}** | "
            f"**{ledger['delta']:g}** (total) |", ""]


def _not_covered_section(p: dict) -> list[str]:
    if not p.get("not_covered"):
        return []
    return ["## Not covered by the guarantee", "",
            *[f"- {item}" for item in p["not_covered"]], ""]


def _audit_section(p: dict) -> list[str]:
    """`dpfleet audit`'s canaries and estimates (`audit/canaries.py`), when the run was audited."""
    a = p.get("audit")
    if not a:
        return []
    fmt = lambda x: "inf" if x is None or not math.isfinite(x) else f"{x:.3f}"  # noqa: E731
    lines = ["## Empirical audit (`dpfleet audit`)", ""]
    if a["broken"]:
        lines += [f"**{a['broken']['warning']}**: {a['broken']['what']}.", ""]
    lo, hi = a["epsilon_estimate_interval"]
    e, cn = a["exposure"], a["canaries"]
    lines += [
        f"- accounted: eps = {fmt(a['epsilon_accounted'])} at delta = {a['delta']:g} "
        f"({a['mechanism']}, {a['noise']}, aggregation {a['aggregation']})",
        f"- one-shot estimate (Andrew et al. 2024): eps = {fmt(a['epsilon_estimate'])}, "
        f"{a['estimate_confidence']:g} interval [{fmt(lo)}, {fmt(hi)}]",
        f"- all-rounds estimate (max over releases of the cosine with each round's change): eps = "
        f"{fmt(a['all_rounds']['epsilon_estimate'])}, interval "
        f"[{fmt(a['all_rounds']['epsilon_estimate_interval'][0])}, "
        f"{fmt(a['all_rounds']['epsilon_estimate_interval'][1])}]",
        f"- one-run lower bound (Steinke et al. 2023): eps >= {fmt(a['epsilon_lower_bound'])} at "
        f"confidence {a['lower_bound_confidence']:g} ({a['lower_bound_correct']} of "
        f"{a['lower_bound_guesses']} guesses correct)",
        f"- gradient canaries: {cn['directions']} directions, {cn['inserted']} inserted "
        f"({cn['inserted_in_sum']} reached a sum), {cn['unobserved']} unobserved; update "
        f"{cn['update_norm_in_clip_norms']:g} clip norms before clipping",
        f"- text canaries (Secret Sharer): {e['canaries']} ({cn['text_in_sum']} reached a sum), "
        f"exposure median {fmt(e['median_bits'])} bits, max {fmt(e['max_bits'])} bits "
        f"(never-inserted secrets: median {fmt(e['null_median_bits'])}); ranked among "
        f"{e['reference_secrets']} random secrets",
        f"- scored model: the release after round(s) {cn['scored_rounds']} (the last finite one)",
        f"- verdict: {a['verdict']}",
        "",
        "An estimate is not a proof, and a lower bound under the accounted eps is consistent with "
        "it, not a certificate: the audit sees one run and canaries of one shape.",
        "",
    ]
    return lines
