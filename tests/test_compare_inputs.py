"""`dpfleet compare` on crafted run directories: each is a real tiny run with one file edited the
way a damaged copy, a hand edit or a hostile folder would have it (wrong types, missing or
truncated files, nesting deep enough for RecursionError, `$...$` that matplotlib would parse as
mathtext, NaN and infinities, huge numbers, non-UTF-8 bytes). Every one either compares (exit 0)
or is one `error:` line (exit 2), never a traceback, with the plot and the TensorBoard export on;
and a refused one leaves no plot and no export behind."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_helpers import run_here
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_compare import CONFIG

from dpfleet.coordinator.state.run_dir import to_toml

DEEP = "[" * 100_000 + "]" * 100_000  # json.loads: RecursionError


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """One finished tiny run (2 rounds), the template every crafted run is copied from."""
    root = tmp_path_factory.mktemp("crafted")
    (root / "tiny.toml").write_text(to_toml(CONFIG))
    proc = run_here("simulate", str(root / "tiny.toml"), "--out", str(root / "base"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    return root / "base"


def edit_json(name: str, change) -> Callable[[Path], None]:
    """A crafting step: `change(obj)` applied to the run's `name` (it may return a new object)."""
    def craft(run: Path) -> None:
        obj = json.loads((run / name).read_text())
        new = change(obj)
        (run / name).write_text(json.dumps(obj if new is None else new, allow_nan=True))
    return craft


def edit_metrics(change) -> Callable[[Path], None]:
    def craft(run: Path) -> None:
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        change(records)
        (run / "metrics.jsonl").write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in records))
    return craft


