"""With secure aggregation the tree noise lives in the ring by default (`dp.noise = "auto"`).

- "auto" resolves to "discrete" with secagg (and z > 0), to "gaussian" without; the run's
  config.toml holds the resolved value, so a resume or a rerun from it gets the same noise;
- a default secagg run with adaptive clipping, a tree restart and a crash + `--resume` releases
  every tree position once, adopts the clip estimate at the restart, and its privacy.json /
  privacy_report.md / summary.json name the ring noise and its discretization (Delta_s from the
  real Discretizer of the round size, sigma^2 >= (z Delta_s)^2);
- an explicit `dp.noise = "gaussian"` with secagg still runs (research comparisons), and every
  output says plainly that it is private only against honest participants;
- the service sizes the ring for the round size (report goal + over-selection).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from crashes import Crash
from service_fleet import tiny_cfg

from dpfleet.coordinator.accounting.privacy_report import HONEST_ONLY
from dpfleet.coordinator.config import honest_participants_only, parse_config, round_size
from dpfleet.coordinator.engine.simulation import run_simulation
from dpfleet.coordinator.state.release_log import ReleaseLog, check_no_reuse
from dpfleet.secagg.encoding import Discretizer

QUIET = {"progress": False, "log": lambda s: None}
ADAPTIVE = {"adaptive_clipping": True, "clip_count_stddev": 1.0, "restart_rounds": [2],
            "clip_lr": 0.5}


@pytest.mark.parametrize("values, noise", [
    ({"aggregation": {"kind": "secagg"}}, "discrete"),
    ({}, "gaussian"),
    ({"aggregation": {"kind": "secagg"}, "dp": {"noise_multiplier": 0.0}}, "gaussian"),  # no noise
    ({"aggregation": {"kind": "secagg"}, "dp": {"noise": "gaussian"}}, "gaussian"),
    ({"aggregation": {"kind": "secagg"}, "dp": {"noise": "auto"}}, "discrete"),
])
def test_auto_resolves_to_the_ring_with_secure_aggregation(values, noise):
    cfg = parse_config(values)
    assert cfg.dp.noise == noise and cfg.resolved()["dp"]["noise"] == noise
    explicit_gaussian = values.get("dp", {}).get("noise") == "gaussian"
    assert honest_participants_only(cfg) == explicit_gaussian


def test_a_default_secagg_run_puts_its_noise_in_the_ring_through_adaptive_clipping_restart_and_resume(
        tmp_path):
    cfg = tiny_cfg(rounds=4, eval_every=4, checkpoint_every=1, dp=ADAPTIVE,
                   aggregation={"kind": "secagg"})
    assert cfg.dp.noise == "discrete"

    def crash_before_round_4(r, theta):
        if r == 3:
            raise Crash

    run = tmp_path / "run"
    with pytest.raises(Crash):
        run_simulation(cfg, run, before_round=crash_before_round_4, **QUIET)
    saved = (run / "config.toml").read_text()
    assert 'noise = "discrete"' in saved  # the resolved value, not "auto"
    resumed = run_simulation(parse_config(json.loads((run / "config.json").read_text())), run,
                             resume=True, **QUIET)
    releases = ReleaseLog(run / "releases.jsonl").released_rounds()
    assert [r["round"] for r in releases] == [1, 2, 3, 4]
    check_no_reuse(releases)
    clips = [m["clip"] for m in resumed.metrics]
    assert clips[0] == clips[1] != clips[2] == clips[3]  # the estimate adopted at the restart

    privacy = json.loads((run / "privacy.json").read_text())
    assert privacy["noise_kind"] == "discrete" and privacy["method"] == "rdp"
    assert privacy["noise_mechanism"] == "discrete Gaussian in the SecAgg ring"
    assert privacy["honest_participants_only"] is False
    ring = privacy["ring"]
    assert ring["ring_clients"] >= round_size(cfg)
    summary = json.loads((run / "summary.json").read_text())
    disc = Discretizer(summary["parameters"], cfg.dp.clip_norm, 32, ring["ring_clients"], seed=0)
    assert ring["delta_s"] == pytest.approx(disc.rounding_bound, rel=1e-12)
    assert ring["delta_s"] > ring["scaled_clip"]  # the rounding's inflation is accounted
    assert ring["effective_z"] >= resumed.privacy["model_noise_multiplier"]
    report = (run / "privacy_report.md").read_text()
    lines = report.splitlines()
    top = lines.index("# Privacy report")  # after the research-mode caveats (noise_seed is set)
    assert top == 4 and lines[0].startswith("**NOT FULLY PRIVATE: research mode")
    assert lines[top + 2].startswith("**Noise: discrete Gaussian in the SecAgg ring; online binary tree")
    assert "Delta_s" in report and HONEST_ONLY not in report
    assert summary["noise_mechanism"] == "discrete Gaussian in the SecAgg ring"
    assert summary["honest_participants_only"] is False
    # `dpfleet account --noise discrete` gives the report's figure (RDP; PLD is refused)
    from dpfleet.coordinator.cli.account import account

    args = ["-z", str(cfg.dp.noise_multiplier), "--delta", str(cfg.dp.delta), "--noise", "discrete",
            "--participation-log", str(run / "participation.jsonl")]
    out = CliRunner().invoke(account, [*args, "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["epsilon"] == pytest.approx(privacy["epsilon"], rel=1e-12)
    refused = CliRunner().invoke(account, [*args, "--method", "pld"])
    assert refused.exit_code != 0 and "not a proven bound" in str(refused.exception)


def test_explicit_continuous_noise_with_secagg_is_reported_as_honest_participants_only(tmp_path):
    """Kept for research comparisons; the report, privacy.json, summary.json and the CLI say it."""
    from dpfleet.coordinator.cli.simulate import simulate
    from dpfleet.coordinator.state.run_dir import to_toml

    cfg = tiny_cfg(rounds=1, eval_every=1, dp={"noise": "gaussian"}, aggregation={"kind": "secagg"})
    config = tmp_path / "gauss.toml"
    config.write_text(to_toml(cfg.resolved()))
    result = CliRunner().invoke(simulate, [str(config), "--out", str(tmp_path / "run"), "--quiet"])
    assert result.exit_code == 0, result.output
    assert f"WARNING               {HONEST_ONLY}" in result.output
    assert "noise                 continuous Gaussian after decoding" in result.output
    run = tmp_path / "run"
    report = (run / "privacy_report.md").read_text().splitlines()
    top = report.index("# Privacy report")  # after the caveats (noise_seed is set)
    # the caveats: the first line, research mode's statement, the honest-only warning, then the title
    assert top == 6 and "private only against honest participants" in report[0]
    assert report[4] == f"**{HONEST_ONLY}**"  # before the statement
    assert report[top + 2].startswith("**Noise: continuous Gaussian after decoding; online binary tree")
    for name in ("privacy.json", "summary.json"):
        values = json.loads((run / name).read_text())
        assert values["honest_participants_only"] is True
        assert values["honest_participants_only_statement"] == HONEST_ONLY
    # `service serve` prints the same before it starts and when it ends
    from dpfleet.service.cli import noise_line, noise_warning

    assert noise_warning(cfg) == f"WARNING: {HONEST_ONLY}"
    assert noise_line(cfg) == "continuous Gaussian after decoding"
    default = tiny_cfg(rounds=1, aggregation={"kind": "secagg"})
    assert noise_warning(default) is None
    assert noise_line(default) == "discrete Gaussian in the SecAgg ring"


def test_the_service_sizes_the_ring_for_the_round_size(tmp_path):
    """Over-selection no longer refuses ring noise: the ring holds report goal + over-selected
    devices at +-L plus the noise bound without wrapping."""
    from dpfleet.coordinator.engine.round_engine import discrete_plan
    from dpfleet.coordinator.serve_plan import check_service_config

    cfg = tiny_cfg(rounds=2, aggregation={"kind": "secagg"}, service={"overselect": 0.6})
    check_service_config(cfg)  # no refusal
    plan = discrete_plan(cfg, 5000)
    n = round_size(cfg)
    assert n > cfg.dp.report_goal and plan.ring_clients >= n
    assert n * plan.level + plan.noise_bound <= 2**31 - 1
