"""The docs stay scannable and their references resolve: no paragraph, list item or table row over
MAX_WORDS (the benchmarks page once held one of 722 words), every "paper 00N" in the prose links
to its bibliography entry, and README's links (which mkdocs does not check) reach real pages and
anchors."""

from __future__ import annotations

import re
from pathlib import Path

from docs_markdown import ROOT, anchors, links, name, pages, paragraphs, prose, words

MAX_WORDS = 150
BIBLIOGRAPHY = ROOT / "docs" / "bibliography.md"
CITATION = re.compile(r"\bpaper (\d{3})\b")


def test_no_paragraph_is_longer_than_a_reader_scans():
    long = [f"{name(page)}:{line}: {words(text)} words: {text[:70]}..."
            for page in pages() for line, text in paragraphs(page) if words(text) > MAX_WORDS]
    assert not long, "break these into lists or tables (keep every number):\n" + "\n".join(long)


def test_the_paragraph_reader_counts_what_a_reader_sees(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\none two\nthree\n\n- four five\n  six\n- seven\n\n| a | b c |\n|---|---|\n"
                    "<!-- hidden words here -->\n\n```text\nnot prose at all\n```\neight\n")
    assert [(line, words(text)) for line, text in paragraphs(page)] == [
        (3, 3), (6, 3), (8, 1), (10, 3), (11, 0), (17, 1)]


def test_every_paper_is_in_the_bibliography_with_its_anchor():
    entries = anchors(BIBLIOGRAPHY)
    cited = {f"paper-{number}" for page in pages() for line in prose(page)
             for number in CITATION.findall(line)}
    assert cited and cited <= entries, f"cited without an entry: {sorted(cited - entries)}"


def test_every_citation_in_the_prose_links_to_its_entry():
    plain = []
    for page in pages():
        if page == BIBLIOGRAPHY:
            continue
        for number, line in enumerate(prose(page), 1):
            if line.lstrip().startswith("#"):
                continue  # a heading: the section's first sentence links it
            text = re.sub(r"`[^`]*`", "", line)
            for match in CITATION.finditer(text):
                target = re.match(r"\]\(([^)]*)\)", text[match.end():])
                if not (text[:match.start()].endswith("[") and target
                        and target[1].endswith(f"bibliography.md#paper-{match[1]}")):
                    plain.append(f"{name(page)}:{number}: {match[0]}")
    assert not plain, "link these to docs/bibliography.md#paper-NNN:\n" + "\n".join(plain)


def test_readme_links_reach_real_pages_and_anchors():
    readme = ROOT / "README.md"
    broken = []
    for number, target in links(readme):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        page = (readme.parent / path).resolve() if path else readme
        if not page.exists():
            broken.append(f"README.md:{number}: {target} (no such file)")
        elif anchor and page.suffix == ".md" and anchor not in anchors(page):
            broken.append(f"README.md:{number}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_anchor_reader_matches_mkdocs_headings():
    page = Path(ROOT / "docs" / "benchmarks" / "service.md")
    assert {"a-fleet-under-load-fleet_loadpy", "10000-devices", "dishonest-participants"} <= anchors(page)
