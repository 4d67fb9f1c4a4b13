"""`--set SECTION.KEY=VALUE`: change a config's keys from the command line, for one run.

Why on the raw TOML values and not on the parsed config: an override then goes through the same
parse and validation as a key written in the file (types, allowed values, the cross-key checks,
the planner's agreement with the keys a config states), so `--set` can never make a config the
file could not. VALUE is read as a TOML value (`true`, `3`, `0.5`, `"text"`, `[1, 2]`); anything
that is not one (a bare word, a path) is a string. The run's config.json stores the resolved
config, overrides included, so a run stays reproducible from its folder.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import difflib
import json
import tomllib
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import click

from dpfleet.errors import DpfleetError

T = TypeVar("T")

SET_HELP = ("Change a config key for this run: dp.noise_multiplier=2, participation.mode=uniform, "
            "rounds=5 (a top-level key), tensorboard=true. VALUE is TOML (true, 3, 0.5, [1, 2], "
            "\"text\"); a bare word is a string. Repeatable; checked like the file's own keys.")


def set_option(f: Callable) -> Callable:
    """The `--set` option of every command that runs a config (simulate, audit, service serve)."""
    return click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
                        help=SET_HELP)(f)


def toml_value(text: str) -> object:
    """`text` read as one TOML value; a bare word (or anything else TOML refuses) stays a string.
    Dates and times come back as written: no config key holds one."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    if isinstance(value, datetime.date | datetime.time):
        return text
    return value


def parse_overrides(texts: Sequence[str]) -> dict[str, object]:
    """`["dp.clip_norm=0.5", ...]` as {"dp.clip_norm": 0.5}, in order (a later one of the same key
    wins). Syntax only: the keys are checked against the config in `apply_overrides`."""
    out: dict[str, object] = {}
    for text in texts:
        key, sep, raw = text.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep or not all(p.strip() for p in parts):
            raise DpfleetError(f"--set {text!r}: give SECTION.KEY=VALUE (e.g. dp.noise_multiplier=2) "
                               "or KEY=VALUE for a top-level key (e.g. rounds=5)")
        out[key] = toml_value(raw.strip())
    return out


def _fields(cls: type) -> dict[str, object]:
    """A config dataclass's keys and their types."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def override_name(key: str, python: bool = False) -> str:
    """How an error names an override: the CLI's `--set KEY`, or Python's `overrides['KEY']`."""
    return f"overrides[{key!r}]" if python else f"--set {key}"


def _unknown(key: str, name: str, known: Sequence[str], where: str, python: bool) -> DpfleetError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return DpfleetError(f"{override_name(key, python)}: {where} has no key {name!r}; {hint}its keys: "
                        f"{', '.join(known)}")


def apply_overrides(values: dict, overrides: Mapping[str, object], schema: type,
                    python: bool = False) -> dict:
    """A copy of the raw config `values` with `overrides` ("section.key" -> value) set, each key
    checked against `schema` (the config dataclass) first: an unknown key, or a section given a
    plain value, is one error naming the key and what the section holds. Value types and ranges
    are the parser's to check, as for a key written in the file. `python`: the overrides came
    from `dpfleet.simulate(overrides=...)`, and the errors name them so."""
    out = copy.deepcopy(values)
    for key, value in overrides.items():
        if not isinstance(key, str) or not all(part.strip() for part in key.split(".")):
            raise DpfleetError(f"{override_name(str(key), python)}: give keys as 'SECTION.KEY' (e.g. "
                               "'dp.noise_multiplier') or 'KEY' for a top-level key (e.g. 'rounds')")
        named = override_name(key, python)
        cls, table, parts = schema, out, key.split(".")
        for depth, name in enumerate(parts):
            fields = _fields(cls)
            where = "the config" if depth == 0 else f"[{'.'.join(parts[:depth])}]"
            if name not in fields:
                raise _unknown(key, name, list(fields), where, python)
            section = dataclasses.is_dataclass(fields[name])
            last = depth == len(parts) - 1
            if last and section:
                keys = ", ".join(_fields(fields[name]))
                raise DpfleetError(f"{named}: [{'.'.join(parts)}] is a section; set one of its "
                                   f"keys, {'.'.join(parts)}.KEY{'' if python else '=VALUE'} ({keys})")
            if not last and not section:
                raise DpfleetError(f"{named}: {'.'.join(parts[:depth + 1])} is a key, not a section")
            if last:
                table[name] = value
                break
            sub = table.setdefault(name, {})
            if not isinstance(sub, dict):
                raise DpfleetError(f"config section {'.'.join(parts[:depth + 1])!r} must be a table")
            cls, table = fields[name], sub
    return out


def describe(overrides: Mapping[str, object]) -> str:
    """The overrides as one line (`dp.clip_norm=0.5 participation.mode="uniform"`), for the log."""
    return " ".join(f"{k}={json.dumps(v)}" for k, v in overrides.items())


def with_values(cfg: T, values: Mapping[str, object]) -> T:
    """A copy of the frozen config `cfg` with `values` ("section.key" or "key" -> value) set,
    through `dataclasses.replace`: the one way code changes a config (the planner's keys, the
    command line's --rounds), since a config is never changed in place. No checks: a caller that
    sets user input validates the result (`config.validate`), as the parser does."""
    changes: dict[str, object] = {}
    nested: dict[str, dict[str, object]] = {}
    for key, value in values.items():
        head, _, rest = key.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            changes[head] = value
    for head, inner in nested.items():
        changes[head] = with_values(getattr(cfg, head), inner)
    return dataclasses.replace(cfg, **changes)
