"""Griffe extension: keep the plain-text tables of dpfleet's docstrings as they are laid out.

Why: the docstrings are written to be read in a terminal. A key list such as

    Modes (`[participation] mode`):
      disjoint  one seeded permutation ...
      uniform   a fresh seeded draw ...

is indented by two spaces with aligned columns, which Markdown would run together into one
paragraph. So a run of lines indented by exactly 2 or 3 spaces (continuation lines may be
indented further) after a blank line or a line ending in ':' is shown as a preformatted block.
Four spaces is already code in Markdown, and Markdown list items ("  - ", "  * ") and list
continuations are left alone. The source is not changed.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_START = re.compile(r"^ {2,3}(?![-*+] |\d+\. )\S")


def preformat_tables(text: str) -> str:
    """`text` with each run of 2-3-space-indented lines fenced as a ```text block."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        # a table follows a blank line or a line ending in ':'; otherwise the indented line continues
        # a list item or paragraph (Markdown joins those correctly)
        opens = i == 0 or not lines[i - 1].strip() or lines[i - 1].rstrip().endswith(":")
        if not (opens and _START.match(lines[i])):
            out.append(lines[i])
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].startswith("  ") and lines[j].strip():
            j += 1
        if out and out[-1].strip():
            out.append("")
        out += ["```text", *(line[2:] for line in lines[i:j]), "```", ""]
        i = j
    return "\n".join(out)


class DocstringLayout(griffe.Extension):
    """Apply `preformat_tables` to every docstring griffe loads."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = preformat_tables(obj.docstring.value)
