"""The config reference is generated from the config's dataclasses and every key has a meaning, so a
key added without one fails here (issue 33: six sections had no docstring and no page listed
their keys)."""

import dataclasses
import importlib.util
import re
from pathlib import Path

from dpfleet.coordinator.config import MAIN_JOB_CHOICES, PATH_KEYS, SimulationConfig
from dpfleet.coordinator.config_reference import config_sections, field_meanings

ROOT = Path(__file__).resolve().parent.parent


def hook():
    spec = importlib.util.spec_from_file_location("config_reference_hook",
                                                  ROOT / "docs" / "_hooks" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def every_key(cls=SimulationConfig, prefix=""):
    for f in dataclasses.fields(cls):
        nested = getattr(cls(), f.name) if cls is SimulationConfig else None
        if dataclasses.is_dataclass(nested):
            yield from every_key(type(nested), f"{f.name}.")
        else:
            yield prefix + f.name


def test_every_section_and_key_has_a_meaning():
    missing = []
    sections = {f.name: getattr(SimulationConfig(), f.name) for f in dataclasses.fields(SimulationConfig)}
    for cls in [SimulationConfig] + [type(v) for v in sections.values() if dataclasses.is_dataclass(v)]:
        meanings = field_meanings(cls)
        missing += [f"{cls.__name__}.{f.name}" for f in dataclasses.fields(cls) if not meanings.get(f.name)]
        if not (cls.__doc__ or "").strip() or cls.__doc__.startswith(f"{cls.__name__}("):
            missing.append(f"{cls.__name__} (class docstring)")  # dataclass's generated signature
    assert not missing, f"give these an attribute docstring (the line after the field): {missing}"


def test_the_reference_lists_every_key_once_with_its_default():
    keys = [k for s in config_sections() for k in s.keys]
    assert [k.name for k in keys] == list(every_key())
    defaults = SimulationConfig()
    for k in keys:
        section, _, name = k.name.rpartition(".")
        assert k.default == getattr(getattr(defaults, section) if section else defaults, name), k.name
    assert {k.name for k in keys if k.path} == {f"{s}.{k}" for s, k in PATH_KEYS}
    choices = {k.name: k.choices for k in keys}
    assert "banded" in choices["dp.mechanism"]  # the registered mechanisms, and the planner's "auto"
    assert choices["participation.mode"] == ("disjoint", "uniform", "timer")


def test_the_generated_page_has_every_section_key_type_default_and_meaning():
    page = hook().config_reference()
    for section in config_sections():
        assert f"## `[{section.name}]`" in page if section.name else "## Top-level keys" in page
    assert '| `dp.clip_norm` | float | `2.0` | The L2 bound on each client\'s update' in page
    assert '| `pretrain.corpus` | list[str] | `[]` |' in page
    assert '| `data.path` | str | `""` |' in page and "relative to the config file's folder" in page
    # ...where a user looks for "my own data": the dataset key says jsonl
    assert re.search(r'\| `data.dataset` \| str \| `"shakespeare"` \| '
                     r'[^|]*your own file at `path`: "jsonl"', page)
    # a | inside a meaning is escaped, so no row has more than the table's 5 bars
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert rows and all(len(re.findall(r"(?<!\\)\|", row)) in (4, 5) for row in rows)
    # the main job's choices, with its values read from the example itself
    for key in MAIN_JOB_CHOICES:
        assert f"| `{key}` |" in page.split("What the main job states")[1]
    assert '| `dp.target_epsilon` | `8.0` |' in page
