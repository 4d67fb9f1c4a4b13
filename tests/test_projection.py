"""A projection to a production-size population (`[projection]`, pfl-research's method: train a
small cohort, add the noise of the large one).

The attack first: a projected run must never show the projected eps as its own. Every place the
run is shown (privacy.json, summary.json, privacy_report.md, the console's result block, the
metrics log, the Result) is read back and its real eps is checked against the one recomputed here
from the config alone: the actual noise (z * M_train / M_noise) on the actual sum over the run's
real users. Hand values: T = 2 rounds, each device at most once, so the tree's sens^2 = 2 (a
round-1 device is in the leaf and in the root); z = 4, M_train = 5, M_noise = 20 give a real
multiplier 4 * 5 / 20 = 1 and rho = 2 / (2 * 1^2) = 1; the projection (MinS = 100,000 // 20 - 1,
MaxP = 1, the same sens^2) has rho = 2 / (2 * 4^2) = 0.0625.
"""

import json
import math

import numpy as np
import pytest
from test_api import CONFIG, USERS, TinyLM, WordIds

import dpfleet
from dpfleet.coordinator.accounting.zcdp import epsilon_from_zcdp
from dpfleet.coordinator.cli.result_block import saved_result_lines
from dpfleet.coordinator.config import parse_config, projection_factor
from dpfleet.coordinator.engine.dp_ftrl import DPFTRLConfig, DPFTRLServer
from dpfleet.coordinator.mechanisms.noise_stream import seeded_noise_key
from dpfleet.errors import DpfleetError

Z, M_TRAIN, M_NOISE, N_PLAN, DELTA = 4.0, 5, 20, 100_000, 1e-6
PROJECTED = {**CONFIG, "dp": {**CONFIG["dp"], "noise_multiplier": Z, "report_goal": M_TRAIN, "delta": DELTA},
             "projection": {"noise_cohort": M_NOISE, "population": N_PLAN}}
TRAIN_USERS = 24  # the 30 users less test_fraction 0.2 held out: the real population
LABEL = "projection: a simulation of DP at population 100,000, not a guarantee"


def _real_eps_from_config() -> tuple[float, float]:
    """(rho, eps) of the run's own guarantee, from the config alone (module docstring)."""
    dp, proj = PROJECTED["dp"], PROJECTED["projection"]
    z_real = dp["noise_multiplier"] * dp["report_goal"] / proj["noise_cohort"]
    rho = 2 / (2 * z_real ** 2)
    return rho, epsilon_from_zcdp(rho, dp["delta"], "pld")


@pytest.fixture(scope="module")
def projected(tmp_path_factory):
    return dpfleet.simulate(PROJECTED, model=TinyLM(), users=USERS, tokenizer=WordIds(), progress=False,
                            run_dir=tmp_path_factory.mktemp("projection") / "run")


