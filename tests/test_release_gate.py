"""`dpfleet gate RUN --policy FILE`: the release gate's verdict without exporting.

Every run here is written by hand (privacy.json, summary.json in a tmp folder), so each line's
value is known: a `good` run (eps 8 at delta 1e-6, rho 0.5, accuracy 0.2 over a starting model's
0.1 and a unigram baseline's 0.15, no caveat) meets the full policy below; a `bad` one (eps 519.7
at 1e-5, rho 400, accuracy 0.0019 at or below both baselines, a research-mode caveat) misses
every rule. A `projection` run has its own guarantee (eps 60.25, rho 1, the projection's caveat)
and a labelled projected one (eps 1.75, rho 0.0625 at population 100,000): the gate judges the
own one (exit 1) and prints the planned launch's verdict (PASS) beside it.
"""

from __future__ import annotations

import json

import pytest

from dpfleet.cli import main

POLICY = ("max_epsilon = 10.0\ndelta = 1e-6\nmax_rho = 2.0\nbeat_public_model = true\n"
          "beat_unigram = true\nallow_caveats = false\n")
LABEL = "projection: a simulation of DP at population 100,000, not a guarantee"
PROJECTION_CAVEATS = [
    "NOT FULLY PRIVATE: projection to a population of 100,000 (its eps is a simulation): eps holds "
    "only as said below",
    "Projection: a simulation of DP at population 100,000, not a guarantee. The run trained 5 devices "
    "a round with the noise of 20 (noise scaled by 0.25); its projected eps estimates that launch.",
]
RESEARCH = "NOT FULLY PRIVATE: research mode (dp.noise_seed = 7): eps holds only as said below"
RUNS = {
    "good": ({"epsilon": 8.0, "delta": 1e-6, "zcdp": 0.5, "caveats": []},
             {"final": 0.2, "initial": 0.1, "unigram_baseline": 0.15}),
    "bad": ({"epsilon": 519.7, "delta": 1e-5, "zcdp": 400.0,
             "caveats": [RESEARCH]},
            {"final": 0.0019, "initial": 0.0019, "unigram_baseline": 0.0719}),
    "projection": ({"epsilon": 60.25, "delta": 1e-6, "zcdp": 1.0, "caveats": PROJECTION_CAVEATS,
                    "projection": {"label": LABEL, "epsilon_is_a_guarantee": False, "population": 100_000,
                                   "epsilon": 1.75, "zcdp": 0.0625, "delta": 1e-6}},
                   {"final": 0.2, "initial": 0.1, "unigram_baseline": 0.15}),
}


def write_run(root, name):
    privacy, accuracy = RUNS[name]
    run = root / name
    run.mkdir()
    (run / "privacy.json").write_text(json.dumps(privacy))
    (run / "summary.json").write_text(json.dumps({k: {"accuracy": v} for k, v in accuracy.items()}))
    return run


def gate(capsys, *args) -> tuple[int, list[str], str]:
    """(exit code, stdout lines with runs of spaces as one, stderr) of `dpfleet gate ...`."""
    capsys.readouterr()
    try:
        main(["gate", *map(str, args)])
        code = 0
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, [" ".join(line.split()) for line in out.splitlines()], err


