"""A run's privacy ledger: every release about the devices as a named dp_accounting `DpEvent`.

Why one ledger: a run releases more than its model. The model noise and adaptive clipping's
clipped-count noise (together one Gaussian mechanism on the same strategy, paper 002 Thm. 1), a
DP word vocabulary and FreD statistics about the same users all spend privacy, and before the
ledger each was added up in its own way (rho floats, {"zcdp", "delta"} dicts, a FreD-only
composition). Here each is an `Entry` (a name, its `DpEvent`, its own rho-zCDP and the delta a
threshold adds), the run is their `ComposedDpEvent`, and every eps dpfleet states is a
conversion of that ledger: the progress bar, metrics.jsonl, privacy.json, the report.

Composition: every event here is a Gaussian mechanism or a zCDP release, so rho adds exactly
(the PLD of a sum of Gaussians is a Gaussian's) and the ledger's rho is the training entry's
plus the others'; eps at delta is `zcdp.epsilon_from_zcdp` of that rho by the run's conversion
(PLD for Gaussian noise, RDP for discrete or declared noise; the caller picks, `run_accountant.
conversion_for`). A PLD conversion costs ~40 ms, so it is cached by (rho, delta, conversion).

Figures that are no run's are one-entry ledgers: a target or planned rho (`stated_epsilon`), a
planned Gaussian (`planned_epsilon`), a worst case or a participation log (`account_worst_case`,
`account_participation_log`, over zcdp.py's rho-only figures). zcdp.py holds the conversion but
never calls it to state a figure (it cannot import this module: the ledger imports it), so the
rule "every eps is a ledger's" is one grep (tests/test_ledger_statements.py).

The training entry's event is the mechanism's own (`mechanism_entry`): `Mechanism.event`, which
must be the Gaussian of z and the accountant's checked sens^2 (every built-in's is, exactly) or
claim at least its rho; an event that under-reports is refused.

privacy.json keeps the ledger (`to_json`): each entry's name, its event as dp_accounting's own
named-tuple form (`DpEvent.to_named_tuple`, as JSON), its rho and its own eps; nothing secret.
`check_ledger` rebuilds it from there (only dp_accounting's event classes, never an arbitrary
module a file names), recomputes each figure and refuses a file whose stated eps disagrees.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import dp_accounting
from dp_accounting.pld import pld_privacy_accountant

from dpfleet.coordinator.accounting.zcdp import (
    epsilon_from_zcdp,
    model_noise_multiplier,
    participation_log_zcdp,
    worst_case_zcdp,
    zcdp_from_sensitivity,
)
from dpfleet.coordinator.mechanisms.base import ADJACENCY, Mechanism, gaussian_event
from dpfleet.coordinator.mechanisms.dp_vocabulary import VocabularyDP
from dpfleet.coordinator.mechanisms.tree import TreeMechanism
from dpfleet.errors import DpfleetError

# the entries' names, in the order a run composes them
TRAINING, MODEL_NOISE, CLIPPED_COUNT_NOISE = "dp_ftrl", "model_noise", "clipped_count_noise"
DP_VOCABULARY, FRED = "dp_vocabulary", "fred"
# the only classes a ledger read from a file may name (`from_named_tuple` imports what it is told)
EVENTS = ("GaussianDpEvent", "ZCDpEvent", "ComposedDpEvent", "NoOpDpEvent", "NonPrivateDpEvent")
EVENT_MODULE = dp_accounting.GaussianDpEvent.__module__


@dataclass(frozen=True)
class Entry:
    """One release: `zcdp` its rho (the exact figure; `event` says the same as a DpEvent),
    `delta` what a threshold adds to the run's delta, `parts` the mechanisms it is made of."""

    name: str
    event: dp_accounting.DpEvent
    zcdp: float
    delta: float = 0.0
    what: str = ""
    parts: tuple[Entry, ...] = ()


def gaussian_entry(name: str, noise_multiplier: float, sensitivity_squared: float, what: str = "") -> Entry:
    """A Gaussian mechanism of multiplier z and squared sensitivity s (units of its clip norm):
    rho = s / (2 z^2) (0 with s = 0, inf with z = 0)."""
    s, z = float(sensitivity_squared), float(noise_multiplier)
    rho = 0.0 if s == 0 else math.inf if z == 0 else zcdp_from_sensitivity(z, s)
    return Entry(name, gaussian_event(z, s), rho, what=what)


