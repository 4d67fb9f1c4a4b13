"""A release policy: the rules a run must meet before its model ships.

Why a file rather than flags: a launch states its release rules once (a zCDP or eps ceiling at a
stated delta, beating the starting model and the unigram baseline on held-out users, no caveat)
and every path that ships a model checks the same file: `dpfleet export --bundle --policy FILE`,
`Result.export_bundle(policy=...)` and the coordinator service's release step. A run that misses
a rule is refused with one line naming the rule and the run's value, before anything is written;
a bundle that passes records the rules, the file's sha256 and the values it passed in its signed
manifest, so the phone-side record says which policy let it out. `dpfleet gate` prints the
verdict without exporting; one function (`ReleasePolicy.verdicts`) decides every rule for both, so
the gate's FAIL line is exactly the export's refusal.

The values are the run's own records: privacy.json (its total when other releases such as a DP
vocabulary compose with training) and summary.json (final, starting model and unigram accuracy
on held-out users). eps is compared at the run's delta, which must be at most the policy's: an
(eps, delta_run) guarantee is an (eps, delta) one for any delta >= delta_run, so no conversion
is needed. A run without a guarantee (eps null) fails every ceiling. A projection run is judged
on its own guarantee (its model's); its planned launch's projected figures get a separate verdict
(`projected_values`) that never lets the model out.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from dpfleet.errors import DpfleetError
from dpfleet.io import sha256_hex

NUMBERS = ("max_epsilon", "delta", "max_rho")
FLAGS = ("beat_public_model", "beat_unigram", "allow_caveats")
PLANNED = "the planned launch (projection, not a guarantee)"


class PolicyRefused(DpfleetError):
    """A run that misses the release policy: one line naming each failed rule and its value."""


def _number(value: object) -> float | None:
    """A finite float, or None (JSON null, a missing key, inf)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


