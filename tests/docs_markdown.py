"""The docs' Markdown as the doc tests read it: fenced blocks with their run markers, paragraphs,
links and headings' anchors, for README.md and every page under docs/.

A fenced Python or shell block says whether the doc tests run it, in an HTML comment (invisible on
the site and on GitHub) on the last non-blank line before its fence:

    <!-- runnable -->                 run in the default suite (a few seconds)
    <!-- runnable slow -->            run in the slow set (it trains)
    <!-- not-runnable: the reason --> never run; the reason says why (a phone, a GPU, a synopsis)
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHELL = ("bash", "sh", "shell", "console")
PYTHON = ("python", "py")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[^\s`]*)")
MARKER = re.compile(r"^<!--\s*(?P<kind>runnable(?: slow)?|not-runnable:(?P<reason>.*?))\s*-->$")


def pages() -> list[Path]:
    """README.md and every Markdown page of the site (docs/, the generated API stubs included)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else page.name


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str | None  # "runnable", "runnable slow", "not-runnable: ..." or None
    marker_line: str | None  # the comment as written, when the line before looks like one

    @property
    def runnable(self) -> bool:
        return self.marker in ("runnable", "runnable slow")

    @property
    def slow(self) -> bool:
        return self.marker == "runnable slow"

    @property
    def reason(self) -> str:
        return self.marker.split(":", 1)[1].strip() if self.marker and ":" in self.marker else ""


def blocks(page: Path) -> list[Block]:
    """Every fenced block of a page, with the marker comment before it (if any)."""
    lines = page.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        code = "\n".join(line[indent:] for line in lines[i + 1:end]) + "\n"
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(before)
        found.append(Block(name(page), i + 1, opening["lang"], code,
                           marker["kind"].strip() if marker else None,
                           before if before.startswith("<!--") else None))
        i = end + 1
    return found


def prose(page: Path) -> list[str]:
    """The page without fenced blocks, HTML comments and the front matter, line by line."""
    out, fence = [], None
    for line in page.read_text().split("\n"):
        opening = FENCE.match(line)
        if fence is None and opening:
            fence = opening["fence"]
            out.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append("")
        else:
            out.append(re.sub(r"<!--.*?-->", "", line))
    return out


def paragraphs(page: Path) -> list[tuple[int, str]]:
    """(first line, text) of every paragraph, list item and table row of a page's prose: what a
    reader takes in as one piece."""
    found: list[tuple[int, str]] = []
    current: list[str] = []
    start = 0
    for number, line in enumerate(prose(page), 1):
        item = re.match(r"\s*([-*+]|\d+\.)\s", line)
        if not line.strip() or line.lstrip().startswith(("|", "#")) or item:
            if current:
                found.append((start, " ".join(current)))
                current = []
            if line.lstrip().startswith("|"):
                found.append((number, line))
            elif item:
                current, start = [line], number
            continue
        if not current:
            start = number
        current.append(line)
    if current:
        found.append((start, " ".join(current)))
    return found


def runs(page: Path) -> list[tuple[int, str]]:
    """(first line, text) of every run of non-blank prose lines outside tables and headings: what
    the site renders as one block with no gap in it. A tight list (no blank line between its items)
    is one run, however many items it has."""
    found: list[tuple[int, str]] = []
    current: list[str] = []
    start = 0
    for number, line in enumerate([*prose(page), ""], 1):
        if not line.strip() or line.lstrip().startswith(("|", "#")):
            if current:
                found.append((start, " ".join(current)))
                current = []
            continue
        if not current:
            start = number
        current.append(line)
    return found


def words(text: str) -> int:
    return len([w for w in re.split(r"[\s|]+", text) if re.search(r"\w", w)])


def slug(heading: str) -> str:
    """The anchor mkdocs' toc extension (and GitHub, for these headings) gives a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    """The heading anchors of a page, and explicit `{ #id }` ones."""
    found = set()
    for line in prose(page):
        heading = re.match(r"#{1,6}\s+(.*?)\s*(\{\s*#([\w-]+)\s*\})?\s*$", line)
        if heading:
            found.add(heading[3] or slug(heading[1]))
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link of the page's prose."""
    return [(number, target) for number, line in enumerate(prose(page), 1)
            for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line))]
