"""`simulate --resume`: an interrupted run continues bit for bit, and a run that is not the same
run (other config, tampered log, finished) is refused rather than silently mixed."""

import json
import shutil

import numpy as np
import pytest
from crashes import Crash, failing_on_round
from safetensors.numpy import load_file

from dpfleet.cli import main
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.resume import resume_point
from dpfleet.coordinator.run_dir import to_toml
from dpfleet.coordinator.simulation import run_simulation
from dpfleet.errors import DpfleetError

# Device timers with waits and refusals, adaptive clipping with tree restarts, tree noise: every
# piece of state the resume point saves or the replay rebuilds is exercised.
CFG = {
    "rounds": 9, "eval_every": 3, "seed": 11, "checkpoint_every": 3,
    "data": {"dataset": "shakespeare", "max_clients": 12, "eval_examples": 150, "max_examples": 16},
    "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024},
    "model": {"arch": "cifg", "embedding_dim": 16, "hidden_dim": 32, "projection_dim": 16},
    "client": {"lr": 1.0, "batch_size": 16},
    "dp": {"noise_multiplier": 1.0, "clip_norm": 0.5, "report_goal": 4, "momentum": 0.5,
           "adaptive_clipping": True, "clip_count_stddev": 1.0, "restart_rounds": [5]},
    "participation": {"mode": "timer", "timer_period": 0.5, "round_minutes": 10.0,
                      "availability": 0.6},
}
QUIET = {"progress": False, "log": lambda s: None}


def crash_before(round_idx):
    def hook(r, theta):
        if r == round_idx:
            raise Crash
    return hook


def outputs(run):
    """Everything a run leaves that must not depend on whether it was interrupted."""
    path = run.run_dir
    state = load_file(str(path / "checkpoint" / "server_state.safetensors"))
    summary = json.loads((path / "summary.json").read_text())
    return {
        "metrics": (path / "metrics.jsonl").read_text(),
        "participation": (path / "participation.jsonl").read_text(),
        "privacy": json.loads((path / "privacy.json").read_text()),
        "final": summary["final"], "simulated_hours": summary["simulated_hours"],
        "server": json.loads((path / "checkpoint" / "server_state.json").read_text()),
        "arrays": {k: v.tobytes() for k, v in state.items()},
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return outputs(run_simulation(parse_config(CFG), tmp_path_factory.mktemp("ref") / "run", **QUIET))


@pytest.mark.parametrize("crash_round", [2, 7])  # before any resume point / after the second
def test_resumed_run_equals_uninterrupted_run(tmp_path, reference, crash_round):
    out = tmp_path / "run"
    with pytest.raises(Crash):
        run_simulation(parse_config(CFG), out, before_round=crash_before(crash_round), **QUIET)
    done = json.loads((resume_point(out) / "server_state.json").read_text())["rounds_done"] \
        if resume_point(out) else 0
    assert done == 3 * (crash_round // 3)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == crash_round  # redone past `done`
    result = run_simulation(parse_config(CFG), out, resume=True, **QUIET)
    assert outputs(result) == reference
    assert resume_point(out) is None  # a finished run keeps only its final checkpoint
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_after_round"] == (done or None)


def test_resume_point_survives_a_crash_between_its_two_renames(tmp_path, reference):
    out = tmp_path / "run"
    with pytest.raises(Crash):
        run_simulation(parse_config(CFG), out, before_round=crash_before(7), **QUIET)
    (out / "resume").rename(out / "resume.old")  # the old point moved aside, the new one not yet in
    assert outputs(run_simulation(parse_config(CFG), out, resume=True, **QUIET)) == reference


@pytest.fixture
def interrupted(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(Crash):
        run_simulation(parse_config(CFG), out, before_round=crash_before(7), **QUIET)
    return out


def test_resume_refuses_another_config(interrupted):
    other = dict(CFG, dp=dict(CFG["dp"], noise_multiplier=1.5))
    with pytest.raises(DpfleetError, match="another config.*dp"):
        run_simulation(parse_config(other), interrupted, resume=True, **QUIET)


def test_resume_refuses_a_log_that_does_not_replay(interrupted):
    log = interrupted / "participation.jsonl"
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    users = {d for e in entries for d in e["devices"]}
    outsider = sorted(users - set(entries[1]["devices"]))[0]
    entries[1]["devices"][0] = outsider  # a device the coordinator did not select in round 2
    log.write_text("".join(json.dumps(e) + "\n" for e in entries))
    with pytest.raises(DpfleetError, match="round 2 of the log does not replay"):
        run_simulation(parse_config(CFG), interrupted, resume=True, **QUIET)


def test_resume_refuses_a_truncated_log(interrupted):
    log = interrupted / "metrics.jsonl"
    log.write_text("".join(log.read_text().splitlines(keepends=True)[:4]))
    with pytest.raises(DpfleetError, match="has 4 rounds but the resume point has 6"):
        run_simulation(parse_config(CFG), interrupted, resume=True, **QUIET)


def test_resume_refuses_a_finished_run_and_a_non_run(tmp_path, interrupted):
    run_simulation(parse_config(CFG), interrupted, resume=True, **QUIET)
    with pytest.raises(DpfleetError, match="finished run"):
        run_simulation(parse_config(CFG), interrupted, resume=True, **QUIET)
    with pytest.raises(DpfleetError, match="not a run directory"):
        run_simulation(parse_config(CFG), tmp_path / "empty", resume=True, **QUIET)


def test_resume_refuses_a_resume_point_of_another_model(interrupted, tmp_path):
    small = dict(CFG, model=dict(CFG["model"], hidden_dim=8))
    other = tmp_path / "other"
    with pytest.raises(Crash):
        run_simulation(parse_config(small), other, before_round=crash_before(4), **QUIET)
    shutil.rmtree(interrupted / "resume")
    shutil.copytree(other / "resume", interrupted / "resume")
    with pytest.raises(DpfleetError, match="another run"):
        run_simulation(parse_config(CFG), interrupted, resume=True, **QUIET)


def test_cli_resume(interrupted, capsys, reference):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "examples/shakespeare_cifg.toml", "--resume", str(interrupted)])
    assert exc.value.code == 2 and "give no CONFIG" in capsys.readouterr().err
    main(["simulate", "--resume", str(interrupted), "--quiet"])
    assert "resuming after round 6 of 9" in capsys.readouterr().out
    metrics = [json.loads(line) for line in (interrupted / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics] == list(range(1, 10))
    assert (interrupted / "metrics.jsonl").read_text() == reference["metrics"]
    assert np.isfinite(json.loads((interrupted / "privacy.json").read_text())["epsilon"])


def test_ctrl_c_says_how_to_resume_and_resume_finishes(tmp_path, capsys, monkeypatch, reference):
    import dpfleet.coordinator.simulation as simulation

    config = tmp_path / "tiny.toml"
    config.write_text(to_toml(parse_config(CFG).resolved()))
    real_make = simulation.make_trainer
    failing_on_round(monkeypatch, 8, KeyboardInterrupt)  # Ctrl-C while round 8's clients train
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(["simulate", str(config), "--out", str(out), "--quiet"])
    assert exc.value.code == 130
    assert f"continue with: dpfleet simulate --resume {out}" in capsys.readouterr().err
    monkeypatch.setattr(simulation, "make_trainer", real_make)
    main(["simulate", "--resume", str(out), "--quiet"])
    assert (out / "metrics.jsonl").read_text() == reference["metrics"]