@dataclass(frozen=True)
class ReleasePolicy:
    """The rules of one policy file (`load`); a rule left out of the file is not checked."""

    name: str  # the file's name, as refusals say it
    sha256: str  # of the file's bytes: the manifest names exactly the policy that passed the model
    rules: dict = field(default_factory=dict)  # key -> value, as written in the file

    @classmethod
    def load(cls, path: str | Path) -> ReleasePolicy:
        """The policy file at `path`; a missing file, bad TOML, an unknown key or a bad value is
        one DpfleetError naming it."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise DpfleetError(f"cannot read policy file {path}: {exc.strerror}") from None
        try:
            rules = tomllib.loads(data.decode())
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise DpfleetError(f"{path}: invalid TOML ({exc})") from None
        known = (*NUMBERS, *FLAGS)
        if unknown := sorted(set(rules) - set(known)):
            raise DpfleetError(f"{path}: unknown policy key {unknown[0]!r}; the keys are {', '.join(known)}")
        for key, value in rules.items():
            if key in FLAGS and not isinstance(value, bool):
                raise DpfleetError(f"{path}: {key} must be true or false, not {value!r}")
            if key in NUMBERS and (_number(value) is None or value <= 0):
                raise DpfleetError(f"{path}: {key} must be a positive number, not {value!r}")
        if "delta" in rules and not rules["delta"] < 1:
            raise DpfleetError(f"{path}: delta must lie in (0, 1), not {rules['delta']!r}")
        if ("max_epsilon" in rules) != ("delta" in rules):
            raise DpfleetError(f"{path}: max_epsilon and delta go together (eps is stated at a delta)")
        if not rules:
            raise DpfleetError(f"{path}: no rule; the keys are {', '.join(known)}")
        return cls(path.name, sha256_hex(data), {k: rules[k] for k in known if k in rules})

    def check(self, run_dir: str | Path, caveats: list[str] | None = None) -> dict:
        """The manifest's record of this policy and the run's values it passed; a run that misses
        any rule is a PolicyRefused naming every failed rule and value in one line. `run_dir`
        holds the run's privacy.json and summary.json; `caveats` default to privacy.json's."""
        values = run_values(Path(run_dir), self.rules)
        if caveats is not None:
            values["caveats"] = list(caveats)
        if refusal := self.refusal(self.verdicts(values)):
            raise PolicyRefused(refusal)
        return {"file": self.name, "sha256": self.sha256, "rules": dict(self.rules), "passed": values}

    def gate(self, run_dir: str | Path) -> dict:
        """The verdict `dpfleet gate` prints, writing nothing: the policy, the run's `own`
        verdict (its rules, values and refusal line, exactly what the export would decide) and,
        for a projection run, the planned launch's (`projection`, else None). `passed` is the
        run's own verdict only: a projection's figures are a simulation, never a model's."""
        run_dir = Path(run_dir)
        values = run_values(run_dir, self.rules)
        record = {"policy": {"file": self.name, "sha256": self.sha256, "rules": dict(self.rules)},
                  "run": str(run_dir), "own": self._judged(values), "projection": None}
        if (planned := projected_values(run_dir, values)) is not None:
            label, projected = planned
            record["projection"] = {"what": PLANNED, "label": label, **self._judged(projected)}
        record["passed"] = record["own"]["passed"]
        return record

    def _judged(self, values: dict) -> dict:
        verdicts = self.verdicts(values)
        rows = [{k: row[k] for k in ("rule", "limit", "value", "passed")} for row in verdicts]
        return {"rules": rows, "passed": all(row["passed"] for row in rows),
                "refusal": self.refusal(verdicts), "values": values}

    def failures(self, v: dict) -> list[str]:
        """Each rule `v` (`run_values`) misses, as '<rule> <limit> < <value>' words."""
        return [row["refusal"] for row in self.verdicts(v) if not row["passed"]]

    def refusal(self, verdicts: list[dict]) -> str | None:
        """The one line a run with these `verdicts` is refused with; None when it passes."""
        failed = [row["refusal"] for row in verdicts if not row["passed"]]
        return f"refused by {self.name}: {'; '.join(failed)}" if failed else None

    def verdicts(self, v: dict) -> list[dict]:
        """Every rule of the policy against `v` (`run_values`), in the documented order: `rule`,
        its `limit` and the run's `value` as words, `passed`, and for a failed rule the words a
        refusal says of it (`refusal`). The one place the rules are decided: the export's refusal
        and `dpfleet gate`'s lines cannot disagree."""
        r, out = self.rules, []

        def row(rule: str, limit: str, value: str, failure: str | None) -> None:
            out.append({"rule": rule, "limit": limit, "value": value, "passed": failure is None,
                        "refusal": failure})

        eps, rho = _shown(v["epsilon"]), _shown(v["rho"])
        if "max_epsilon" in r:
            failure = None
            if v["delta"] is None or v["delta"] > r["delta"]:
                failure = f"delta {r['delta']:g} < the run's delta {_g(v['delta'])} (eps {eps})"
            elif v["epsilon"] is None or v["epsilon"] > r["max_epsilon"]:
                failure = f"max_epsilon {r['max_epsilon']:g} < eps {eps} at delta {v['delta']:g}"
            row("max_epsilon", f"eps <= {r['max_epsilon']:g} at delta {r['delta']:g}",
                f"eps {eps} at delta {_g(v['delta'])}", failure)
        if "max_rho" in r:
            failed = v["rho"] is None or v["rho"] > r["max_rho"]
            row("max_rho", f"rho <= {r['max_rho']:g}", f"rho {rho}",
                f"max_rho {r['max_rho']:g} < rho {rho}" if failed else None)
        for rule, key, what in (("beat_public_model", "starting_accuracy", "the starting model's"),
                                ("beat_unigram", "unigram_accuracy", "the unigram baseline's")):
            if not r.get(rule):
                continue
            failure = None
            if v["accuracy"] is None or v[key] is None:
                failure = (f"{rule}: the run recorded no {'final' if v['accuracy'] is None else what} "
                           "held-out accuracy")
            elif not v["accuracy"] > v[key]:
                failure = f"{rule}: accuracy {v['accuracy']:.4f} <= {what} {v[key]:.4f}"
            row(rule, f"accuracy > {what} {_accuracy(v[key])}", f"accuracy {_accuracy(v['accuracy'])}",
                failure)
        if r.get("allow_caveats") is False:
            first = v["caveats"][0] if v["caveats"] else None
            row("allow_caveats", "false (no caveat)", first or "none",
                None if first is None else f"allow_caveats = false: {first}")
        return out