def training_entry(noise_multiplier: float, sensitivity_squared: float,
                   count_multiplier: float | None = None) -> Entry:
    """DP-FTRL's releases for a worst-case sens^2: the model noise, and with adaptive clipping
    the clipped-count noise of multiplier `count_multiplier` (2 sigma_b) on the same strategy.
    Together they are one Gaussian of multiplier z (1 / z^2 = 1 / z_delta^2 + 1 / (2 sigma_b)^2,
    paper 002 Thm. 1): the entry's rho is that Gaussian's, its parts each mechanism's own."""
    whole = gaussian_entry(TRAINING, noise_multiplier, sensitivity_squared, "DP-FTRL")
    if count_multiplier is None:
        return Entry(TRAINING, whole.event, whole.zcdp, what=whole.what,
                     parts=(gaussian_entry(MODEL_NOISE, noise_multiplier, sensitivity_squared),))
    z_delta = model_noise_multiplier(noise_multiplier, count_multiplier / 2.0)
    parts = (gaussian_entry(MODEL_NOISE, z_delta, sensitivity_squared),
             gaussian_entry(CLIPPED_COUNT_NOISE, count_multiplier, sensitivity_squared))
    return Entry(TRAINING, dp_accounting.ComposedDpEvent([p.event for p in parts]), whole.zcdp,
                 what="DP-FTRL with adaptive clipping", parts=parts)


def mechanism_entry(mechanism: Mechanism, noise_multiplier: float, sensitivity_squared: float,
                    participation: tuple[int, int | None, int, Sequence[int]],
                    count_multiplier: float | None = None, adjacency: int = 1) -> Entry:
    """`training_entry` for the checked sens^2 `s`, its event the one `mechanism.event` states for
    `participation` (rounds, MinS, MaxP, restarts) under an adjacency factor (4: replace-one,
    a doubled L2 sensitivity, the event of z / 2).

    Why checked: the mechanism speaks its own event, but a caller's could claim less than its
    noise gives. A built-in's is the Gaussian of z and s exactly (the entry is unchanged); another
    event is taken at its own rho when that is at least s / (2 z^2), else refused in one line."""
    entry = training_entry(noise_multiplier, sensitivity_squared, count_multiplier)
    if noise_multiplier == 0 or sensitivity_squared == 0:  # no privacy / nothing released: no claim
        return entry
    rounds, min_separation, max_participation, restarts = participation
    claimed = mechanism.event(noise_multiplier / math.sqrt(adjacency), rounds, min_separation,
                              max_participation, list(restarts))
    if claimed == gaussian_event(noise_multiplier, sensitivity_squared):
        return entry
    if not isinstance(claimed, dp_accounting.DpEvent) or type(claimed).__name__ not in EVENTS:
        raise DpfleetError(f"noise mechanism {mechanism.name!r}: event() returned {claimed!r}; the "
                           f"ledger accounts only {', '.join(EVENTS)}")
    rho = event_zcdp(claimed)
    if rho < entry.zcdp and not _close(rho, entry.zcdp):
        raise DpfleetError(
            f"noise mechanism {mechanism.name!r}: its event() claims rho {rho:.6g} where its "
            f"sensitivity implies {entry.zcdp:.6g} (sens^2 / (2 z^2)): refused, an event may not "
            "state less privacy loss than its noise gives")
    return Entry(TRAINING, claimed, rho, what=entry.what, parts=entry.parts)


def stated_entry(rho: float, name: str = TRAINING, what: str = "") -> Entry:
    """A release of rho-zCDP as the Gaussian it is (multiplier 1 / sqrt(2 rho)): how a target or
    a planned rho is stated (the planner's, a plan's)."""
    rho = float(rho)
    event = (dp_accounting.NoOpDpEvent() if rho == 0 else dp_accounting.NonPrivateDpEvent()
             if math.isinf(rho) else dp_accounting.GaussianDpEvent(1.0 / math.sqrt(2.0 * rho)))
    return Entry(name, event, rho, what=what)


def stated_epsilon(rho: float, delta: float, conversion: str = "pld") -> float:
    """eps at `delta` of a hypothetical release of rho-zCDP: its one-entry ledger's."""
    return Ledger((stated_entry(rho),)).epsilon(delta, conversion)


