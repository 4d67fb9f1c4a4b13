"""benchmarks/mechanisms.py's cells: the planner decides every planned key, and a projection row
carries the large population's noise per device at the small population's report goal."""

import importlib.util
from pathlib import Path

import pytest

from dpfleet.coordinator.accounting.planner import make_plan, mechanism_rows
from dpfleet.coordinator.accounting.zcdp import zcdp_for_epsilon
from dpfleet.coordinator.config import parse_config, read_toml
from dpfleet.coordinator.run_privacy.config_plan import read_run_config

_path = Path(__file__).parents[1] / "benchmarks" / "mechanisms.py"
_spec = importlib.util.spec_from_file_location("bench_mechanisms", _path)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

BASE = {**read_toml(bench.CONFIG), "rounds": 6}
BASE["dp"] = {**BASE["dp"], "report_goal": 3, "noise_multiplier": 9.0}  # stale keys a cell must drop


def test_a_cell_leaves_the_planned_keys_to_the_planner_and_pairs_the_noise():
    values, extra = bench.cell_values(BASE, "blt", 4.0, 3, "none")
    cfg, plan = read_run_config(values)
    assert (cfg.dp.target_epsilon, cfg.dp.mechanism, cfg.seed, cfg.dp.noise_seed) == (4.0, "blt", 3, 3)
    assert plan.given == {"dp.mechanism": "blt"} and extra == {}
    assert not cfg.pretrain.corpus  # public "none" drops [pretrain]
    assert parse_config(bench.cell_values(BASE, "tree", 4.0, 3, "pretrain")[0]).pretrain.corpus == ["kjv"]


def test_a_projection_has_the_large_fleets_noise_per_device():
    values, extra = bench.cell_values(BASE, "banded", 8.0, 0, "none", projection=100_000, population=1277)
    cfg = parse_config(values)
    rho = zcdp_for_epsilon(8.0, 1e-6)
    big = make_plan(100_000, 6, rho).chosen
    z_big = mechanism_rows(big, 6, rho, ("banded",))[0].noise_multiplier
    small = make_plan(1277, 6, rho).chosen
    assert cfg.dp.target_epsilon == 0 and cfg.dp.mechanism == "banded"
    assert cfg.dp.report_goal == small.report_goal
    assert cfg.dp.noise_multiplier / cfg.dp.report_goal == pytest.approx(z_big / big.report_goal, rel=1e-12)
    assert extra["projection_report_goal"] == big.report_goal > 10 * small.report_goal
    assert (cfg.participation.mode, cfg.participation.min_separation, cfg.participation.max_participation) \
        == ("uniform", small.min_separation, small.max_participation)


def test_a_done_cell_is_found_by_its_target_not_the_accounted_eps():
    row = {"mechanism": "blt", "epsilon": 7.999999828, "target_epsilon": 8.0, "seed": 2,
           "public": "pretrain kjv 3000 steps", "projection_population": 0}
    assert bench.key(row) == ("blt", 8.0, 2, "pretrain", 0)  # what main() looks up before running