def _shown(value: float | None) -> str:
    return "inf (no guarantee)" if value is None else f"{value:.4g}"


def _g(value: float | None) -> str:
    return "none" if value is None else f"{value:g}"


def _accuracy(value: float | None) -> str:
    return "not recorded" if value is None else f"{value:.4f}"


def run_file(path: Path) -> dict | None:
    """A run's JSON file (privacy.json, config.json...): its object, None when the run wrote
    none (or no object); an unreadable one is one DpfleetError."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DpfleetError(f"{path}: unreadable ({exc})") from exc
    return value if isinstance(value, dict) else None


def _read(path: Path) -> dict:
    """`run_file`, required: the policy cannot be checked without the run's records."""
    if (value := run_file(path)) is None:
        raise DpfleetError(f"the release policy needs the run's records: no JSON object in {path}")
    return value


def projected_values(run_dir: Path, values: dict) -> tuple[str, dict] | None:
    """(label, values) of a projection run's planned launch, None for any other run: `values`
    (the run's, `run_values`) with eps, delta and rho from privacy.json's `projection` block. Its
    accuracies stay the run's: they are the projection's estimate of the launch's. Its caveats
    are the run's less the projection's own (the launch would not be a projection), so
    allow_caveats judges what the launch would still carry."""
    block = _read(run_dir / "privacy.json").get("projection")
    if not isinstance(block, dict):
        return None
    label = str(block.get("label") or PLANNED)
    kept = [c for c in values["caveats"][1:] if not c.lower().startswith(label.lower())]
    return label, {**values, "epsilon": _number(block.get("epsilon")), "rho": _number(block.get("zcdp")),
                   "delta": _number(block.get("delta", values["delta"])), "caveats": kept}


def run_values(run_dir: Path, rules: dict | None = None) -> dict:
    """What a policy checks, from the run's records: eps, delta and rho of its total guarantee
    (training composed with its other releases, privacy.json), held-out accuracy of the final
    and the starting model and of the unigram baseline (summary.json, else initial_eval.json
    for the starting model), and its caveats. A non-finite or null figure is None. A missing
    summary.json is an error only when `rules` (default: all) check an accuracy."""
    privacy = _read(run_dir / "privacy.json")
    total = privacy.get("total_with_releases") or privacy.get("total_with_vocabulary") or privacy
    if not isinstance(total, dict):
        total = privacy
    values: dict = {"epsilon": _number(total.get("epsilon")),
                    "delta": _number(total.get("delta", privacy.get("delta"))),
                    "rho": _number(total.get("zcdp")),
                    "accuracy": None, "starting_accuracy": None, "unigram_accuracy": None}
    caveats = privacy.get("caveats", [])
    values["caveats"] = [c for c in caveats if isinstance(c, str)] if isinstance(caveats, list) else []
    needed = rules is None or rules.get("beat_public_model") or rules.get("beat_unigram")
    if needed or (run_dir / "summary.json").is_file():  # recorded whenever the run has them
        summary = _read(run_dir / "summary.json")

        def accuracy(key: str) -> float | None:
            entry = summary.get(key)
            return _number(entry.get("accuracy")) if isinstance(entry, dict) else None

        initial = accuracy("initial")
        if initial is None and (run_dir / "initial_eval.json").is_file():
            initial = _number(_read(run_dir / "initial_eval.json").get("accuracy"))
        values.update(accuracy=accuracy("final"), starting_accuracy=initial,
                      unigram_accuracy=accuracy("unigram_baseline"))
    return values