def test_the_real_guarantee_is_never_shown_as_the_projected_one(projected):
    rho, eps = _real_eps_from_config()
    assert rho == 1.0
    proj_eps = epsilon_from_zcdp(0.0625, DELTA, "pld")
    assert proj_eps < eps / 4  # the two are far apart: showing one for the other is visible
    run_dir = projected.run_dir
    privacy = json.loads((run_dir / "privacy.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    # privacy.json: the top-level figures are the run's own; the projection is a labelled block
    assert privacy["noise_multiplier"] == 1.0 and privacy["population"] == TRAIN_USERS
    assert privacy["zcdp"] == pytest.approx(rho) and privacy["epsilon"] == pytest.approx(eps)
    p = privacy["projection"]
    assert p["label"] == LABEL and p["epsilon_is_a_guarantee"] is False
    assert (p["population"], p["noise_cohort"], p["train_cohort"]) == (N_PLAN, M_NOISE, M_TRAIN)
    assert p["noise_multiplier"] == Z and p["noise_scale"] == 0.25
    assert (p["min_separation"], p["max_participation"]) == (N_PLAN // M_NOISE - 1, 1)
    assert p["zcdp"] == pytest.approx(0.0625) and p["epsilon"] == pytest.approx(proj_eps)
    # summary.json: both, each saying what it is
    s = summary["projection"]
    assert s["label"] == LABEL
    assert s["real"]["epsilon"] == pytest.approx(eps) and s["real"]["noise_multiplier"] == 1.0
    assert s["real"]["population"] == TRAIN_USERS and "not" not in s["real"]["what"]
    assert s["projected"]["epsilon"] == pytest.approx(proj_eps) and s["projected"]["population"] == N_PLAN
    assert any("projection" in c for c in summary["caveats"])
    # the metrics log: the actual noise std on the actual sum is z_real * C; its eps the real one
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [m["noise_std"] for m in metrics] == [1.0, 1.0]
    assert metrics[-1]["epsilon"] == pytest.approx(eps)
    assert projected.epsilon == pytest.approx(eps)  # the Result
    # the report: the formal statement is the real eps; the projected eps only beside its label
    report = (run_dir / "privacy_report.md").read_text().splitlines()
    statement = next(line for line in report if line.startswith("**Formal statement.**"))
    assert f"{eps:.4g}" in statement and f"{proj_eps:.4g}" not in statement
    assert all(LABEL in line for line in report if f"{proj_eps:.4g}" in line)
    assert any(f"{proj_eps:.4g}" in line for line in report)
    # the console: every eps printed says which it is
    lines = saved_result_lines(run_dir)
    eps_lines = [line for line in lines if "eps = " in line]
    real_line = next(line for line in eps_lines if f"{eps:.2f}" in line)
    proj_line = next(line for line in eps_lines if f"{proj_eps:.2f}" in line)
    assert "this run's own guarantee" in real_line and "projection" not in real_line.lower()
    assert LABEL in proj_line and len(eps_lines) == 2


def test_the_noise_is_scaled_by_one_factor_on_the_released_average():
    """Zero deltas, no momentum: theta moves by exactly the noise on the average, so the projected
    server's move is M_train / M_noise = 0.25 times the unprojected one's (same key)."""
    cfg = parse_config(PROJECTED)
    assert projection_factor(cfg) == 0.25 and projection_factor(parse_config(CONFIG)) == 1.0
    moves = []
    for scale in (1.0, 0.25):
        server = DPFTRLServer(np.zeros(64, dtype=np.float32),
                              DPFTRLConfig(noise_multiplier=Z, clip_norm=1.0, report_goal=M_TRAIN,
                                           momentum=0.0, noise_scale=scale),
                              noise_key=seeded_noise_key(3))
        assert server.noise_std == Z * scale
        moves.append(server.step(np.zeros(64, dtype=np.float32)).copy())
    np.testing.assert_allclose(moves[1], 0.25 * moves[0], rtol=1e-6)
    assert np.std(moves[1]) == pytest.approx(Z * 0.25 / M_TRAIN, rel=0.5)  # z C / M_noise


def _proj(cohort: int, population: int | None = None) -> dict:
    return {"projection": {"noise_cohort": cohort, **({"population": population} if population else {})}}


@pytest.mark.parametrize("change, message", [
    (_proj(4, N_PLAN), r"projection.noise_cohort = 4 .* >= dp.report_goal"),
    (_proj(20, 10), r"projection.population = 10 .* >= projection.noise_cohort"),
    (_proj(20), r"projection.noise_cohort and projection.population go together"),
    (_proj(20, 2_000_000), r"dp.delta .* 1/N .* projection.population"),
    ({"rounds": 6000, "projection": {"noise_cohort": 20, "population": N_PLAN, "min_separation": 5000}},
     r"projection.min_separation = 5000 .* 5001 x 20 > 100000"),
    ({"projection": {"noise_cohort": 20, "population": N_PLAN, "min_separation": -2}},
     r"projection.min_separation = -2 must be >= 0"),
    ({"projection": {"noise_cohort": 20, "population": N_PLAN, "max_participation": -1}},
     r"projection.max_participation = -1 must be >= 0"),
    ({"aggregation": {"kind": "secagg"}}, r"projection .* aggregation.kind = 'plain'"),
    ({"dp": {**PROJECTED["dp"], "target_epsilon": 8.0}}, r"dp.target_epsilon .*dpfleet plan -N 100000"),
    ({"dp": {**PROJECTED["dp"], "adaptive_clipping": True}}, r"projection .*dp.adaptive_clipping"),
])
def test_a_projection_that_cannot_be_run_is_one_clear_error(change, message):
    with pytest.raises(DpfleetError, match=message):
        parse_config({**PROJECTED, **change})


def test_the_service_refuses_a_projection():
    from dpfleet.coordinator.serve_plan import check_service_config

    with pytest.raises(DpfleetError, match=r"\[projection\] is a simulation .*`dpfleet simulate`"):
        check_service_config(parse_config(PROJECTED))


def test_without_a_projection_nothing_changes(tmp_path):
    cfg = parse_config(CONFIG)
    assert (cfg.projection.noise_cohort, cfg.projection.population) == (0, 0)
    assert math.isclose(projection_factor(cfg), 1.0)


def test_the_noise_warning_reads_the_noise_the_average_carries(projected):
    """z / M_noise = 4 / 20 = 0.2 is on the released average, not z / M_train = 0.8; the eps warning
    says its eps is the run's own."""
    summary = json.loads((projected.run_dir / "summary.json").read_text())
    noise = [w for w in summary["warnings"] if w.startswith("noise drowns")]
    assert len(noise) == 1 and "noise multiplier / projection.noise_cohort = 4 / 20 = 0.2 " in noise[0]
    assert all("this run's own" in w for w in summary["warnings"] if w.startswith("eps above"))


def test_the_projected_eps_is_the_planners_for_the_planned_launch():
    """pfl's StackOverflow setting in dpfleet's accounting: the planner's z for cohorts of 5,000 over
    10^6 devices, 20 rounds, eps 2 at delta 1e-7; a run training 5 a round with that z projects
    exactly that eps (MinS 10^6 // 5,000 - 1 = 199, MaxP 1), and its own multiplier is z / 1,000."""
    from dpfleet.coordinator.accounting.planner import make_plan
    from dpfleet.coordinator.accounting.zcdp import zcdp_for_epsilon
    from dpfleet.coordinator.mechanisms.matrix import as_mechanism
    from dpfleet.coordinator.run_privacy.projection import projected_privacy

    row = make_plan(1_000_000, 20, zcdp_for_epsilon(2.0, 1e-7), delta=1e-7, report_goal=5000).chosen
    cfg = parse_config({**CONFIG, "rounds": 20, "projection": {"noise_cohort": 5000, "population": 1_000_000},
                        "dp": {**CONFIG["dp"], "noise_multiplier": row.noise_multiplier, "delta": 1e-7}})
    p = projected_privacy(cfg, as_mechanism(None), "pld")
    assert (p["min_separation"], p["max_participation"]) == (199, 1)
    assert p["epsilon"] == pytest.approx(2.0, rel=1e-3)
    assert projection_factor(cfg) * row.noise_multiplier == pytest.approx(row.noise_multiplier / 1000)



def test_a_trace_plans_min_separation_and_cap_are_what_the_projection_accounts():
    """`dpfleet plan --trace` enforces the MinS of its timer (not the population's N // M - 1) and
    a MaxP cap: a projection given them accounts them. 20 rounds at MinS 3 allow MaxP 5, capped
    at 2; the population alone would give MinS 100,000 // 20 - 1 = 4,999 and MaxP 1, a smaller eps."""
    from dpfleet.coordinator.accounting.zcdp import epsilon_from_zcdp, zcdp_from_sensitivity
    from dpfleet.coordinator.mechanisms.matrix import as_mechanism
    from dpfleet.coordinator.run_privacy.projection import projected_privacy

    def projected(**keys):
        cfg = parse_config({**CONFIG, "rounds": 20, "dp": {**CONFIG["dp"], "noise_multiplier": 3.0},
                            "projection": {"noise_cohort": 20, "population": N_PLAN, **keys}})
        return projected_privacy(cfg, as_mechanism(None), "pld")

    traced, population = projected(min_separation=3, max_participation=2), projected()
    assert (traced["min_separation"], traced["max_participation"]) == (3, 2)
    assert (population["min_separation"], population["max_participation"]) == (4999, 1)
    sens = as_mechanism(None).sensitivity_squared(20, 3, 2, [])
    assert traced["zcdp"] == pytest.approx(zcdp_from_sensitivity(3.0, sens))
    assert traced["epsilon"] == pytest.approx(epsilon_from_zcdp(traced["zcdp"], traced["delta"], "pld"))
    assert traced["epsilon"] > population["epsilon"]
    assert projected(min_separation=3)["max_participation"] == 5  # no cap: the worst case
    # a 24 h timer at hourly rounds enforces MinS 23, which 200 devices in cohorts of 20 could not
    # keep (24 x 20 > 200) once devices return; over 20 rounds nobody takes part twice: accepted
    small = {"noise_cohort": 20, "population": 200, "min_separation": 23}
    dp = {**CONFIG["dp"], "noise_multiplier": 3.0, "delta": 1e-3}
    parse_config({**CONFIG, "rounds": 20, "dp": dp, "projection": small})
    with pytest.raises(DpfleetError, match=r"24 x 20 > 200"):
        parse_config({**CONFIG, "rounds": 30, "dp": dp, "projection": small})
    parse_config({**CONFIG, "rounds": 30, "dp": dp, "projection": {**small, "max_participation": 1}})

def test_compare_shows_the_runs_own_eps_and_labels_the_projected_one(projected, capsys):
    from dpfleet.cli import main

    rho, eps = _real_eps_from_config()
    proj_eps = epsilon_from_zcdp(0.0625, DELTA, "pld")
    main(["compare", str(projected.run_dir), "--json", "--no-plot"])
    figures = json.loads(capsys.readouterr().out)["runs"][0]
    assert figures["epsilon"] == pytest.approx(eps)  # the column's eps is the run's own
    assert figures["projection"]["epsilon"] == pytest.approx(proj_eps)
    assert figures["projection"]["label"] == LABEL and figures["projection"]["population"] == N_PLAN
    main(["compare", str(projected.run_dir), "--no-plot"])
    table = capsys.readouterr().out.splitlines()
    eps_row = next(line for line in table if line.startswith("eps"))
    proj_row = next(line for line in table if line.strip().startswith("projected eps"))
    assert f"{eps:.2f}" in eps_row and "this run's own" in eps_row
    assert f"{proj_eps:.2f}" in proj_row and "not a guarantee" in proj_row and f"{N_PLAN:,}" in proj_row
