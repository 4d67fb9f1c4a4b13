"""`dpfleet audit`: the audit must be able to fail, and must not fail an honest run.

Each test trains a tiny real run (40 Shakespeare clients, a 37k-parameter CIFG, 10 rounds of 25
devices, disjoint participation) with ~256 canary devices added, and asserts ON THE VALUES: a run
whose noise is off, whose clipping is off or whose noise is 10x too small gets an epsilon
estimate (its whole interval) or a lower bound above the accounted epsilon, while honest runs'
lower bounds stay at or below it, with the tree, a matrix-factorization mechanism and secure
aggregation.
"""

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_noise_secrecy import CFG as SECRECY_CFG
from test_noise_secrecy import QUIET

from dpfleet.cli import main
from dpfleet.coordinator.audit.canaries import CANARY_NORM, CANARY_PREFIX, AuditSettings, CanaryRun, run_audit
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.simulation import run_simulation
from dpfleet.coordinator.state.run_dir import to_toml

# z = 6 at delta 1e-5 accounts eps ~ 1.27 for one participation: small enough that a broken run's
# estimate clears it; 10 rounds x 25 devices take ~84% of 40 real + ~256 canary devices (a device
# that trains nothing costs nothing, so canaries are cheap; 512 directions pin the Gaussians down)
# (the secrecy tests' tiny run: 40 clients, a 16/32/16 CIFG, client lr 1)
CFG = {**SECRECY_CFG, "rounds": 10, "eval_every": 10, "checkpoint_every": 0,
       "dp": {"noise_multiplier": 6.0, "clip_norm": 0.5, "report_goal": 25, "momentum": 0.0,
              "delta": 1e-5}}
assert CFG["data"]["max_clients"] == 40 and CFG["client"]["lr"] == 1.0
CANARIES = AuditSettings(canaries=256, text_canaries=2, null_directions=500, references=500,
                         bootstrap=300)


def audit(tmp_path, name, values=CFG, seeds=1, **settings):
    s = AuditSettings(**{**CANARIES.__dict__, **settings})
    return run_audit(parse_config(copy.deepcopy(values)), tmp_path / name, s, seeds=seeds,
                     overwrite=True, **QUIET)


def with_(section, **values):
    return {**CFG, section: {**CFG.get(section, {}), **values}}


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 24), clip=st.floats(1e-3, 1e3), key=st.binary(min_size=32, max_size=32),
       broken=st.sampled_from([None, "clipping"]))
def test_a_gradient_canary_sends_its_secret_direction_clipped_to_exactly_c(n, clip, key, broken):
    """Property: each inserted canary device's update is its own direction at norm C (at most C in
    float64, the bound the noise is calibrated to), or 100 C with --break clipping; the coins
    and directions are a function of the audit's key alone."""
    run = CanaryRun(AuditSettings(canaries=n, text_canaries=0, broken=broken), key=key)
    real = ["alice", "bob"]
    ids = run.users(real)
    assert ids[:2] == real and len(ids) == 2 + run.inserted.sum() and 2 * n == run.inserted.size
    run.theta0 = np.zeros(300)
    plan = SimpleNamespace(devices=list(range(2, len(ids))), clip_norm=clip, round=0,
                           theta=np.zeros(300, np.float32))
    updates = run.train_plan(None, None, None, plan)  # canaries only: nothing is trained
    for update, j in zip(updates, run.gradient, strict=True):
        norm = float(np.linalg.norm(update.delta.astype(np.float64)))
        assert update.delta.dtype == np.float32
        if broken:
            assert norm == pytest.approx(CANARY_NORM * clip, rel=1e-5)
        else:
            assert clip * (1 - 1e-5) <= norm <= clip
        assert update.delta.astype(np.float64) @ run.direction(int(j)) / norm > 1 - 1e-5
    again, other = (CanaryRun(AuditSettings(canaries=n, text_canaries=0), key=k)
                    for k in (key, bytes(b ^ 1 for b in key)))
    again.theta0 = other.theta0 = run.theta0
    assert (again.inserted == run.inserted).all()
    assert np.array_equal(again.direction(0), run.direction(0))
    assert abs(other.direction(0) @ run.direction(0)) < 0.5  # another key: unrelated directions