def planned_epsilon(noise_multiplier: float, sensitivity_squared: float, delta: float,
                    conversion: str = "pld") -> float:
    """eps at `delta` of a planned Gaussian release (multiplier z, worst-case sens^2 s): its
    one-entry ledger's (the launch plan's figures)."""
    planned = gaussian_entry(TRAINING, noise_multiplier, sensitivity_squared)
    return Ledger((planned,)).epsilon(delta, conversion)


def _with_epsilon(figures: dict, entry: Entry, delta: float, method: str) -> dict:
    """`figures` with its zcdp and eps as the one-entry ledger of `entry` states them (eps right
    after "method", where the figures have always put it)."""
    out = {}
    for key, value in figures.items():
        out[key] = entry.zcdp if key == "zcdp" else value
        if key == "method":
            out["epsilon"] = Ledger((entry,)).epsilon(delta, method)
    return out


def account_worst_case(noise_multiplier: float, rounds: int, *args, nodes: str = "all",
                       mechanism: Mechanism | None = None, **kwargs) -> dict:
    """`zcdp.worst_case_zcdp` (the same arguments) with its eps: the one-entry ledger of
    `mechanism`'s event for the worst participation MaxP / MinS allow (default the tree over
    `nodes`)."""
    mechanism = TreeMechanism(nodes) if mechanism is None else mechanism
    worst = worst_case_zcdp(noise_multiplier, rounds, *args, mechanism=mechanism, **kwargs)
    return _with_epsilon(worst, _worst_entry(worst, mechanism), worst["delta"], worst["method"])


def _worst_entry(worst: Mapping, mechanism: Mechanism) -> Entry:
    participation = (worst["rounds"], worst["min_separation"], max(worst["max_participation"], 1),
                     worst["restarts"])
    return mechanism_entry(mechanism, worst["noise_multiplier"], worst["sensitivity_squared"],
                           participation, adjacency=ADJACENCY[worst["adjacency"]])


def account_participation_log(path_or_records: str | Path | Iterable[Mapping],
                              noise_multiplier: float, delta: float, method: str = "pld", *,
                              rounds: int | None = None, adjacency: str = "zero-out",
                              nodes: str = "all", mechanism: Mechanism | None = None) -> dict:
    """`zcdp.participation_log_zcdp` with its eps (the headline: the one-entry ledger of the
    mechanism's event for the observed MinS / MaxP; the worst device's: of its own Gaussian)."""
    mechanism = TreeMechanism(nodes) if mechanism is None else mechanism
    worst = participation_log_zcdp(path_or_records, noise_multiplier, delta, method, rounds=rounds,
                                   adjacency=adjacency, mechanism=mechanism)
    out = _with_epsilon(worst, _worst_entry(worst, mechanism), delta, method)  # nobody: s = 0
    device = worst["worst_device"]
    if device is not None:
        entry = gaussian_entry("worst_device", noise_multiplier, device["sensitivity_squared"])
        out["worst_device"] = {**device, "zcdp": entry.zcdp,
                               "epsilon": Ledger((entry,)).epsilon(delta, method)}
    return out


def release_entry(release: Mapping) -> Entry:
    """Another release about the same devices, {name, zcdp, delta, what} and, for Gaussian sums
    of sensitivity 1, their `noise_multipliers` (FreD); else it is accounted as zCDP."""
    zs = release.get("noise_multipliers")
    event = (dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(float(z)) for z in zs])
             if zs else dp_accounting.ZCDpEvent(float(release["zcdp"])))
    return Entry(str(release.get("key", release["name"])), event, float(release["zcdp"]),
                 float(release.get("delta", 0.0)), str(release.get("what", release["name"])))


def vocabulary_entry(vocabulary: Mapping) -> Entry:
    """The DP vocabulary (`mechanisms.dp_vocabulary`): a Gaussian of std `noise` on weights of
    L2 sensitivity 1, and the threshold's delta."""
    event = VocabularyDP(float(vocabulary["noise"]), delta=float(vocabulary["delta"])).event()
    return Entry(DP_VOCABULARY, event,
                 float(vocabulary["zcdp"]), float(vocabulary["delta"]), "DP word vocabulary")