def write(name: str, data: bytes | str) -> Callable[[Path], None]:
    def craft(run: Path) -> None:
        (run / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return craft


def remove(name: str) -> Callable[[Path], None]:
    return lambda run: (run / name).unlink()


# (case, crafting step, what the error line must say; None: the run compares)
CRAFTED = [
    ("config is a list", write("config.json", "[1, 2]"), "config.json"),
    ("config rounds is text", edit_json("config.json", lambda c: c.update(rounds="two")), "rounds"),
    ("config dp is a number", edit_json("config.json", lambda c: c.update(dp=3)), "dp"),
    ("config delta is text", edit_json("config.json", lambda c: c["dp"].update(delta="1e-6")), "dp.delta"),
    ("config nested deep", write("config.json", '{"rounds": 2, "x": ' + DEEP + "}"), "config.json"),
    ("config truncated", lambda run: write("config.json", (run / "config.json").read_text()[:40])(run),
     "not valid JSON"),
    ("config not UTF-8", write("config.json", b'{"rounds": 2, "\xff\xfe": 1}'), "config.json"),
    ("config huge number", write("config.json", '{"rounds": 2, "big": 1' + "0" * 400 + "}"), "config.json"),
    ("config with more digits than Python parses", write("config.json", '{"n": 1' + "0" * 5000 + "}"),
     "config.json"),
    ("summary is a list", write("summary.json", "[]"), "summary.json"),
    ("summary final is text", edit_json("summary.json", lambda s: s.update(final="good")), "final"),
    ("summary accuracy is text", edit_json("summary.json", lambda s: s["final"].update(accuracy="0.3")),
     "final.accuracy"),
    ("summary wall time NaN", edit_json("summary.json", lambda s: s.update(wall_seconds=float("nan"))),
     "summary.json"),
    ("summary wall time infinite", edit_json("summary.json", lambda s: s.update(wall_seconds=float("inf"))),
     "summary.json"),
    ("summary caveats a string", edit_json("summary.json", lambda s: s.update(caveats="none")), "caveats"),
    ("summary warnings of numbers", edit_json("summary.json", lambda s: s.update(warnings=[1, 2])),
     "warnings"),
    ("summary baseline a list", edit_json("summary.json", lambda s: s.update(unigram_baseline=[0.1])),
     "unigram_baseline"),
    ("summary without final", edit_json("summary.json", lambda s: s.pop("final")), None),
    ("summary nested deep", write("summary.json", DEEP), "summary.json"),
    ("privacy epsilon is text", edit_json("privacy.json", lambda p: p.update(epsilon="7")), "epsilon"),
    ("privacy delta is a list", edit_json("privacy.json", lambda p: p.update(delta=[1e-6])), "delta"),
    ("privacy is a number", write("privacy.json", "3"), "privacy.json"),
    ("privacy not UTF-8", write("privacy.json", b"\x80\x81"), "privacy.json"),
    ("privacy missing", remove("privacy.json"), None),
    ("summary missing", remove("summary.json"), None),
    ("metrics missing", remove("metrics.jsonl"), None),
    ("metrics a number per line", write("metrics.jsonl", "1\n2\n"), "metrics.jsonl"),
    ("metrics round is text", edit_metrics(lambda m: m[0].update(round="one")), "round"),
    ("metrics without round", edit_metrics(lambda m: m[1].pop("round")), "round"),
    ("metrics accuracy is text", edit_metrics(lambda m: m[1].update(accuracy="high")), "accuracy"),
    ("metrics epsilon infinite", edit_metrics(lambda m: m[1].update(epsilon=float("inf"))), "metrics.jsonl"),
    ("metrics huge integer", edit_metrics(lambda m: m[1].update(clients=10 ** 400)), "metrics.jsonl"),
    ("metrics nested deep", write("metrics.jsonl", DEEP + "\n"), "metrics.jsonl"),
    ("metrics torn last line",
     lambda run: write("metrics.jsonl", (run / "metrics.jsonl").read_text()[:-30])(run), None),
    # a killed append may cut a character in two: read as a torn line, so the rounds before it
    ("metrics not UTF-8", write("metrics.jsonl", b'{"round": 1, "x": "\xff"}\n'), None),
    ("debug lines are lists", write("debug_nonprivate.jsonl", "[1]\n[2]\n"), "debug_nonprivate.jsonl"),
    ("mathtext in a config value", edit_json("config.json", lambda c: c.update(note="$\\frac{1}{$")), None),
    ("mathtext in a noise name", edit_json("summary.json", lambda s: s.update(noise_mechanism="$x^$")), None),
]


def crafted_run(base: Path, tmp: Path, name: str, craft) -> Path:
    run = tmp / name
    shutil.copytree(base, run)
    craft(run)
    return run


def compare_all(run: Path, tmp: Path):
    """`dpfleet compare` with everything on: the table, the plot and the TensorBoard export."""
    return run_here("compare", str(run), "--plot", str(tmp / "plot.png"), "--tensorboard", str(tmp / "tb"))


def assert_one_line_or_success(proc, needle: str | None, tmp: Path) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr
    if needle is None:
        assert proc.returncode == 0, proc.stderr
        assert (tmp / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        return
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and needle in lines[0], lines[0]
    assert not (tmp / "plot.png").exists() and not (tmp / "tb").exists()  # nothing half-written


@pytest.mark.parametrize(("case", "craft", "needle"), CRAFTED, ids=[c[0] for c in CRAFTED])
def test_a_crafted_run_is_compared_or_one_error_line(base, tmp_path, case, craft, needle):
    run = crafted_run(base, tmp_path, "run", craft)
    assert_one_line_or_success(compare_all(run, tmp_path), needle, tmp_path)


def test_a_run_named_with_mathtext_is_plotted_as_its_name(base, tmp_path):
    """A run folder `$\\frac{1}{$` (an unclosed mathtext): matplotlib raised ValueError when it
    drew the legend; the labels are now plain text."""
    run = crafted_run(base, tmp_path, "$\\frac{1}{$ run", lambda run: None)
    assert_one_line_or_success(compare_all(run, tmp_path), None, tmp_path)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                  max_size=3),
                    max_leaves=8)
FIELDS = [("summary.json", ("final", "accuracy")), ("summary.json", ("rounds_completed",)),
          ("summary.json", ("wall_seconds",)), ("summary.json", ("fully_private",)),
          ("summary.json", ("unigram_baseline",)), ("summary.json", ("stopped_early",)),
          ("privacy.json", ("epsilon",)), ("privacy.json", ("delta",)), ("privacy.json", ("caveats",)),
          ("config.json", ("rounds",)), ("config.json", ("dp", "delta")), ("config.json", ("dp",))]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=JSON)
def test_any_json_value_in_a_read_field_is_compared_or_one_error_line(base, tmp_path_factory, field, value):
    tmp = tmp_path_factory.mktemp("any")
    name, keys = field

    def put(obj):
        for key in keys[:-1]:
            obj = obj[key]
        obj[keys[-1]] = value

    run = crafted_run(base, tmp, "run", edit_json(name, put))
    proc = run_here("compare", str(run), "--no-plot", "--json")
    assert "Traceback" not in proc.stderr, proc.stderr
    if proc.returncode:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