def test_every_release_is_scored_so_a_canary_erased_by_the_final_model_still_shows():
    """All-iterates score: inserted canaries added in round 1 and taken out again in round 2 leave
    no trace in theta_T - theta_0 (final-model cosines like the null's) but stand out in the max
    over rounds of each release's change, while never-inserted and never-drawn directions, scored
    the same way, keep the null's law (so the estimators' "not inserted" side holds)."""
    n, dim = 64, 4000
    run = CanaryRun(AuditSettings(canaries=n, text_canaries=0, null_directions=300), key=bytes(32))
    run.users([])
    rng = np.random.default_rng(0)
    run.theta0 = np.zeros(dim)
    canaries = sum(run.direction(int(j)) for j in run.gradient)
    noise = [rng.standard_normal(dim) * 0.05 for _ in range(3)]
    released = [run.theta0 + canaries + noise[0]]  # round 1: the canaries are in the sum
    released.append(released[0] - canaries + noise[1])  # round 2: something takes them out
    final = released[1] + noise[2]
    for r, theta in enumerate(released, start=1):
        plan = SimpleNamespace(devices=[], clip_norm=1.0, round=r, theta=theta.astype(np.float32))
        run.train_plan(None, None, None, plan)
    run.engine = SimpleNamespace(server=SimpleNamespace(theta=final.astype(np.float32)), next_round=3)
    scores = run.score({})
    assert scores.round_scores.shape == scores.scores.shape and scores.round_null.shape == (300,)
    ins, out = scores.inserted, ~scores.inserted
    # final model: the canaries are gone, inserted look like the rest
    assert abs(scores.scores[ins].mean() - scores.null.mean()) < 3 * scores.null.std()
    # every release: each inserted canary is far above every not-inserted and never-drawn one
    assert scores.round_scores[ins].min() > max(scores.round_scores[out].max(), scores.round_null.max())
    # not inserted and never drawn are scored alike: same mean within sampling error
    se = scores.round_null.std() * (1 / np.sqrt(out.sum()) + 1 / np.sqrt(300))
    assert abs(scores.round_scores[out].mean() - scores.round_null.mean()) < 4 * se


@pytest.mark.parametrize("broken", ["noise-off", "clipping", "noise-div-10"])
@pytest.mark.slow
def test_a_broken_run_is_caught_above_its_accounted_epsilon(tmp_path, broken):
    a = audit(tmp_path, broken, broken=broken)
    accounted = a["epsilon_accounted"]
    assert 1.0 < accounted < 1.5  # the configured z's epsilon: breaking the run did not change it
    # the whole interval of the final-model or the all-rounds estimate, not just a point
    every = a["all_rounds"]
    assert max(a["epsilon_estimate_interval"][0], every["epsilon_estimate_interval"][0]) > accounted, a
    assert max(a["epsilon_estimate"], every["epsilon_estimate"]) > 3 * accounted
    if broken == "noise-off":  # no noise: the inserted canaries stand out one by one
        assert a["epsilon_lower_bound"] > accounted
    assert a["verdict"].startswith("FAIL")
    assert a["broken"]["mode"] == broken and "DELIBERATELY BROKEN" in a["broken"]["warning"]
    report = (tmp_path / broken / "privacy_report.md").read_text()
    assert "## Empirical audit" in report and "DELIBERATELY BROKEN" in report


