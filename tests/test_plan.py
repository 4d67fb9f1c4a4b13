"""The planner (paper 002 Sec. 2.5) and `dpfleet plan`."""

import json

import pytest

from dpfleet.cli import main
from dpfleet.coordinator.accounting.planner import (
    make_plan,
    max_min_separation,
    plan_row,
    timer_for,
    worst_case_max_participation,
)
from dpfleet.coordinator.accounting.zcdp import epsilon_from_zcdp, zcdp_from_noise
from dpfleet.errors import DpfleetError


def test_largest_min_separation_and_worst_case_maxp():
    # paper 002: "MinS of es-ES is upper bounded by 4.21M/6500 ~ 647" rounds apart
    assert max_min_separation(4_210_000, 6500) == 646
    # "report goal 6500 for population 10^6: MinS has to be smaller than 153"
    assert max_min_separation(1_000_000, 6500) == 152
    assert worst_case_max_participation(1900, 646) == 3
    assert worst_case_max_participation(10, 4) == 2 and worst_case_max_participation(11, 4) == 3


def test_round_robin_achieves_the_largest_min_separation():
    # N devices in fixed groups of M, cycled: every device is back exactly N // M rounds later
    n, m, rounds = 12, 3, 20
    last = {}
    for r in range(rounds):
        for d in range(m * (r % (n // m)), m * (r % (n // m) + 1)):
            if d in last:
                assert r - last[d] - 1 == max_min_separation(n, m)
            last[d] = r


def test_plan_row_meets_the_target_exactly():
    row = plan_row(4_210_000, 1900, 6500, 0.35)
    assert (row.min_separation, row.max_participation, row.sensitivity_squared) == (646, 3, 34)
    assert row.noise_multiplier == pytest.approx(6.969, abs=1e-3)  # paper 002 used 7
    assert zcdp_from_noise(row.noise_multiplier, 1900, 3, 646) == pytest.approx(0.35)
    assert row.noise_per_report == pytest.approx(row.noise_multiplier / 6500)


def test_make_plan_chooses_and_times():
    plan = make_plan(4_210_000, 1900, 0.35, report_goal=6500, delta=1e-10, round_minutes=20)
    assert plan.chosen.report_goal == 6500 and plan.chosen in plan.rows
    assert plan.epsilon == pytest.approx(epsilon_from_zcdp(0.35, 1e-10))
    assert plan.timer.rounds == 647 and plan.timer.hours == pytest.approx(647 / 3)
    assert plan.timer.diurnal_hours == 216  # rounded up to whole days
    assert all(r.zcdp == pytest.approx(0.35) for r in plan.rows)
    auto = make_plan(4_210_000, 1900, 0.35)
    best = min(r.noise_per_report for r in auto.rows)
    assert auto.chosen.noise_per_report <= 1.1 * best
    assert all(r.noise_per_report > 1.1 * best for r in auto.rows
               if r.report_goal < auto.chosen.report_goal)


def test_timer_without_duration():
    t = timer_for(99)
    assert (t.rounds, t.hours, t.diurnal_hours) == (100, None, None)


@pytest.mark.parametrize(
    "call",
    [
        lambda: max_min_separation(100, 0),
        lambda: max_min_separation(100, 101),
        lambda: make_plan(0, 10, 1.0),
        lambda: make_plan(100, 10, -1.0),
        lambda: make_plan(100, 10, 1.0, report_goal=200),
        lambda: make_plan(100, 10, 1.0, delta=3.0),
        lambda: timer_for(10, round_minutes=0),
    ],
)
def test_bad_plans_are_refused(call):
    with pytest.raises(DpfleetError):
        call()


def test_cli_plan_writes_table_json_and_figure(tmp_path, capsys):
    out = tmp_path / "plan"
    main(["plan", "-N", "20000", "-T", "200", "--target-epsilon", "8", "--delta", "1e-8",
          "-M", "500", "--round-minutes", "30", "--out", str(out)])
    text = capsys.readouterr().out
    assert "*         500" in text and "timer: keep a device ineligible for 40 rounds" in text
    plan = json.loads((out / "plan.json").read_text())
    assert plan["chosen"]["report_goal"] == 500 and plan["chosen"]["min_separation"] == 39
    assert plan["epsilon"] <= 8 + 1e-9 and plan["epsilon"] > 7.99
    png = (out / "plan.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@pytest.mark.parametrize(
    "args,needle",
    [
        (["-N", "100", "-T", "10"], "exactly one of --target-zcdp and --target-epsilon"),
        (["-N", "100", "-T", "10", "--target-zcdp", "1", "--target-epsilon", "2"], "exactly one"),
        (["-N", "100", "-T", "10", "--target-epsilon", "2"], "needs --delta"),
        (["-N", "100", "-T", "10", "--target-zcdp", "1", "-M", "1000"], "report goal"),
        (["-N", "100", "-T", "0", "--target-zcdp", "1"], "must be >= 1"),
    ],
)
def test_cli_plan_errors_are_one_line(capsys, args, needle):
    with pytest.raises(SystemExit) as exc:
        main(["plan", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