@pytest.fixture
def policy(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text(POLICY)
    return path


def test_a_run_that_meets_every_rule_passes_with_one_line_per_rule(tmp_path, policy, capsys):
    run = write_run(tmp_path, "good")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code, out, err = gate(capsys, run, "--policy", policy)
    assert code == 0 and err == ""
    assert out[1:] == [
        "max_epsilon eps <= 10 at delta 1e-06 eps 8 at delta 1e-06 PASS",
        "max_rho rho <= 2 rho 0.5 PASS",
        "beat_public_model accuracy > the starting model's 0.1000 accuracy 0.2000 PASS",
        "beat_unigram accuracy > the unigram baseline's 0.1500 accuracy 0.2000 PASS",
        "allow_caveats false (no caveat) none PASS",
        "verdict: PASS",
    ]
    assert "policy.toml" in out[0] and "this run's own guarantee" in out[0]
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # the gate writes nothing
    assert gate(capsys, run / "checkpoint", "--policy", policy)[0] == 0  # the path export takes


def test_a_run_that_misses_rules_fails_each_and_says_the_export_refusal(tmp_path, policy, capsys):
    code, out, err = gate(capsys, write_run(tmp_path, "bad"), "--policy", policy)
    assert code == 1 and err == ""
    assert out[1:6] == [
        "max_epsilon eps <= 10 at delta 1e-06 eps 519.7 at delta 1e-05 FAIL",
        "max_rho rho <= 2 rho 400 FAIL",
        "beat_public_model accuracy > the starting model's 0.0019 accuracy 0.0019 FAIL",
        "beat_unigram accuracy > the unigram baseline's 0.0719 accuracy 0.0019 FAIL",
        "allow_caveats false (no caveat) NOT FULLY PRIVATE: research mode (dp.noise_seed = 7): eps holds "
        "only as said below FAIL",
    ]
    # the verdict carries the very line `export --bundle --policy` refuses with
    assert out[6] == ("verdict: FAIL: refused by policy.toml: delta 1e-06 < the run's delta 1e-05 "
                      "(eps 519.7); max_rho 2 < rho 400; beat_public_model: accuracy 0.0019 <= the "
                      "starting model's 0.0019; beat_unigram: accuracy 0.0019 <= the unigram baseline's "
                      "0.0719; allow_caveats = false: NOT FULLY PRIVATE: research mode (dp.noise_seed = 7): "
                      "eps holds only as said below")
    assert len(out) == 7  # no projection: no second verdict


def test_json_is_the_same_verdict_as_one_object(tmp_path, policy, capsys):
    code, out, _ = gate(capsys, write_run(tmp_path, "bad"), "--policy", policy, "--json")
    assert code == 1
    verdict = json.loads("\n".join(out))
    assert verdict["passed"] is False and verdict["projection"] is None
    assert verdict["policy"]["file"] == "policy.toml" and verdict["policy"]["rules"]["max_rho"] == 2.0
    rules = verdict["own"]["rules"]
    assert [r["rule"] for r in rules] == ["max_epsilon", "max_rho", "beat_public_model", "beat_unigram",
                                          "allow_caveats"]
    assert rules[1] == {"rule": "max_rho", "limit": "rho <= 2", "value": "rho 400", "passed": False}
    assert verdict["own"]["values"]["rho"] == 400.0 and verdict["own"]["passed"] is False
    assert verdict["own"]["refusal"].startswith("refused by policy.toml: delta 1e-06 < the run's delta")


def test_a_projection_run_gets_both_verdicts_and_the_exit_status_of_its_own(tmp_path, policy, capsys):
    code, out, _ = gate(capsys, write_run(tmp_path, "projection"), "--policy", policy)
    assert code == 1  # its own eps (60.25) misses the ceiling: this model never ships
    own, planned = out[:7], out[7:]
    assert own[1] == "max_epsilon eps <= 10 at delta 1e-06 eps 60.25 at delta 1e-06 FAIL"
    assert own[5].startswith("allow_caveats false (no caveat) NOT FULLY PRIVATE: projection") and \
        own[5].endswith("FAIL")
    assert own[6].startswith("verdict: FAIL: refused by policy.toml: max_epsilon 10 < eps 60.25")
    assert planned[0] == f"the planned launch (projection, not a guarantee): {LABEL}"
    assert planned[1:] == [
        "max_epsilon eps <= 10 at delta 1e-06 eps 1.75 at delta 1e-06 PASS",
        "max_rho rho <= 2 rho 0.0625 PASS",
        "beat_public_model accuracy > the starting model's 0.1000 accuracy 0.2000 PASS",
        "beat_unigram accuracy > the unigram baseline's 0.1500 accuracy 0.2000 PASS",
        "allow_caveats false (no caveat) none PASS",  # the projection's own caveat is not the launch's
        "verdict for the planned launch: PASS (a projection, not a guarantee: the exit status is the "
        "run's own verdict)",
    ]
    code, out, _ = gate(capsys, tmp_path / "projection", "--policy", policy, "--json")
    verdict = json.loads("\n".join(out))
    assert verdict["passed"] is False and verdict["projection"]["passed"] is True
    assert verdict["projection"]["label"] == LABEL
    assert verdict["projection"]["values"]["epsilon"] == 1.75 and verdict["own"]["values"]["epsilon"] == 60.25


def test_a_projection_run_whose_own_guarantee_passes_exits_0(tmp_path, capsys):
    path = tmp_path / "p.toml"
    path.write_text("max_rho = 2.0\n")
    code, out, _ = gate(capsys, write_run(tmp_path, "projection"), "--policy", path)
    assert code == 0 and out[2] == "verdict: PASS"
    assert out[-1].startswith("verdict for the planned launch: PASS")


@pytest.mark.parametrize("case, words", [
    ("missing run", "no run at "),
    ("no privacy.json", "the release policy needs the run's records: no JSON object in "),
    ("bad policy", "unknown policy key 'max_eps'"),
    ("no policy file", "cannot read policy file "),
])
def test_a_user_error_is_one_error_line_and_exit_2(tmp_path, policy, capsys, case, words):
    run = write_run(tmp_path, "good")
    if case == "missing run":
        run = tmp_path / "nowhere"
    elif case == "no privacy.json":
        (run / "privacy.json").unlink()
    elif case == "bad policy":
        policy.write_text("max_eps = 3\n")
    elif case == "no policy file":
        policy = tmp_path / "missing.toml"
    code, out, err = gate(capsys, run, "--policy", policy)
    assert code == 2 and out == [] and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: ") and words in err, err
