"""`privacy_report.md` of a run, in the shape of paper 002 App. C (Ponomareva et al. 2023, 5.3).

`write_privacy_report(run_dir, setting)` accounts the run from its `participation.jsonl`
(observed MinS / MaxP, restarts, worst actual device) and, when the setting names the MinS the
client timer enforces, also the worst case that timer implies over the planned rounds.

`setting` keys (anything else is refused, to catch typos):
  noise_multiplier      float, required: z of the tree (with adaptive clipping, the z of
                        paper 002 Thm. 1, not the inflated z_delta)
  delta                 float, required: delta of the (eps, delta) statement
  clip_norm             float or str (e.g. "adaptive, quantile 0.5")
  report_goal           int: devices per round (at least)
  population            int: (estimated) devices that can take part
  rounds                int: planned total rounds, for the timer's worst case (default: the
                        logged rounds); the observed figures always cover the logged rounds
  timer_min_separation  int: MinS the client timer implies (rounds strictly between)
  timer_period          str: the timer as configured, e.g. "144h" (display only)
  unit                  "device" (default) or "user"
  adjacency             "zero-out" (default; paper 002) or "replace-one"
  method                "pld" (default) or "rdp": the zCDP -> eps conversion
  tree_nodes            "all" (default; the published analysis) or "prefix" (exact for the
                        plain streaming tree, see `tree_sensitivity`)
  restarts              list[int]: tree restart rounds when there is no log (else the log's)
  secagg                bool: updates were summed with secure aggregation
  noise                 "gaussian" (default) or "discrete": integer noise on the SecAgg ring sum,
                        accounted by zCDP (CKS Thm. 14) and converted by "rdp", never "pld"
  ring                  dict: the discrete noise's ring (`ring_noise.RingPlan`: bits,
                        ring_clients, scale, delta_s, sigma_sq, effective_z), shown in the report
  adaptive_clipping     bool: clip norm adopted at tree restarts (paper 002 Alg. 1)
  public_data           str: public data used (e.g. for pretraining), not covered by DP
  not_covered           list[str]: what the guarantee does not cover (`not_covered.py`)
  vocabulary            dict: a DP word vocabulary (`dp_vocabulary.py`: zcdp, delta, ...),
                        composed with training into the total
  nonprivate_vocabulary bool: the word vocabulary was built without DP (warned up front)
  participation_log     path: default `run_dir / "participation.jsonl"`
"""

from __future__ import annotations

from pathlib import Path

from dpfleet.coordinator.accounting.planner import worst_case_max_participation
from dpfleet.coordinator.accounting.zcdp import (
    ADJACENCY,
    MIN_SEPARATION_CONVENTION,
    account_participation_log,
    account_worst_case,
    epsilon_from_zcdp,
)
from dpfleet.coordinator.mechanisms.tree_sensitivity import NODES, check_int
from dpfleet.errors import DpfleetError

REQUIRED = ("noise_multiplier", "delta")
OPTIONAL = {
    "clip_norm": None, "report_goal": None, "population": None, "rounds": None,
    "timer_min_separation": None, "timer_period": None, "unit": "device",
    "adjacency": "zero-out", "method": "pld", "tree_nodes": "all", "restarts": None,
    "secagg": False, "noise": "gaussian",
    "adaptive_clipping": False, "public_data": None, "participation_log": None,
    "not_covered": None, "vocabulary": None, "nonprivate_vocabulary": False, "ring": None,
}
HONEST_ONLY = ("PRIVATE ONLY AGAINST HONEST PARTICIPANTS: the noise is continuous Gaussian added "
               "after decoding the secure-aggregation sum (dp.noise = \"gaussian\" with "
               "aggregation.kind = \"secagg\"). A dishonest co-participant can park the ring sum "
               "at its wrap, where one honest device's small update moves the decoded release by "
               "about 2^bits / scale per coordinate, far beyond the sensitivity the noise is "
               "calibrated for. The statement below holds only if every participant is honest; "
               "the default (dp.noise = \"auto\") puts discrete noise in the ring instead.")


RING_MF_MECHANISM = "matrix-factorization Gaussian, rounded, in the SecAgg ring"  # `mf_ring`


def noise_mechanism(noise: str, secagg: bool, mechanism: str = "tree") -> str:
    """Where the noise was added, in the words every output uses (`mechanism` banded / blt in the
    ring: the MF Gaussian rounded to integers, `mf_ring`)."""
    if noise == "discrete":
        return RING_MF_MECHANISM if mechanism in ("banded", "blt") else "discrete Gaussian in the SecAgg ring"
    return "continuous Gaussian after decoding" if secagg else "continuous Gaussian on the plain sum"


def honest_only(noise: str, secagg: bool) -> bool:
    """Whether the guarantee needs every participant honest (continuous noise after SecAgg)."""
    return secagg and noise != "discrete"