def added_delta(vocabulary: Mapping | None, releases: Sequence[Mapping]) -> float:
    """What a DP vocabulary and the other releases add to the run's delta (their thresholds'): the
    run's (eps, delta) is stated at dp.delta plus this."""
    entries = ((vocabulary_entry(vocabulary),) if vocabulary else ()) + tuple(map(release_entry, releases))
    return Ledger(entries).added_delta


@dataclass(frozen=True)
class Ledger:
    """The run's releases, in order (training first), composed."""

    entries: tuple[Entry, ...]

    def event(self) -> dp_accounting.ComposedDpEvent:
        return dp_accounting.ComposedDpEvent([e.event for e in self.entries])

    @property
    def zcdp(self) -> float:
        """The first entry's rho plus the sum of the others' (rho adds; this order is the one the
        run's figures always used, so they stay bit for bit)."""
        if not self.entries:
            return 0.0
        return self.entries[0].zcdp + sum(e.zcdp for e in self.entries[1:])

    @property
    def added_delta(self) -> float:
        return sum(e.delta for e in self.entries)

    def epsilon(self, delta: float, conversion: str) -> float:
        return epsilon_of(self.zcdp, delta, conversion)

    def pld_epsilon(self, delta: float) -> float:
        """eps at delta of the composed event by dp_accounting's PLD accountant, event by event
        (each on one grid relative to the eps scale, the zCDP bound): for Gaussian entries the
        same guarantee as `epsilon` by "pld" (FreD's figures are stated this way)."""
        rho = event_zcdp(self.event())
        scale = epsilon_from_zcdp(rho, delta, "zcdp_bound")
        acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4 * scale)
        acc.compose(self.event())
        return float(acc.get_epsilon(delta))

    def only(self, names: Iterable[str]) -> Ledger:
        names = set(names)
        return Ledger(tuple(e for e in self.entries if e.name in names))

    def total(self, delta: float, conversion: str) -> dict:
        """{"zcdp", "epsilon", "delta"}: the composition at the run's delta plus each threshold's."""
        return {"zcdp": self.zcdp, "epsilon": self.epsilon(delta, conversion),
                "delta": delta + self.added_delta}

    def to_json(self, delta: float, conversion: str) -> dict:
        """privacy.json's "ledger": the entries with their events and own figures (eps at
        `epsilon_at_delta`), and the total (its `delta` with each threshold's added)."""
        return {"conversion": conversion, "epsilon_at_delta": delta,
                "entries": [_entry_json(e, delta, conversion) for e in self.entries],
                **self.total(delta, conversion)}


@functools.lru_cache(maxsize=4096)
def epsilon_of(rho: float, delta: float, conversion: str) -> float:
    """`epsilon_from_zcdp`, cached: a pure function of its arguments (PLD ~40 ms a call)."""
    return epsilon_from_zcdp(rho, delta, conversion)


def _entry_json(entry: Entry, delta: float, conversion: str) -> dict:
    out = {"name": entry.name, "what": entry.what, "event": event_json(entry.event),
           "zcdp": entry.zcdp, "epsilon": epsilon_of(entry.zcdp, delta, conversion),
           "delta": entry.delta}
    if entry.parts:
        out["parts"] = [_entry_json(p, delta, conversion) for p in entry.parts]
    return out


def event_json(event: dp_accounting.DpEvent) -> dict:
    """dp_accounting's named-tuple form of `event` as JSON objects."""
    def plain(value):
        if hasattr(value, "_asdict"):
            return {k: plain(v) for k, v in value._asdict().items()}
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        return value
    return plain(event.to_named_tuple())


def event_from_json(obj: object) -> dp_accounting.DpEvent:
    """The event `event_json` wrote, refused unless every class in it is one of `EVENTS`."""
    def named(value):
        if isinstance(value, list):
            return [named(v) for v in value]
        if not isinstance(value, dict):
            return value
        if value.get("module_name") != EVENT_MODULE or value.get("class_name") not in EVENTS:
            raise DpfleetError(f"the privacy ledger names an unknown event {value.get('class_name')!r}")
        fields = {k: named(v) for k, v in value.items()}
        return NamedTuple("Event", [(k, object) for k in fields])(**fields)
    try:
        return dp_accounting.DpEvent.from_named_tuple(named(obj))
    except (TypeError, ValueError, AttributeError) as exc:
        raise DpfleetError(f"the privacy ledger holds a malformed event ({exc})") from None


