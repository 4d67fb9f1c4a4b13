"""The config's keys as data, read from its dataclasses: section, key, type, default, meaning.

Why: the documentation's config reference (docs/_hooks/config_reference.py) is generated from
this, so it cannot drift from the code, and a key added without a meaning fails a test
(tests/test_config_reference.py). A key's meaning is its field's attribute docstring, the string
right after the field (what mkdocstrings shows on the API page too), read from the source.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from dataclasses import dataclass

from dpfleet.coordinator.config import PATH_KEYS, SimulationConfig, key_choices


@dataclass(frozen=True)
class Key:
    name: str  # "dp.clip_norm"; a top-level key: "rounds"
    type: str  # "float", "list[int]"
    default: object
    meaning: str  # the attribute docstring, whitespace collapsed ("" when it has none)
    choices: tuple | None  # the values the config accepts, when it checks a list
    path: bool  # a file or folder (`PATH_KEYS`): relative to the config file


@dataclass(frozen=True)
class Section:
    name: str  # "dp"; "" for the top-level keys
    meaning: str  # the section field's docstring in SimulationConfig
    keys: list[Key]


def field_meanings(cls: type) -> dict[str, str]:
    """Each field of the dataclass `cls` that has an attribute docstring -> that docstring."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    out = {}
    for node, after in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            out[node.target.id] = " ".join(after.value.value.split())
    return out


def type_name(annotation: object) -> str:
    return annotation.__name__ if isinstance(annotation, type) else str(annotation)


def section_keys(cls: type, defaults: object, prefix: str) -> list[Key]:
    """The plain keys of dataclass `cls` (nested dataclasses are sections, left out), with
    their defaults read from the instance `defaults`."""
    hints = typing.get_type_hints(cls)
    meanings = field_meanings(cls)
    paths = {f"{section}.{key}" for section, key in PATH_KEYS}
    return [Key(prefix + f.name, type_name(hints[f.name]), getattr(defaults, f.name),
                meanings.get(f.name, ""), key_choices(prefix + f.name), prefix + f.name in paths)
            for f in dataclasses.fields(cls) if not dataclasses.is_dataclass(hints[f.name])]


def config_sections() -> list[Section]:
    """The top-level keys, then every section, in the order of `SimulationConfig`'s fields, with
    the defaults of `SimulationConfig()` (a section's defaults are its field's: [model] is the
    main job's CIFG, not `ModelConfig()`'s)."""
    defaults = SimulationConfig()
    meanings = field_meanings(SimulationConfig)
    out = [Section("", "", section_keys(SimulationConfig, defaults, ""))]
    for f in dataclasses.fields(SimulationConfig):
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(value):
            out.append(Section(f.name, meanings.get(f.name, ""),
                               section_keys(type(value), value, f"{f.name}.")))
    return out
