"""The docs stay scannable and their references resolve: no paragraph, list item or table row over
MAX_WORDS (the benchmarks page once held one of 722 words), nor a block with no gap in it (a tight
list once ran to 491 words), every "paper 00N" in the prose links to its bibliography entry, and
README's links (which mkdocs does not check) reach real pages and anchors.

The pages speak to users: no page, and no docstring the API pages render, cites the project's
internal issue numbers (say what was decided instead). The home page carries README's two commands,
its results and the accuracy-vs-eps plot; every benchmark plot is shown on some page."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from docs_markdown import ROOT, anchors, blocks, links, name, pages, paragraphs, prose, runs, words

MAX_WORDS = 150
BIBLIOGRAPHY = ROOT / "docs" / "bibliography.md"
CITATION = re.compile(r"\bpaper (\d{3})\b")
ISSUE = re.compile(r"\bissues? #?\d+|(?<![\w/.#-])#\d+(?![\w-])", re.IGNORECASE)  # not an #anchor
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)")
PLOTS = ROOT / "benchmarks" / "results"
HOME = ROOT / "docs" / "index.md"


def test_no_paragraph_is_longer_than_a_reader_scans():
    long = [f"{name(page)}:{line}: {words(text)} words: {text[:70]}..."
            for page in pages() for line, text in paragraphs(page) if words(text) > MAX_WORDS]
    assert not long, "break these into lists or tables (keep every number):\n" + "\n".join(long)


def test_no_block_without_a_gap_is_longer_than_a_reader_scans():
    long = [f"{name(page)}:{line}: {words(text)} words: {text[:70]}..."
            for page in pages() for line, text in runs(page) if words(text) > MAX_WORDS]
    assert not long, ("split these where the meaning splits, or leave a blank line between a long "
                      "list's items:\n" + "\n".join(long))


def test_the_run_reader_keeps_a_tight_list_together(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\none two\n- three\n  four\n- five\n\n- six\n\n| a | b |\nseven\n"
                    "```text\nnot prose\n```\neight\n")
    assert [(line, words(text)) for line, text in runs(page)] == [(2, 5), (7, 1), (10, 1), (14, 1)]


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


def rendered_modules() -> list[Path]:
    """The source files of the modules the API pages render (`::: dpfleet.x.y`), by pyproject's
    package-dir mapping (the layout docs/_hooks/package_tree.py gives mkdocstrings)."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    files = set()
    for page in (ROOT / "docs" / "api").rglob("*.md"):
        for module in re.findall(r"^::: ([\w.]+)", page.read_text(), re.MULTILINE):
            package = max((p for p in mapping if module == p or module.startswith(p + ".")), key=len)
            rest = module[len(package):].lstrip(".")
            folder = ROOT / mapping[package]
            files.add(folder / f"{rest.replace('.', '/')}.py" if rest else folder / "__init__.py")
    return sorted(files)


