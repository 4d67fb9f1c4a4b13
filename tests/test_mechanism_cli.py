"""`dpfleet account --mechanism` and `dpfleet plan --mechanism`: values, the run's strategy, errors."""

import json
import math

import pytest

from dpfleet.cli import main
from dpfleet.coordinator.accounting.ledger import account_worst_case
from dpfleet.coordinator.accounting.zcdp import epsilon_from_zcdp, zcdp_for_epsilon, zcdp_from_sensitivity
from dpfleet.coordinator.mechanisms.registry import rebuild
from dpfleet.coordinator.mechanisms.spec import (
    DESCRIPTIONS,
    MechanismSpec,
    optimize_mechanism,
    prefix_error,
    sensitivity_squared,
)

ISSUE = ["-z", "8.881", "-T", "60", "-P", "15", "-S", "3", "--delta", "1e-6"]


def run(capsys, *args):
    main([*args])
    return capsys.readouterr().out


def test_tree_output_is_unchanged_by_the_flag(capsys):
    plain = run(capsys, "account", *ISSUE)
    assert run(capsys, "account", *ISSUE, "--mechanism", "tree") == plain
    assert run(capsys, "account", *ISSUE, "--json", "--mechanism", "tree") == \
        run(capsys, "account", *ISSUE, "--json")


def test_all_prints_each_mechanism_at_the_same_z(capsys):
    rows = [json.loads(line) for line in run(capsys, "account", *ISSUE, "--mechanism", "all",
                                             "--json").splitlines()]
    assert [r["mechanism"] for r in rows] == ["tree", "banded", "blt"]
    tree = account_worst_case(8.881, 60, 15, 3, delta=1e-6)
    assert rows[0]["epsilon"] == tree["epsilon"] and rows[0]["sensitivity_squared"] == 185
    for r in rows[1:]:
        spec = optimize_mechanism(r["mechanism"], 60, 3, 15)
        assert MechanismSpec.from_json(r["mechanism_spec"]) == spec
        s = sensitivity_squared(spec, 3, 15)
        rho = s / (2 * 8.881**2)
        assert r["sensitivity_squared"] == s and r["zcdp"] == pytest.approx(rho, rel=1e-12)
        assert r["epsilon"] == pytest.approx(epsilon_from_zcdp(rho, 1e-6), rel=1e-9)
        # less privacy loss than the tree at the same noise, and less noise at the same eps
        assert r["epsilon"] < 0.6 * tree["epsilon"] and r["noise_at_equal_zcdp"] < 0.6
        assert r["noise_at_equal_zcdp"] == pytest.approx(
            math.sqrt(s / 185) * math.sqrt(prefix_error(spec) / prefix_error(MechanismSpec("tree", 60))))
    text = run(capsys, "account", *ISSUE, "--mechanism", "all")
    assert [line.split()[0] for line in text.splitlines()[-3:]] == ["tree", "banded", "blt"]


def write_log(run_dir, patterns: dict[str, list[int]], rounds: int):
    run_dir.mkdir(exist_ok=True)
    with (run_dir / "participation.jsonl").open("w") as fh:
        for r in range(rounds):
            fh.write(json.dumps({"round": r, "devices": [d for d, p in patterns.items() if r in p]}) + "\n")
    return run_dir / "participation.jsonl"


