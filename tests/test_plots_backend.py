"""Library plots leave the caller's matplotlib alone: a notebook user's inline backend stays
inline after `dpfleet.sweep` or a plan draws its figure (they switched the process to Agg with
`matplotlib.use`, so the notebook's own plots stopped showing). Each draws on a `Figure` of its
own, never through pyplot."""

import ast
from pathlib import Path

import matplotlib
import pytest

from dpfleet.coordinator.sweep import plot_summary
from dpfleet.public.fred_job import plot_ranking

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("coordinator", "edge", "export", "secagg", "service", "fleet", "public", "dpfleet")
PNG = b"\x89PNG"


def offenders(path: Path) -> list[str]:
    """`import matplotlib.pyplot` (in any form) and `matplotlib.use(...)` calls in one module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name == "matplotlib.pyplot" for a in node.names):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports pyplot")
        if isinstance(node, ast.ImportFrom) and (node.module == "matplotlib.pyplot" or (
                node.module == "matplotlib" and any(a.name == "pyplot" for a in node.names))):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports pyplot")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "use"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "matplotlib"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} calls matplotlib.use")
    return found


def test_no_library_module_uses_pyplot_or_switches_the_backend():
    modules = [p for d in LIBRARY for p in (ROOT / d).rglob("*.py")]
    assert len(modules) > 100
    assert [o for p in modules for o in offenders(p)] == []


@pytest.fixture
def svg_backend():
    """The caller's backend: svg here (a notebook's would be inline), restored afterwards."""
    before = matplotlib.get_backend()
    matplotlib.use("svg")
    yield
    matplotlib.use(before)


def test_plots_leave_the_callers_backend_alone(tmp_path, svg_backend):
    plot_ranking([{"candidate": "wiki", "fred": 1.5}, {"candidate": "news", "fred": 2.5}], "FreD",
                 tmp_path / "ranking.png")
    point = {"accuracy": {"mean": 0.1, "ci95": 0.01}, "unigram_accuracy": {"mean": 0.05}}
    summary = {"grid": {"dp.noise_multiplier": [0.5, 1.0]},
               "points": [{**point, "values": {"dp.noise_multiplier": z}} for z in (0.5, 1.0)]}
    plot_summary(summary, tmp_path / "sweep.png")
    assert matplotlib.get_backend() == "svg"
    assert all((tmp_path / f).read_bytes()[:4] == PNG for f in ("ranking.png", "sweep.png"))
