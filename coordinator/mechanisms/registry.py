"""Which mechanisms a config, the CLI, the planner and the service can name: every module of this
package that calls `register` (so adding a mechanism is one file here plus its tests, nothing to
wire), and every module an installed package names under the entry-point group
`dpfleet.mechanisms` (a user's mechanism, then usable from a config, `dpfleet simulate` and
`dpfleet service serve`, which cannot be handed a Python object).

The built-ins are the classes this package registers under `SHIPPED`, told apart by class identity
(`is_built_in`), never by a module name a class can set. Everything else registered is a plugin:
its sensitivity is declared (a caveat wherever the run is shown), `dp.mechanism = "auto"` considers
it only with `dp.auto_plugins = true`, and a resume rebuilds it from the registry when the same
plugin is installed.

A registered factory builds the mechanism for a run once the participation the coordinator
enforces is known: `build(name, rounds, min_separation, max_participation)` (banded / BLT optimise
their strategy for it; the tree and independent noise need nothing).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

from dpfleet.coordinator.mechanisms.base import Mechanism
from dpfleet.errors import DpfleetError

Factory = Callable[[int, int, int], Mechanism]  # (rounds, MinS, MaxP) -> mechanism
Rebuild = Callable[[dict], Mechanism]  # identity() -> the same mechanism (a resume)


@dataclass(frozen=True)
class Entry:
    name: str
    cls: type[Mechanism]  # what it builds: its class attributes say what it supports
    factory: Factory
    rebuild: Rebuild
    description: str  # for `dpfleet account --help` and the docs
    planned: bool = True  # a candidate of dp.mechanism = "auto"


_ENTRIES: dict[str, Entry] = {}
_ORDER = ("tree", "banded", "blt")  # the built-ins first, simplest first (ties in `auto`)
SHIPPED = (*_ORDER, "independent")  # the mechanisms this package defines (its modules register them)


def register(name: str, cls: type[Mechanism], factory: Factory, rebuild: Rebuild, description: str,
             *, planned: bool = True) -> None:
    """Make `name` a `dp.mechanism` value: `factory` builds it (a `cls`) for a run, `rebuild` from
    its `identity()` (a resume); `planned`: a candidate of dp.mechanism = "auto"."""
    if name in _ENTRIES and _ENTRIES[name].cls is not cls:
        raise DpfleetError(f"two noise mechanisms are registered as {name!r}")
    _ENTRIES[name] = Entry(name, cls, factory, rebuild, description, planned)


ENTRY_POINTS = "dpfleet.mechanisms"  # installed packages' modules that call `register`


def _load() -> dict[str, Entry]:
    """Import every module of the package and every plugin module once (each registers itself)."""
    package = importlib.import_module(__name__.rpartition(".")[0])
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")
    for point in importlib.metadata.entry_points(group=ENTRY_POINTS):
        try:
            point.load()
        except Exception as exc:  # a broken plugin is named, not a traceback from deep inside
            raise DpfleetError(f"the noise-mechanism plugin {point.name!r} ({point.value}) does not "
                               f"load: {type(exc).__name__}: {exc}") from None
    return _ENTRIES


def entries() -> list[Entry]:
    found = _load()
    return sorted(found.values(), key=lambda e: (_ORDER.index(e.name) if e.name in _ORDER else len(_ORDER),
                                                 e.name))


def names() -> tuple[str, ...]:
    return tuple(e.name for e in entries())


def planned_names(plugins: bool = False) -> tuple[str, ...]:
    """`auto`'s candidates: the planned built-ins, and planned plugins only when `plugins`."""
    return tuple(e.name for e in entries() if e.planned and (plugins or e.name in SHIPPED))


def is_built_in(mechanism: Mechanism) -> bool:
    """Whether `mechanism` is exactly a class this package ships (a subclass or a class naming a
    dpfleet module in `__module__` is not: dpfleet derived only its own classes' sensitivity)."""
    found = _load()
    return any(type(mechanism) is found[n].cls for n in SHIPPED if n in found)


def source(mechanism: Mechanism | str) -> str:
    """"built-in", "plugin" (a registered class dpfleet does not ship, or its name) or "custom"
    (a caller's object of a class nobody registered)."""
    found = _load()
    if isinstance(mechanism, str):
        return "built-in" if mechanism in SHIPPED else "plugin" if mechanism in found else "custom"
    if is_built_in(mechanism):
        return "built-in"
    if any(type(mechanism) is e.cls for n, e in found.items() if n not in SHIPPED):
        return "plugin"
    return "custom"


def entry(name: str) -> Entry:
    found = _load()
    if name not in found:
        raise DpfleetError(f"unknown noise mechanism {name!r}; use one of {', '.join(names())}")
    return found[name]


def ring_is_rounded(name: str) -> bool:
    """Whether mechanism `name`'s ring noise is its continuous Gaussian rounded (the Gaussian PLD
    bounds it); False for a name this dpfleet does not know (a caller's object, "auto")."""
    return name in names() and entry(name).cls.ring_is_rounded_gaussian


def build(name: str, rounds: int, min_separation: int, max_participation: int) -> Mechanism:
    return entry(name).factory(rounds, min_separation, max_participation)


def rebuild(name: str, identity: dict) -> Mechanism:
    """The registered mechanism `name` from its recorded `identity()`."""
    found = _load()
    if name not in found:
        raise DpfleetError(f"the run's noise mechanism {name!r} is not one this dpfleet knows "
                           f"({', '.join(names())}): install the plugin that registers it (entry "
                           f"point group {ENTRY_POINTS!r}) to resume")
    return found[name].rebuild(identity)