def rendered_docstrings(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, text) of what mkdocstrings shows of a module: its docstring and those of its public
    classes, functions, methods (and __init__, merged into its class) and attributes."""
    found = []

    def visit(body: list[ast.stmt]) -> None:
        for i, node in enumerate(body):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, str):
                previous = body[i - 1] if i else None
                targets = (previous.targets if isinstance(previous, ast.Assign) else
                           [previous.target] if isinstance(previous, ast.AnnAssign) else [])
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                if i == 0 or any(not n.startswith("_") for n in names):
                    found.append((node.lineno, node.value.value))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) \
                    and (not node.name.startswith("_") or node.name == "__init__"):
                if isinstance(node, ast.ClassDef):
                    visit(node.body)
                elif ast.get_docstring(node) is not None:
                    found.append((node.body[0].lineno, ast.get_docstring(node)))

    visit(tree.body)
    return found


def test_no_page_cites_an_internal_issue_number():
    cited = [f"{name(page)}:{number}: {line.strip()[:90]}" for page in pages()
             for number, line in enumerate(prose(page), 1) if ISSUE.search(line)]
    assert not cited, "say what was decided instead of the issue number:\n" + "\n".join(cited)


def test_no_rendered_docstring_cites_an_internal_issue_number():
    modules = rendered_modules()
    assert len(modules) > 50 and all(path.is_file() for path in modules)
    cited = [f"{name(path)}:{line + text[:match.start()].count(chr(10))}: {match[0]}" for path in modules
             for line, text in rendered_docstrings(ast.parse(path.read_text()))
             for match in ISSUE.finditer(text)]
    assert not cited, "the API pages show these; say what was decided instead:\n" + "\n".join(cited)


def test_the_docstring_reader_takes_what_the_api_pages_show():
    tree = ast.parse('"""mod"""\nX = 1\n"""x"""\n_Y = 2\n"""y"""\nclass A:\n    """a"""\n'
                     '    def __init__(self):\n        """init"""\n    def _p(self):\n        """p"""\n'
                     'def _f():\n    """f"""\ndef g():\n    """g"""\n')
    assert [text for _, text in rendered_docstrings(tree)] == ["mod", "x", "a", "init", "g"]


def images(page: Path) -> list[Path]:
    """The files a page's images show, where the site serves them: docs/ itself, and benchmark plots
    at their repository path (docs/_hooks/benchmark_plots.py)."""
    found = []
    for target in IMAGE.findall("\n".join(prose(page))):  # the alt text may span lines
        site_path = (page.parent / target).resolve().relative_to((ROOT / "docs").resolve())
        in_docs, in_results = ROOT / "docs" / site_path, ROOT / site_path
        found.append(in_docs if in_docs.exists() or not in_results.exists() else in_results)
    return found


def test_every_benchmark_plot_is_shown_on_a_page():
    shown = {image for page in pages()[1:] for image in images(page)}
    missing = sorted(p.name for p in PLOTS.glob("*.png") if p not in shown)
    assert not missing, f"benchmarks/results plots no docs page embeds: {missing}"
    broken = sorted(f"{name(page)}: {image}" for page in pages()[1:] for image in images(page)
                    if not image.is_file())
    assert not broken, f"images that point nowhere: {broken}"


def test_the_plots_hook_serves_each_plot_at_its_repository_path(tmp_path):
    """What images() assumes: docs/_hooks/benchmark_plots.py puts benchmarks/results/NAME.png into
    the site as benchmarks/results/NAME.png."""
    pytest.importorskip("mkdocs")
    from mkdocs.structure.files import Files

    path = ROOT / "docs" / "_hooks" / "benchmark_plots.py"
    spec = importlib.util.spec_from_file_location("benchmark_plots", path)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    config = SimpleNamespace(config_file_path=str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path),
                             use_directory_urls=True)
    served = {f.src_uri: (Path(f.abs_src_path), Path(f.abs_dest_path))
              for f in hook.on_files(Files([]), config)}
    plots = sorted(PLOTS.glob("*.png"))
    site = tmp_path / "benchmarks" / "results"
    assert plots and served == {f"benchmarks/results/{p.name}": (p, site / p.name) for p in plots}


def test_the_home_page_has_the_commands_the_results_and_the_plot():
    readme = ROOT / "README.md"
    home = {block.code for block in blocks(HOME)}
    commands = [block.code for block in blocks(readme) if block.lang == "bash"
                and ("dpfleet simulate" in block.code or "pytest" in block.code)]
    assert len(commands) == 2 and all(code in home for code in commands), commands
    results = "\n".join(prose(readme)).split("## Results", 1)[1].split("\n## ", 1)[0]
    figures = {figure for row in results.split("\n") if row.startswith("| ") and "---" not in row
               for figure in re.findall(r"\d[\d,.]*\d", row.split(" | ")[1])}
    table = "\n".join(line for line in prose(HOME) if line.startswith("|"))
    assert len(figures) > 20 and not sorted(f for f in figures if f not in table)
    assert PLOTS / "mechanisms.png" in images(HOME)


def test_the_built_site_is_not_committed():
    ignored = subprocess.run(["git", "check-ignore", "-q", "site/index.html"], cwd=ROOT)
    assert ignored.returncode == 0, "add site/ (mkdocs build's output) to .gitignore"