@pytest.fixture(scope="module")
def honest_cli(tmp_path_factory):
    """One honest audit through the CLI, two seeds, shared by the tests that only read it (the
    honest bounds, the CLI's files and lines, the published directory's secrecy): the canary
    keys and coins each seed's CanaryRun drew are recorded as it is built."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("honest-cli")
    cfg = root / "tiny.toml"
    cfg.write_text(to_toml(CFG))
    keys: list[bytes] = []
    coins: list[np.ndarray] = []
    init = CanaryRun.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        keys.append(self.key)
        coins.append(self.inserted.copy())

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setattr(CanaryRun, "__init__", spy)
        main(["audit", str(cfg), "--out", str(root / "run"), "--quiet", "--canaries", "256",
              "--text-canaries", str(CANARIES.text_canaries), "--seeds", "2"])
    return SimpleNamespace(run=root / "run", out=out.getvalue(), keys=keys, coins=coins,
                           audit=json.loads((root / "run" / "audit.json").read_text()))


@pytest.mark.slow
def test_honest_runs_lower_bound_stays_at_or_below_accounted(honest_cli):
    a = honest_cli.audit
    for entry in (*a["seeds"], a):  # each seed, and both pooled
        assert entry["epsilon_lower_bound"] <= entry["epsilon_accounted"], entry
        assert entry["epsilon_estimate_interval"][0] <= entry["epsilon_accounted"], entry
        assert entry["broken"] is None and not entry["verdict"].startswith("FAIL")
    assert a["canaries"]["directions"] == 2 * 512 and a["runs"] == 2
    # the canaries went through the run's participation like any device: disjoint participation
    # fills rounds x report_goal slots from <= 40 real + 2 text + the inserted canary devices, so the
    # canaries reached the sum about as often as a uniform draw gives (hypergeometric, 4 sd); the
    # coins come from the audit's fresh key, so the inserted count differs from run to run
    slots = CFG["rounds"] * CFG["dp"]["report_goal"]
    for entry in a["seeds"]:
        k = entry["canaries"]["inserted"]
        n = CFG["data"]["max_clients"] + CANARIES.text_canaries + k
        mean = slots * k / n
        sd = np.sqrt(slots * (k / n) * (1 - k / n) * (n - slots) / (n - 1))
        assert entry["canaries"]["inserted_in_sum"] >= mean - 4 * sd, entry["canaries"]
    assert a["canaries"]["inserted_in_sum"] == sum(e["canaries"]["inserted_in_sum"] for e in a["seeds"])
    assert [s["seed"] for s in a["seeds"]] == [7, 8]
    for entry in a["seeds"]:  # each seed's own audit.json in its run directory
        assert json.loads((honest_cli.run / f"seed-{entry['seed']}" / "audit.json").read_text()) == entry


@pytest.mark.slow
def test_cli_writes_audit_json_and_report_section(honest_cli):
    a, out = honest_cli.audit, honest_cli.out
    for key in ("epsilon_accounted", "delta", "epsilon_estimate", "epsilon_estimate_interval",
                "epsilon_lower_bound", "lower_bound_confidence", "exposure", "canaries", "mechanism",
                "aggregation", "broken"):
        assert key in a
    text = CANARIES.text_canaries
    assert a["canaries"]["text"] == a["exposure"]["canaries"] == 2 * text  # pooled: both seeds'
    assert all(e["canaries"]["text"] == e["exposure"]["canaries"] == text for e in a["seeds"])
    assert np.isfinite(a["exposure"]["median_bits"]) and a["exposure"]["max_bits"] >= 0
    assert f"eps = {a['epsilon_accounted']:.3f}" in out and "one-run lower bound" in out
    assert f"eps >= {a['epsilon_lower_bound']:.3f}" in out  # the pooled figures, as on disk
    for seed in (7, 8):
        assert "## Empirical audit" in (honest_cli.run / f"seed-{seed}" / "privacy_report.md").read_text()


@pytest.mark.slow
def test_the_run_directory_does_not_give_away_the_canaries_key(honest_cli):
    """Attack: whoever reads the published run directory (audit.json, logs, checkpoint) looks for
    the audit's key, from which the directions, coins and secrets derive; with it they could plant
    canary-shaped updates or fake a clean audit. No file holds it raw, hex or base64, and the coins
    rebuilt from a key guessed from the directory's own bytes do not match the real ones."""
    import base64

    keys, coins = honest_cli.keys, honest_cli.coins
    assert len(keys) == 2 and keys[0] != keys[1]  # one fresh key per seed
    blobs = [p.read_bytes() for p in honest_cli.run.rglob("*") if p.is_file()]
    assert blobs
    for key in keys:
        for form in (key, key.hex().encode(), base64.b64encode(key), base64.urlsafe_b64encode(key)):
            assert not any(form in blob for blob in blobs)
    # the attacker's best guesses: every 32-byte window of every published file as the key
    settings = AuditSettings(**CANARIES.__dict__)
    guesses = {blob[i:i + 32] for blob in blobs for i in range(0, max(len(blob) - 31, 1), 997)}
    for guess in list(guesses)[:200]:
        rebuilt = object.__new__(CanaryRun)
        CanaryRun.__init__(rebuilt, settings, key=guess.ljust(32, b"\0"))
        for real in coins:
            assert float(np.mean(rebuilt.inserted == real)) < 0.65  # chance is 0.5 over 512 coins


@pytest.mark.slow
def test_canaries_are_devices_not_users_in_accounting_or_evaluation(tmp_path):
    """The accounted eps and the held-out evaluation rows are the config's own; the canaries show
    up only as devices in the participation log."""
    short = {**CFG, "rounds": 1}  # disjoint: 25 slots fit the 40 real clients without canaries
    plain = run_simulation(parse_config(copy.deepcopy(short)), tmp_path / "plain", **QUIET)
    a = audit(tmp_path, "audited", short)
    assert a["epsilon_accounted"] == plain.privacy["epsilon"]
    summary = json.loads((tmp_path / "audited" / "summary.json").read_text())
    assert summary["final"]["scored_tokens"] == plain.final["scored_tokens"]
    devices = [d for line in (tmp_path / "audited" / "participation.jsonl").read_text().splitlines()
               for d in json.loads(line)["devices"]]
    assert any(d.startswith(CANARY_PREFIX) for d in devices)
    assert len(devices) == len(set(devices)) == 25  # disjoint: canaries obey MaxP 1 too


@pytest.mark.slow  # ~15 s; the tree and MF audits and every --break mode stay in the default suite
def test_audit_with_secure_aggregation(tmp_path):
    """SecAgg with discrete noise on the ring sum: the canaries are masked and summed like any
    device, and switching the ring noise off is still caught."""
    values = with_("aggregation", kind="secagg")
    honest = audit(tmp_path, "secagg", values)
    assert honest["aggregation"] == "secagg" and "discrete" in honest["noise"]
    assert honest["canaries"]["inserted_in_sum"] > 0
    assert honest["epsilon_lower_bound"] <= honest["epsilon_accounted"]
    broken = audit(tmp_path, "secagg-off", values, broken="noise-off")
    assert broken["epsilon_estimate_interval"][0] > broken["epsilon_accounted"]