def event_zcdp(event: dp_accounting.DpEvent) -> float:
    """rho-zCDP of an event of `EVENTS` (Gaussian: 1 / (2 sigma^2); composed: the sum)."""
    if isinstance(event, dp_accounting.NoOpDpEvent):
        return 0.0
    if isinstance(event, dp_accounting.NonPrivateDpEvent):
        return math.inf
    if isinstance(event, dp_accounting.GaussianDpEvent):
        return 0.5 / event.noise_multiplier**2 if event.noise_multiplier else math.inf
    if isinstance(event, dp_accounting.ZCDpEvent):
        return float(event.rho)
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return sum(event_zcdp(e) for e in event.events)
    raise DpfleetError(f"the privacy ledger cannot account a {type(event).__name__}")


def _entry_from_json(obj: object) -> Entry:
    if not isinstance(obj, Mapping) or not {"name", "event", "zcdp"} <= obj.keys():
        raise DpfleetError("the privacy ledger has an entry without name, event and zcdp")
    event, rho = event_from_json(obj["event"]), obj["zcdp"]
    rho = math.inf if rho is None else float(rho)  # strict JSON writes inf as null
    if not _close(event_zcdp(event), rho):
        raise DpfleetError(f"the privacy ledger's entry {obj['name']!r} states rho {rho:.6g}, its "
                           f"event {event_zcdp(event):.6g}")
    return Entry(str(obj["name"]), event, rho, float(obj.get("delta") or 0.0), str(obj.get("what", "")),
                 tuple(_entry_from_json(p) for p in obj.get("parts", ())))


def _close(a: float, b: float) -> bool:
    return a == b or math.isclose(a, b, rel_tol=1e-9)


def read_ledger(privacy: Mapping) -> Ledger:
    """The ledger of a privacy.json, each entry's rho checked against its event."""
    block = privacy.get("ledger")
    if not isinstance(block, Mapping) or not isinstance(block.get("entries"), list):
        raise DpfleetError("privacy.json holds no privacy ledger (a run from before the ledger, or "
                           "an edited file): its eps cannot be checked")
    return Ledger(tuple(_entry_from_json(e) for e in block["entries"]))


def check_ledger(privacy: Mapping) -> Ledger:
    """The ledger of a privacy.json, refused (DpfleetError) unless every figure the file states
    is its conversion: the training's zcdp / epsilon, each total, the ledger's own total. Figures
    that are no guarantee (`accounted_not_a_guarantee`) are checked where they moved."""
    ledger = read_ledger(privacy)
    block = privacy["ledger"]
    delta, conversion = float(block.get("epsilon_at_delta", 0.0)), str(block.get("conversion"))
    moved = privacy.get("accounted_not_a_guarantee")
    figures = moved if isinstance(moved, Mapping) and "zcdp" in moved else privacy
    stated = [("", ledger, block), ("training", ledger.only([TRAINING]), figures)]
    if figures.get("total_with_vocabulary"):
        stated.append(("total_with_vocabulary", ledger.only([TRAINING, DP_VOCABULARY]),
                       figures["total_with_vocabulary"]))
    if privacy.get("total_with_releases"):
        stated.append(("total_with_releases", ledger, privacy["total_with_releases"]))
    for label, part, figure in stated:
        for key, value in (("zcdp", part.zcdp), ("epsilon", part.epsilon(delta, conversion))):
            given = figure.get(key)
            if given is None and math.isinf(value):
                continue
            if not isinstance(given, int | float) or not _close(float(given), value):
                where = f"{label} " if label else "the ledger's "
                raise DpfleetError(f"privacy.json's {where}{key} {given!r} disagrees with its ledger "
                                   f"({value:.6g}): the file was edited or is damaged")
    return ledger


def read_checked_privacy(path: Path) -> dict:
    """A run's privacy.json, its figures checked against its ledger (`check_ledger`); one-line
    errors for a missing, unreadable or edited file."""
    try:
        privacy = json.loads(Path(path).read_text())
    except OSError as exc:
        raise DpfleetError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise DpfleetError(f"{path} is not JSON ({exc.msg})") from None
    if not isinstance(privacy, dict):
        raise DpfleetError(f"{path} is not a run's privacy.json")
    check_ledger(privacy)
    return privacy
