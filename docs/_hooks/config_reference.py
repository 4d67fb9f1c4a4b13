"""MkDocs hook: the config reference page, generated from the config's dataclasses at build time.

Why generated: a hand-kept table of keys goes stale with the first new key. Every section, key,
type, default (of `SimulationConfig()`, the one source of defaults) and meaning (the field's
docstring) comes from `dpfleet.coordinator.config_reference`, the accepted values from the config's
own checks, and the main job's deliberate differences from `MAIN_JOB_CHOICES`.
"""

from __future__ import annotations

import json
import tomllib
from typing import Any

MARKER = "<!-- dpfleet-config -->"


def toml_value(value: object) -> str:
    """`value` as it is written in a TOML file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | list):
        return json.dumps(value)
    return repr(value)


def cell(text: str) -> str:
    """Text that stays in its table cell (a | would end it)."""
    return text.replace("|", "\\|")


def key_row(key: Any) -> str:
    meaning = key.meaning
    if key.choices:
        meaning += " One of " + ", ".join(f"`{toml_value(c)}`" for c in key.choices) + "."
    if key.path:
        meaning += " A path: relative to the config file's folder (in a dict: to the working folder)."
    return f"| `{key.name}` | {key.type} | `{toml_value(key.default)}` | {cell(meaning)} |"


def main_job_rows() -> list[str]:
    from dpfleet.coordinator.config import MAIN_JOB_CHOICES
    from dpfleet.examples import example_text

    example = tomllib.loads(example_text("shakespeare"))
    rows = []
    for name, why in MAIN_JOB_CHOICES.items():
        section, key = name.split(".")
        rows.append(f"| `{name}` | `{toml_value(example[section][key])}` | {cell(why)} |")
    return rows


def config_reference() -> str:
    """Markdown for every key of a simulation config, section by section."""
    from dpfleet.coordinator.config_reference import config_sections

    out = []
    for section in config_sections():
        heading = f"`[{section.name}]`" if section.name else "Top-level keys"
        out.append(f"## {heading}\n")
        if section.meaning:
            out.append(f"{section.meaning}\n")
        out.append("| key | type | default | meaning |\n| --- | --- | --- | --- |")
        out.extend(key_row(k) for k in section.keys)
        out.append("")
    out.append("## What the main job states on top of the defaults\n")
    out.append("`examples/shakespeare_cifg.toml` (`dpfleet init`) sets every other key it names to its "
               "default; these it sets otherwise, on purpose:\n")
    out.append("| key | main job | why |\n| --- | --- | --- |")
    out.extend(main_job_rows())
    return "\n".join(out) + "\n"


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, config_reference())
    return markdown