def _participation_sentence(s: dict) -> str:
    """How participation was bounded: by device timers, or by selecting each device once."""
    if s["timer_min_separation"] is None:
        return ("No timer was configured: the bound is what the participation log shows "
                "(with disjoint selection, each device at most once).")
    period = f" ({s['timer_period']})" if s["timer_period"] else ""
    return (f"Participation is limited by a timer on each device{period} and the coordinator "
            "refuses a device that would break MinS.")


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


def _check_setting(setting: dict) -> dict:
    unknown = sorted(set(setting) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise DpfleetError(f"unknown privacy-report setting keys: {', '.join(unknown)}")
    missing = [k for k in REQUIRED if setting.get(k) is None]
    if missing:
        raise DpfleetError(f"privacy-report setting misses {', '.join(missing)}")
    full = {**OPTIONAL, **setting}
    if full["unit"] not in UNITS:
        raise DpfleetError(f"unit must be one of {', '.join(UNITS)}, got {full['unit']!r}")
    if full["adjacency"] not in ADJACENCY:
        raise DpfleetError(f"adjacency must be one of {', '.join(ADJACENCY)}")
    if full["noise"] not in ("gaussian", "discrete"):
        raise DpfleetError(f"noise must be 'gaussian' or 'discrete', got {full['noise']!r}")
    if full["noise"] == "discrete" and full["method"] == "pld":
        raise DpfleetError("discrete noise: the Gaussian PLD is not a proven bound; use method 'rdp'")
    if full["tree_nodes"] not in NODES:
        raise DpfleetError(f"tree_nodes must be one of {', '.join(NODES)}")
    for key, minimum in (("timer_min_separation", 0), ("rounds", 1), ("report_goal", 1),
                         ("population", 1)):
        if full[key] is not None:
            full[key] = check_int(full[key], key, minimum)
    return full


def summarize_privacy(run_dir: str | Path, setting: dict) -> dict:
    """The numbers of the report: {"setting", "observed" | None, "timer" | None, "headline"}."""
    s = _check_setting(setting)
    run_dir = Path(run_dir)
    log = Path(s["participation_log"] or run_dir / "participation.jsonl")
    args = dict(noise_multiplier=s["noise_multiplier"], delta=s["delta"], method=s["method"])
    args.update(adjacency=s["adjacency"], nodes=s["tree_nodes"])
    observed = account_participation_log(log, **args) if log.is_file() else None
    timer = None
    if s["timer_min_separation"] is not None:
        rounds = s["rounds"] if s["rounds"] is not None else (observed or {}).get("rounds")
        if rounds is None:
            raise DpfleetError("the timer's worst case needs 'rounds' (no participation log)")
        restarts = observed["restarts"] if observed else s["restarts"]
        mins = s["timer_min_separation"]
        timer = account_worst_case(
            rounds=rounds, max_participation=worst_case_max_participation(rounds, mins),
            min_separation=mins, restarts=restarts, **args)
    if observed is None and timer is None:
        raise DpfleetError(f"nothing to account: no participation log at {log} and no "
                           "timer_min_separation in the setting")
    head = observed or timer
    return {"setting": s, "observed": observed, "timer": timer, "headline": head,
            "total": _with_vocabulary(head, s)}


def _with_vocabulary(head: dict, s: dict) -> dict | None:
    """Training composed with the DP vocabulary: zCDP adds (both are Gaussian mechanisms, so
    the PLD of the sum is exact) and the vocabulary's thresholding delta adds."""
    vocab = s["vocabulary"]
    if vocab is None:
        return None
    rho = head["zcdp"] + vocab["zcdp"]
    return {"zcdp": rho, "epsilon": epsilon_from_zcdp(rho, s["delta"], s["method"]),
            "delta": s["delta"] + vocab["delta"],
            "vocabulary_epsilon": epsilon_from_zcdp(vocab["zcdp"], s["delta"], s["method"])}


def _cell(result: dict | None, key: str, fmt: str = "{}") -> str:
    if result is None:
        return "-"
    value = result[key]
    if value is None:
        return "none" if key != "min_separation" else "n/a (no device took part twice)"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    return fmt.format(value)


def render_privacy_report(summary: dict) -> str:
    """Markdown in the shape of paper 002 App. C."""
    s, obs, timer, head = (summary["setting"], summary["observed"], summary["timer"],
                           summary["headline"])
    method = {"pld": "privacy loss distribution (PLD) accounting of the Gaussian mechanism "
                     "(dp-accounting)", "rdp": "Renyi DP (dp-accounting, RDP of zCDP)"}.get(
        s["method"], s["method"])
    nodes = {"all": "every dyadic tree node", "prefix": "the tree nodes the streaming prefix "
             "sums use (left children and roots)"}[s["tree_nodes"]]
    source = "observed participation" if obs else "the worst case the client timer implies"
    mechanism = noise_mechanism(s["noise"], s["secagg"])
    lines = [
        "# Privacy report",
        "",
        *([f"**{HONEST_ONLY}**", ""] if honest_only(s["noise"], s["secagg"]) else []),
        f"**Noise: {mechanism}.**" + (" One device moves the released ring value by at most "
                                      "its bound Delta_s, whatever the other participants send."
                                      if s["noise"] == "discrete" else ""),
        "",
        f"**Formal statement.** This training run satisfies rho-zCDP with rho = "
        f"{head['zcdp']:.4g} ({s['unit']}-level, {s['adjacency']} adjacency; from {source}), "
        f"hence (eps, delta)-DP with eps = {head['epsilon']:.4g} at delta = {s['delta']:g}.",
        "",
        *_vocabulary_statement(summary),
        "## 1. DP setting",
        "",
        "Central DP: the service provider is trusted to run the mechanism as specified "
        "(clipping every update to the clip norm and adding DP-FTRL's tree noise).",
    ]
    if s["secagg"]:
        lines.append("Updates were summed with secure aggregation: the server sees only sums "
                     "over at least the report goal's devices. The DP guarantee does not rely "
                     "on it" + (", and holds whatever the other participants send." if s["noise"]
                                == "discrete" else ", but on every participant encoding honestly "
                                "(the noise comes after decoding: see the warning above)."))
    if s["noise"] == "discrete":
        lines.append("The tree noise is a discrete Gaussian N_Z(0, sigma^2) added to secure "
                     "aggregation's integer ring sum before decoding (exact sampler from AES-CTR "
                     "words, Canonne, Kamath, Steinke 2020): no floating-point sampler touches "
                     "the release. It is rho-zCDP with the same rho = S / (2 z^2) as the "
                     "continuous Gaussian (CKS Thm. 14), but the continuous Gaussian's PLD is not "
                     "a proven bound for it, so eps comes from the zCDP statement through the "
                     "RDP conversion (valid for every rho-zCDP mechanism).")
        lines += _ring_lines(s["ring"])
    lines += [
        "",
        "## 2. Instantiating the DP definition",
        "",
        "- (a) *Data accesses covered*: every participation of every well-behaved device in "
        "this single training run. Hyperparameter tuning is not accounted."
        + (f" Public data ({s['public_data']}) is not private and not covered."
           if s["public_data"] else ""),
        "- (b) *Final mechanism output*: the full sequence of noised tree sums, so every "
        "intermediate model (including those sent to devices) is protected, not only the "
        "final checkpoint.",
        f"- (c) *Unit of privacy*: {UNITS[s['unit']]}",
        f"- (d) *Adjacency*: {ADJACENCY_TEXT[s['adjacency']]}",
        "",
        "## 3. Privacy accounting details",
        "",
        "- (a) *Type of accounting*: rho-zCDP of DP-FTRL's online tree aggregation with the "
        "exact worst-case sensitivity over all participation patterns (Kairouz et al. 2021, "
        "App. D): rho = S / (2 z^2), S counted over " + nodes + "; (eps, delta) by "
        + method + ".",
        f"- (b) *Accounting assumptions*: each device takes part at most MaxP times with at "
        f"least MinS rounds between two participations (MinS counts the {MIN_SEPARATION_CONVENTION}"
        "). " + _participation_sentence(s),
        f"- (c) *Formal DP statement*: rho = {head['zcdp']:.4g}; eps = {head['epsilon']:.4g} "
        f"at delta = {s['delta']:g}.",
        "",
        "| | observed (participation log) | implied by the timer |",
        "|---|---|---|",
        f"| rounds | {_cell(obs, 'rounds')} | {_cell(timer, 'rounds')} |",
        f"| MinS | {_cell(obs, 'min_separation')} | {_cell(timer, 'min_separation')} |",
        f"| MaxP | {_cell(obs, 'max_participation')} | {_cell(timer, 'max_participation')} |",
        f"| tree restarts | {_cell(obs, 'restarts')} | {_cell(timer, 'restarts')} |",
        f"| sensitivity^2 (C^2) | {_cell(obs, 'sensitivity_squared')} | "
        f"{_cell(timer, 'sensitivity_squared')} |",
        f"| zCDP rho | {_cell(obs, 'zcdp', '{:.4g}')} | {_cell(timer, 'zcdp', '{:.4g}')} |",
        f"| eps at delta = {s['delta']:g} | {_cell(obs, 'epsilon', '{:.4g}')} | "
        f"{_cell(timer, 'epsilon', '{:.4g}')} |",
        "",
    ]
    if obs and obs["worst_device"]:
        d = obs["worst_device"]
        lines += [f"The worst device that actually took part ({d['participations']} "
                  f"participations) has sensitivity^2 {d['sensitivity_squared']}, rho = "
                  f"{d['zcdp']:.4g}, eps = {d['epsilon']:.4g}: the observed MinS / MaxP bound "
                  "above covers every pattern they allow.", ""]
    if (obs and timer and obs["min_separation"] is not None
            and obs["min_separation"] < timer["min_separation"]):
        lines += [f"**Warning**: the observed MinS ({obs['min_separation']}) is below the "
                  f"timer's ({timer['min_separation']}): participation was not limited as "
                  "configured; the observed figures are the valid ones.", ""]
    lines += _vocabulary_section(summary) + _not_covered_section(s)
    adaptive = "yes (clip norm adopted at tree restarts)" if s["adaptive_clipping"] else "no"
    lines += [
        "## Parameters",
        "",
        "| parameter | value |",
        "|---|---|",
        f"| noise multiplier z | {s['noise_multiplier']:g} |",
        f"| clip norm | {'-' if s['clip_norm'] is None else s['clip_norm']} |",
        f"| adaptive clipping | {adaptive} |",
        f"| report goal | {'-' if s['report_goal'] is None else s['report_goal']} |",
        f"| population | {'-' if s['population'] is None else s['population']} |",
        f"| secure aggregation | {'yes' if s['secagg'] else 'no'} |",
        f"| noise | {mechanism} |",
        f"| unit / adjacency | {s['unit']} / {s['adjacency']} |",
        f"| accounting | zCDP (exact tree sensitivity); eps by {s['method']} |",
        "",
    ]
    return "\n".join(lines)


def _ring_lines(ring: dict | None) -> list[str]:
    """The discretization behind the discrete noise: the bound it is calibrated to."""
    if not ring:
        return []
    return [f"Discretization: a {ring['bits']}-bit ring sized for {ring['ring_clients']} clients, "
            f"scale s = {ring['scale']:.6g}; one device's rounded vector has L2 norm <= Delta_s = "
            f"{ring['delta_s']:.6g} (the clip norm's s C = {ring['scaled_clip']:.6g} inflated by "
            f"conditional randomized rounding, factor {ring['norm_inflation']:.6g}); the noise "
            f"variance is sigma^2 = {ring['sigma_sq']} >= (z Delta_s)^2, rounded up to an "
            f"integer (effective z = sigma / Delta_s = {ring['effective_z']:.6g}). The accounting "
            "uses the configured z, which this sigma meets."]


def _vocabulary_statement(summary: dict) -> list[str]:
    s, total = summary["setting"], summary["total"]
    if s["nonprivate_vocabulary"]:
        return ["**Warning: the word vocabulary was built from the private training clients "
                "without DP** (tokenizer.allow_nonprivate_vocabulary = true). It ships with the "
                "model and is not covered by this statement: a word used by one client can be "
                "in it.", ""]
    if total is None:
        return []
    return [f"**With the DP vocabulary** the run as a whole (vocabulary + training) satisfies "
            f"rho = {total['zcdp']:.4g} zCDP on the Gaussian parts and (eps, delta)-DP with "
            f"eps = {total['epsilon']:.4g} at delta = {total['delta']:.4g} (dp.delta "
            f"{s['delta']:g} + the vocabulary's thresholding delta {s['vocabulary']['delta']:g}). "
            "See 'Vocabulary'.", ""]


def _vocabulary_section(summary: dict) -> list[str]:
    s, head, total = summary["setting"], summary["headline"], summary["total"]
    if total is None:
        return []
    v = s["vocabulary"]
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
        f"{s['delta']:g} |",
        f"| vocabulary (thresholding) | - | 0 | {v['delta']:g} |",
        f"| DP-FTRL training | {head['zcdp']:.4g} | {head['epsilon']:.4g} | {s['delta']:g} |",
        f"| **total** | **{total['zcdp']:.4g}** | **{total['epsilon']:.4g}** | "
        f"**{total['delta']:.4g}** |",
        "",
        "The per-round `epsilon` / `zcdp` in metrics.jsonl are the training part only.",
        "",
    ]


def _not_covered_section(s: dict) -> list[str]:
    if not s["not_covered"]:
        return []
    return ["## Not covered by the guarantee", "",
            *[f"- {item}" for item in s["not_covered"]], ""]


def write_privacy_report(run_dir: str | Path, setting: dict) -> Path:
    """Account the run in `run_dir` and write `run_dir/privacy_report.md`; returns its path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DpfleetError(f"run directory {run_dir} does not exist")
    path = run_dir / "privacy_report.md"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render_privacy_report(summarize_privacy(run_dir, setting)))
    tmp.replace(path)
    return path