def test_participation_log_accounts_the_runs_own_strategy_for_the_observed_participation(tmp_path, capsys):
    # the run's strategy was optimised for MinS 5, but the log shows a device back after 2 rounds
    spec = optimize_mechanism("blt", 24, 5, 4)
    log = write_log(tmp_path / "run", {"a": [0, 3, 6, 9], "b": [1, 7], "c": [2]}, 24)
    (tmp_path / "run" / "mechanism.json").write_text(json.dumps({"spec": spec.to_json(),
                                                                  "optimised_for": {}}))
    out = json.loads(run(capsys, "account", "-z", "2", "--delta", "1e-6", "--participation-log",
                         str(log), "--json"))
    assert out["mechanism"] == "blt" and out["spec_source"].endswith("mechanism.json")
    assert out["min_separation"] == 2 and out["max_participation"] == 4 and out["devices"] == 3
    honest = sensitivity_squared(spec, 2, 4)
    assert out["sensitivity_squared"] == honest > sensitivity_squared(spec, 5, 4)
    assert out["epsilon"] == pytest.approx(epsilon_from_zcdp(zcdp_from_sensitivity(2, honest), 1e-6))
    # the run's strategy, not a fresh one for the observed participation
    assert MechanismSpec.from_json(out["mechanism_spec"]) == spec != optimize_mechanism("blt", 24, 2, 4)
    # the same spec given explicitly, and a tree accounting of that run is refused
    again = json.loads(run(capsys, "account", "-z", "2", "--delta", "1e-6", "--participation-log",
                           str(log), "--json", "--mechanism-spec", str(tmp_path / "run" / "mechanism.json")))
    assert again["epsilon"] == out["epsilon"]
    with pytest.raises(SystemExit) as exc:
        main(["account", "-z", "2", "--participation-log", str(log), "--mechanism", "tree"])
    assert exc.value.code == 2 and "holds a blt strategy" in capsys.readouterr().err


def test_participation_log_without_a_strategy_stays_tree(tmp_path, capsys):
    log = write_log(tmp_path / "run", {"a": [0, 3], "b": [1]}, 8)
    out = json.loads(run(capsys, "account", "-z", "2", "--participation-log", str(log), "--json"))
    assert out["mechanism"] == "tree" and out["min_separation"] == 2 and out["sensitivity_squared"] >= 2


@pytest.mark.parametrize("kind", ["banded", "blt"])
def test_mf_in_the_ring_is_accounted_as_the_continuous_mf_gaussian(capsys, kind):
    """--noise discrete with banded / blt: the MF Gaussian rounded in the ring (`mf_ring`) has the
    same eps as the continuous one, by PLD (post-processing); the tree's discrete noise keeps RDP."""
    ring = json.loads(run(capsys, "account", *ISSUE, "--mechanism", kind, "--noise", "discrete", "--json"))
    plain = json.loads(run(capsys, "account", *ISSUE, "--mechanism", kind, "--json"))
    assert ring["method"] == "pld" and ring["epsilon"] == plain["epsilon"] and ring["zcdp"] == plain["zcdp"]
    assert ring["noise_mechanism"] == "matrix-factorization Gaussian, rounded, in the SecAgg ring"
    rows = [json.loads(x) for x in run(capsys, "account", *ISSUE, "--mechanism", "all", "--noise",
                                       "discrete", "--json").splitlines()]
    assert [r["method"] for r in rows] == ["rdp"] * 3  # one conversion per table: the tree's
    assert rows[0]["noise_mechanism"] == "discrete Gaussian in the SecAgg ring"
    mf = next(r for r in rows if r["mechanism"] == kind)
    assert mf["zcdp"] == pytest.approx(plain["zcdp"]) and mf["noise_mechanism"] == ring["noise_mechanism"]


