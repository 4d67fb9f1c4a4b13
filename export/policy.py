"""A release policy: the rules a run must meet before its model ships.

Why a file rather than flags: a launch states its release rules once (a zCDP or eps ceiling at a
stated delta, beating the starting model and the unigram baseline on held-out users, no caveat)
and every path that ships a model checks the same file: `dpfleet export --bundle --policy FILE`,
`Result.export_bundle(policy=...)` and the coordinator service's release step. A run that misses
a rule is refused with one line naming the rule and the run's value, before anything is written;
a bundle that passes records the rules, the file's sha256 and the values it passed in its signed
manifest, so the phone-side record says which policy let it out.

The values are the run's own records: privacy.json (its total when other releases such as a DP
vocabulary compose with training) and summary.json (final, starting model and unigram accuracy
on held-out users). eps is compared at the run's delta, which must be at most the policy's: an
(eps, delta_run) guarantee is an (eps, delta) one for any delta >= delta_run, so no conversion
is needed. A run without a guarantee (eps null) fails every ceiling.
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
        if failed := self.failures(values):
            raise PolicyRefused(f"refused by {self.name}: {'; '.join(failed)}")
        return {"file": self.name, "sha256": self.sha256, "rules": dict(self.rules), "passed": values}

    def failures(self, v: dict) -> list[str]:
        """Each rule `v` (`run_values`) misses, as '<rule> <limit> < <value>' words."""
        r, out = self.rules, []
        eps, rho = _shown(v["epsilon"]), _shown(v["rho"])
        if "max_epsilon" in r:
            if v["delta"] is None or v["delta"] > r["delta"]:
                out.append(f"delta {r['delta']:g} < the run's delta {v['delta']:g} (eps {eps})")
            elif v["epsilon"] is None or v["epsilon"] > r["max_epsilon"]:
                out.append(f"max_epsilon {r['max_epsilon']:g} < eps {eps} at delta {v['delta']:g}")
        if "max_rho" in r and (v["rho"] is None or v["rho"] > r["max_rho"]):
            out.append(f"max_rho {r['max_rho']:g} < rho {rho}")
        for rule, key, what in (("beat_public_model", "starting_accuracy", "the starting model's"),
                                ("beat_unigram", "unigram_accuracy", "the unigram baseline's")):
            if not r.get(rule):
                continue
            if v["accuracy"] is None or v[key] is None:
                out.append(f"{rule}: the run recorded no {'final' if v['accuracy'] is None else what} "
                           "held-out accuracy")
            elif not v["accuracy"] > v[key]:
                out.append(f"{rule}: accuracy {v['accuracy']:.4f} <= {what} {v[key]:.4f}")
        if r.get("allow_caveats") is False and v["caveats"]:
            out.append(f"allow_caveats = false: {v['caveats'][0]}")
        return out


def _shown(value: float | None) -> str:
    return "inf (no guarantee)" if value is None else f"{value:.4g}"


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