@pytest.mark.slow  # ~15 s: two audited runs of a matrix mechanism (the tree's stay in the default suite)
def test_audit_with_a_matrix_factorization_mechanism(tmp_path):
    values = with_("dp", mechanism="blt")
    honest = audit(tmp_path, "blt", values)
    assert honest["mechanism"] == "blt"
    assert honest["epsilon_lower_bound"] <= honest["epsilon_accounted"]
    broken = audit(tmp_path, "blt-div-10", values, broken="noise-div-10")
    assert broken["epsilon_estimate_interval"][0] > broken["epsilon_accounted"]


@pytest.mark.slow
def test_cli_audits_a_planned_config(tmp_path, capsys):
    """A config that states dp.target_epsilon (as the main job does) is audited at the planner's
    choice: the canaries join the fleet after the plan is made for the real population."""
    planned = {**CFG, "rounds": 4, "eval_every": 4,
               "dp": {**{k: v for k, v in CFG["dp"].items() if k not in ("noise_multiplier", "report_goal")},
                      "target_epsilon": 8.0, "mechanism": "auto"}}
    cfg = tmp_path / "planned.toml"
    cfg.write_text(to_toml(planned))
    main(["audit", str(cfg), "--out", str(tmp_path / "run"), "--quiet", "--canaries", "64",
          "--text-canaries", "0"])
    a = json.loads((tmp_path / "run" / "audit.json").read_text())
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())["chosen"]
    assert a["mechanism"] == plan["mechanism"] and plan["noise_multiplier"] > 0
    assert 0 < a["epsilon_accounted"] <= 8.0 * (1 + 1e-6)
    assert a["all_rounds"]["epsilon_lower_bound"] <= a["epsilon_accounted"]


@pytest.mark.parametrize(("args", "message"), [
    (["--canaries", "x"], "--canaries must be an integer"),
    (["--canaries", "0"], "--canaries must be >= 1"),
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--confidence", "1.5"], "--confidence must be in (0.5, 1)"),
    (["--break", "everything"], "--break must be one of 'noise-off', 'clipping', 'noise-div-10'"),
    (["--break", "clipping", "--debug-nonprivate"], "is now --break noise-off"),
])
def test_bad_cli_input_is_one_error_line(tmp_path, capsys, args, message):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(to_toml(CFG))
    with pytest.raises(SystemExit) as exit_:
        main(["audit", str(cfg), "--out", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert not (tmp_path / "run").exists()  # refused before any training


def test_missing_config_and_zero_noise_are_one_error_line(tmp_path, capsys):
    cfg = tmp_path / "nonoise.toml"
    cfg.write_text(to_toml(with_("dp", noise_multiplier=0.0)))
    for path, message in [(tmp_path / "nope.toml", "config file not found"),
                          (cfg, "nothing to audit")]:
        with pytest.raises(SystemExit) as exit_:
            main(["audit", str(path), "--out", str(tmp_path / "run")])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(err) == 1 and message in err[0]


@pytest.mark.slow
def test_false_alarm_rate_over_seeds_is_what_the_confidence_implies(tmp_path):
    """Honest runs over 20 seeds at confidence 0.8: each lower bound passes the accounted eps
    with probability <= 0.2, so 20 runs give more than 9 false alarms with probability < 0.3%
    (binomial(20, 0.2)); in practice the bound is far below (it is loose), so 0 is typical."""
    a = audit(tmp_path, "seeds", seeds=20, confidence=0.8, text_canaries=0)
    alarms = sum(e["epsilon_lower_bound"] > e["epsilon_accounted"] for e in a["seeds"])
    assert alarms <= 9, [e["epsilon_lower_bound"] for e in a["seeds"]]
    assert a["epsilon_lower_bound"] <= a["epsilon_accounted"]


@pytest.mark.slow
def test_an_audit_leaves_nothing_readable_by_others(honest_cli):
    """The permission rule (dpfleet.io) for what `dpfleet audit` leaves: every folder 0700, every
    file 0600, the seeds' run directories, plots and reports included."""
    import stat

    paths = [honest_cli.run, *honest_cli.run.rglob("*")]
    assert any(p.name == "audit.json" for p in paths) and any(p.suffix == ".png" for p in paths)
    modes = {str(p): stat.S_IMODE(p.lstat().st_mode) for p in paths}
    assert {p: m for p, m in modes.items() if m != (0o700 if Path(p).is_dir() else 0o600)} == {}