@pytest.mark.parametrize("args,needle", [
    ([*ISSUE, "--mechanism", "blt", "--restarts", "5"], "restarts"),
    ([*ISSUE, "--mechanism", "banded", "--tree-nodes", "prefix"], "--tree-nodes"),
    ([*ISSUE, "--noise", "discrete", "--method", "pld"], "not a proven bound"),  # the tree's
    (["-z", "1", "--mechanism", "blt"], "give --rounds"),
    ([*ISSUE, "--mechanism", "blt", "--mechanism-spec", "SPEC_BAD_JSON"], "not JSON"),
    ([*ISSUE, "--mechanism", "blt", "--mechanism-spec", "SPEC_BAD_THETA"], "theta in (0, 1)"),
    ([*ISSUE, "--mechanism", "blt", "--mechanism-spec", "SPEC_SHORT"], "covers 10 rounds"),
    ([*ISSUE, "--mechanism", "banded", "--mechanism-spec", "SPEC_SHORT"], "holds a blt strategy"),
    ([*ISSUE, "--mechanism", "dct"], "Invalid value"),
])
def test_account_errors_are_one_line(tmp_path, capsys, args, needle):
    files = {"SPEC_BAD_JSON": "{", "SPEC_BAD_THETA": json.dumps(
        {"kind": "blt", "rounds": 60, "theta": [1.5], "omega": [0.1]}),
        "SPEC_SHORT": json.dumps({"kind": "blt", "rounds": 10, "theta": [0.5], "omega": [0.1]})}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    args = [str(tmp_path / a) if a in files else a for a in args]
    with pytest.raises(SystemExit) as exc:
        main(["account", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert needle in err[-1] and (len(err) == 1 or needle == "Invalid value")


PLAN = ["plan", "-N", "1277", "-T", "60", "--target-epsilon", "8", "--delta", "1e-6"]


def test_plan_auto_picks_the_least_model_noise_at_the_target(capsys):
    rec = json.loads(run(capsys, *PLAN, "--json"))
    rho = zcdp_for_epsilon(8, 1e-6)
    rows = {r["mechanism"]: r for r in rec["mechanisms"]}
    assert set(rows) == {"tree", "banded", "blt"} and rec["mechanism_choice"] == "auto"
    for r in rows.values():  # each z meets the target exactly, for its own sensitivity
        assert zcdp_from_sensitivity(r["noise_multiplier"], r["sensitivity_squared"]) == \
            pytest.approx(rho, rel=1e-12)
        built = rebuild(r["mechanism"], r["spec"])
        assert r["model_noise"] == pytest.approx(r["noise_multiplier"] * math.sqrt(built.prefix_error(60)))
    assert rows["tree"]["noise_multiplier"] == rec["chosen"]["noise_multiplier"]
    best = min(rows.values(), key=lambda r: r["model_noise"])
    assert rec["mechanism"] == best["mechanism"] != "tree"
    assert best["model_noise"] < 0.6 * rows["tree"]["model_noise"]
    assert rec["mechanism_noise_multiplier"] == best["noise_multiplier"]
    text = run(capsys, *PLAN)
    assert f"mechanism: {best['mechanism']} (least model noise" in text
    assert "*         319" in text  # the tree's table and choice as before


def test_plan_with_a_given_mechanism(capsys):
    rec = json.loads(run(capsys, *PLAN, "--json", "--mechanism", "tree"))
    assert rec["mechanism"] == "tree" and [r["mechanism"] for r in rec["mechanisms"]] == ["tree"]
    assert rec["mechanism_noise_multiplier"] == rec["chosen"]["noise_multiplier"]
    rec = json.loads(run(capsys, *PLAN, "--json", "--mechanism", "blt"))
    assert rec["mechanism"] == "blt" and [r["mechanism"] for r in rec["mechanisms"]] == ["tree", "blt"]


@pytest.mark.parametrize("command", ["account", "plan"])
def test_help_explains_each_mechanism(capsys, command):
    text = " ".join(run(capsys, command, "--help").split())
    for kind, desc in DESCRIPTIONS.items():
        assert f"{kind} {' '.join(desc.split())}" in text


@pytest.mark.slow
def test_account_of_a_real_blt_run_equals_the_runs_own_privacy_json(tmp_path, capsys):
    from test_mf_simulate import config

    from dpfleet.coordinator.state.run_dir import to_toml

    path = tmp_path / "cfg.toml"
    path.write_text(to_toml(config("blt")))
    main(["simulate", str(path), "--out", str(tmp_path / "run"), "--quiet"])
    capsys.readouterr()
    privacy = json.loads((tmp_path / "run" / "privacy.json").read_text())
    out = json.loads(run(capsys, "account", "-z", "1", "--delta", str(privacy["delta"]), "--json",
                         "--participation-log", str(tmp_path / "run" / "participation.jsonl")))
    assert out["mechanism"] == privacy["mechanism"] == "blt"
    assert out["mechanism_spec"] == privacy["mechanism_spec"]
    assert out["sensitivity_squared"] == pytest.approx(privacy["sensitivity_squared"], rel=1e-12)
    assert out["epsilon"] == pytest.approx(privacy["epsilon"], rel=1e-9) and out["epsilon"] > 0
