"""`dp.mechanism = "independent"` (coordinator/mechanisms/independent.py): the mechanism added as
one file to show issue 31's payoff. Scored on the values: the noise the server added is exactly
fresh N(0, (z C)^2) node noise per round from the key, its sensitivity is MaxP whatever the
separation, and it runs from the config, the CLI and Python, with ring noise and a resume."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_mechanism_binding import RUN, crashed, releases
from test_mf_simulate import spied_run
from test_noise_secrecy import QUIET

import dpfleet
from dpfleet.cli import main
from dpfleet.coordinator.accounting.zcdp import epsilon_from_zcdp, zcdp_from_sensitivity
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine import simulation
from dpfleet.coordinator.mechanisms.independent import DOMAINS, IndependentMechanism
from dpfleet.coordinator.mechanisms.noise_stream import GaussianNodes
from dpfleet.coordinator.mechanisms.registry import build, names
from dpfleet.coordinator.state.run_dir import to_toml

INDEPENDENT = {**RUN, "dp": {**RUN["dp"], "mechanism": "independent"}}


def test_it_is_registered_and_the_config_names_it():
    assert "independent" in names()
    assert isinstance(build("independent", 10, 2, 3), IndependentMechanism)
    assert parse_config(INDEPENDENT).dp.mechanism == "independent"


@settings(max_examples=100, deadline=None)
@given(rounds=st.integers(1, 500), mins=st.integers(0, 50), maxp=st.integers(0, 20),
       restarts=st.lists(st.integers(1, 499), max_size=3))
def test_sensitivity_is_the_participation_count_whatever_the_separation(rounds, mins, maxp, restarts):
    assert IndependentMechanism().sensitivity_squared(rounds, mins, maxp, restarts) == maxp


def test_each_rounds_noise_is_a_fresh_node_from_the_key(tmp_path, monkeypatch):
    """The server's added noise per round equals node (0, 0, t) of the key under the mechanism's
    own domain, and rounds are independent (no node of one round is in another)."""
    result, sums, noises, keys = spied_run(tmp_path, monkeypatch, "ind", INDEPENDENT)
    dim = sums.shape[1]
    std = RUN["dp"]["noise_multiplier"] * RUN["dp"]["clip_norm"]
    nodes = GaussianNodes(keys[0], std, dim, DOMAINS["model"])
    expected = np.array([nodes(0, 0, t) for t in range(1, len(noises) + 1)], dtype=np.float64)
    assert np.abs(noises - expected).max() < 1e-4 * std  # float32 rounding of the model only
    assert abs(float(np.corrcoef(expected[0], expected[1])[0, 1])) < 0.05
    privacy = result.privacy
    rho = zcdp_from_sensitivity(RUN["dp"]["noise_multiplier"], privacy["max_participation"])
    assert privacy["zcdp"] == rho and privacy["epsilon"] == epsilon_from_zcdp(rho, privacy["delta"])
    assert privacy["mechanism"] == "independent" and privacy["accounted_by_dpfleet"] is True


def test_it_runs_from_the_cli_with_ring_noise(tmp_path, capsys):
    config = tmp_path / "ind.toml"
    config.write_text(to_toml(parse_config({**INDEPENDENT, "aggregation": {"kind": "secagg"}}).resolved()))
    main(["simulate", str(config), "--out", str(tmp_path / "run"), "--quiet"])
    privacy = json.loads((tmp_path / "run" / "privacy.json").read_text())
    assert privacy["noise_kind"] == "discrete" and privacy["mechanism"] == "independent"
    assert privacy["method"] == "rdp"  # a discrete Gaussian per round: RDP of its zCDP
    rho = zcdp_from_sensitivity(RUN["dp"]["noise_multiplier"], privacy["max_participation"])
    assert privacy["epsilon"] == epsilon_from_zcdp(rho, privacy["delta"], "rdp")


def test_python_object_equals_the_config_name_bit_for_bit(tmp_path):
    seeded = {**INDEPENDENT, "dp": {**INDEPENDENT["dp"], "noise_seed": 3}}  # the same noise twice
    named = simulation.run_simulation(parse_config(seeded), tmp_path / "named", **QUIET)
    passed = simulation.run_simulation(parse_config({**seeded, "dp": {**seeded["dp"], "mechanism": "tree"}}),
                                       tmp_path / "passed", **QUIET,
                                       extensions={"noise": IndependentMechanism()})
    assert [r["released"] for r in releases(tmp_path / "named")] == \
        [r["released"] for r in releases(tmp_path / "passed")]
    assert named.privacy["zcdp"] == passed.privacy["zcdp"]


def test_a_crashed_independent_run_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch):
    whole = simulation.run_simulation(parse_config(INDEPENDENT), tmp_path / "whole", **QUIET)
    run = crashed(tmp_path, monkeypatch, INDEPENDENT)
    resumed = simulation.run_simulation(parse_config(INDEPENDENT), run, resume=True, **QUIET)
    assert resumed.privacy["epsilon"] == whole.privacy["epsilon"]
    assert [r["round"] for r in releases(run)] == list(range(1, 7))


def test_adaptive_clipping_runs_on_it(tmp_path):
    values = {**INDEPENDENT, "dp": {**INDEPENDENT["dp"], "adaptive_clipping": True,
                                    "clip_count_stddev": 2.0}}
    result = dpfleet.simulate(values, run_dir=tmp_path / "ad", progress=False)
    clips = [m["clip"] for m in result.metrics]
    assert len(set(clips)) > 1  # adopted every round (no restarts needed)
    assert result.epsilon == pytest.approx(result.privacy["epsilon"])


def test_dpfleet_account_and_plan_name_it(capsys):
    main(["account", "-z", "2", "-T", "60", "-P", "3", "-S", "10", "--mechanism", "independent", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["mechanism"] == "independent" and out["sensitivity_squared"] == 3
    assert out["zcdp"] == zcdp_from_sensitivity(2.0, 3)
    main(["plan", "-N", "1277", "-T", "60", "--target-epsilon", "8", "--delta", "1e-6",
          "--mechanism", "independent", "--json"])
    plan = json.loads(capsys.readouterr().out)
    row = next(r for r in plan["mechanisms"] if r["mechanism"] == "independent")
    assert plan["mechanism"] == "independent"
    assert row["sensitivity_squared"] == plan["chosen"]["max_participation"]
