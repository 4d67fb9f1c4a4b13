"""Config values no run can honour are refused at validation, in one line, before anything is
written: a SecAgg ring of 0 bits (a `negative shift count` traceback), round durations of 1e-300
or 1e308 minutes and other non-finite or overflowing numbers, and a `dp.delta` at or above 1/N,
where a mechanism that publishes one user's data outright still meets the (eps, delta) promise
(the run used to say "fully private")."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
from cli_helpers import run_here
from hypothesis import given, settings
from hypothesis import strategies as st
from test_compare import CONFIG

from dpfleet.coordinator.config import SimulationConfig, parse_config
from dpfleet.coordinator.state.run_dir import to_toml
from dpfleet.errors import DpfleetError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("extremes") / "tiny.toml"
    path.write_text(to_toml(CONFIG))
    return path


def refused(tiny, tmp_path, *sets: str) -> str:
    """`simulate` with these `--set`s: exit 2, one `error:` line, and no run directory."""
    args = [a for s in sets for a in ("--set", s)]
    proc = run_here("simulate", str(tiny), "--out", str(tmp_path / "runs" / "run"), "--quiet", *args)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in proc.stderr and proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and not (tmp_path / "runs").exists(), lines
    return lines[0]


@pytest.mark.parametrize("bits", ["0", "-1", "33", "64"])
def test_a_secagg_ring_of_no_bits_is_refused(tiny, tmp_path, bits):
    line = refused(tiny, tmp_path, "aggregation.kind=secagg", f"aggregation.bits={bits}")
    assert line == f"error: aggregation.bits must be in 1..32, got {bits}"


@pytest.mark.parametrize("minutes", ["1e-300", "1e300", "inf", "nan", "0.001", "1e7"])
@pytest.mark.parametrize("mode", ["disjoint", "timer"])
def test_a_round_duration_out_of_range_is_refused(tiny, tmp_path, minutes, mode):
    line = refused(tiny, tmp_path, f"participation.mode={mode}", f"participation.round_minutes={minutes}")
    assert "participation.round_minutes" in line


@pytest.mark.parametrize("setting", ["dp.clip_norm=inf", "dp.noise_multiplier=nan",
                                     "dp.noise_multiplier=inf", "client.lr=inf",
                                     "participation.timer_period=1e300", "dp.server_lr=-inf"])
def test_a_number_that_is_not_finite_is_refused(tiny, tmp_path, setting):
    assert setting.split("=")[0] in refused(tiny, tmp_path, setting)


def test_delta_at_or_above_one_over_the_population_is_refused(tiny, tmp_path):
    """40 users: delta 0.5 (and 1/40) let a run publish a user's data and meet its promise."""
    for delta in ("0.5", str(1 / 40)):
        line = refused(tiny, tmp_path, f"dp.delta={delta}")
        assert f"dp.delta = {float(delta):g} is not below 1/N = 1/40" in line


def test_a_coordinator_refuses_such_a_delta_and_leaves_no_state(tiny, tmp_path):
    config = tmp_path / "half.toml"
    config.write_text(to_toml({**CONFIG, "dp": {**CONFIG["dp"], "delta": 0.5}}))
    proc = run_here("service", "serve", str(config), "--state", str(tmp_path / "state"))
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in proc.stderr and proc.returncode == 2, proc.stderr
    assert "dp.delta = 0.5 is not below 1/N = 1/40" in lines[-1] and not (tmp_path / "state").exists()


def numeric_keys() -> list[tuple[tuple[str, ...], str]]:
    """Every int or float key of the config (top level and each section's), with its type."""
    keys = []
    for f in dataclasses.fields(SimulationConfig):
        section = getattr(SimulationConfig(), f.name)
        if f.type in ("int", "float"):
            keys.append(((f.name,), f.type))
        elif dataclasses.is_dataclass(section):
            keys += [((f.name, g.name), g.type) for g in dataclasses.fields(section)
                     if g.type in ("int", "float")]
    return keys


EXTREME = st.sampled_from([0, -1, 2 ** 63, -(2 ** 63), 1e-300, 1e300, math.inf, -math.inf, math.nan, 5e-324])


@settings(max_examples=200, deadline=None)
@given(key=st.sampled_from(numeric_keys()), value=EXTREME)
def test_an_extreme_number_anywhere_is_refused_or_finite_after_validation(key, value):
    """Every numeric key with an extreme value: refused in one DpfleetError, or what validation
    accepts is finite and within int64 (so nothing downstream sees NaN, infinity or an integer
    numpy cannot hold)."""
    path, kind = key
    values = copy.deepcopy(CONFIG)
    table = values
    for part in path[:-1]:
        table = table.setdefault(part, {})
    table[path[-1]] = value
    try:
        cfg = parse_config(values)
    except DpfleetError:
        return
    for part in path:
        cfg = getattr(cfg, part)
    assert math.isfinite(cfg) and (kind == "float" or abs(cfg) < 2 ** 63), (path, value)


PLAN = ("plan", "-N", "1277", "-T", "60", "--target-epsilon", "8")


@pytest.mark.parametrize(("args", "needle"), [
    ((*PLAN, "--delta", "0.5"), "--delta = 0.5 is not below 1/N = 1/1277"),  # planned at 0.5
    ((*PLAN, "--delta", "1e-6", "--round-minutes", "1e-300"), "--round-minutes must be between"),
    (("plan", "-N", str(10 ** 22), "-T", "60", "--target-zcdp", "1"), "population"),  # numpy TypeError
    (("account", "-z", "1e-300", "-T", "10", "--delta", "1e-6"), "noise multiplier"),  # ZeroDivisionError
])
def test_the_accounting_commands_refuse_extremes_in_one_line(args, needle):
    """`plan` and `account` take the same kind of numbers on the command line: a delta at or
    above 1/N, a round of 1e-300 minutes, a population beyond numpy's integers, a noise
    multiplier whose square is 0."""
    proc = run_here(*args)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in proc.stderr and proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and needle in lines[0], lines[0]
