"""`simulate --resume`: an interrupted run whose released rounds were all saved continues bit for
bit (with `dp.noise_seed`, so that the reference run has the same noise); one whose released
rounds were lost keeps them, accounts them and goes on with fresh noise; a run that is not the
same run (other config, other data, tampered log, finished) is refused rather than silently
mixed. The crash-point property test is in test_release_log.py."""

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from crashes import Crash, failing_on_round
from safetensors.numpy import load_file

from dpfleet.cli import main
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.simulation import run_simulation
from dpfleet.coordinator.state.release_log import ReleaseLog, check_no_reuse
from dpfleet.coordinator.state.resume import resume_point
from dpfleet.coordinator.state.run_dir import to_toml
from dpfleet.errors import DpfleetError

# Device timers with waits and refusals, adaptive clipping with tree restarts, tree noise: every
# piece of state the resume point saves or the replay rebuilds is exercised.
CFG = {
    "rounds": 9, "eval_every": 3, "seed": 11, "checkpoint_every": 3,
    "data": {"dataset": "shakespeare", "max_clients": 12, "eval_examples": 150, "max_examples": 16,
             "keyboard_words": 0},  # no keyboard metrics: seconds a run, read by none
    "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024},
    "model": {"arch": "cifg", "embedding_dim": 16, "hidden_dim": 32, "projection_dim": 16},
    "client": {"lr": 1.0, "batch_size": 16},
    "dp": {"noise_multiplier": 1.0, "clip_norm": 0.5, "report_goal": 4, "momentum": 0.5,
           "adaptive_clipping": True, "clip_count_stddev": 1.0, "restart_rounds": [5],
           "noise_seed": 5},
    "participation": {"mode": "timer", "timer_period": 0.5, "round_minutes": 10.0},
    "devices": {"availability": 0.6},
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


@pytest.mark.parametrize("crash_round", [0, 6])  # nothing released / right after a resume point
def test_resumed_run_equals_uninterrupted_run(tmp_path, reference, crash_round):
    out = tmp_path / "run"
    with pytest.raises(Crash):
        run_simulation(parse_config(CFG), out, before_round=crash_before(crash_round), **QUIET)
    done = json.loads((resume_point(out) / "server_state.json").read_text())["rounds_done"] \
        if resume_point(out) else 0
    assert done == crash_round
    assert (out / "resume" / "noise_key").stat().st_mode & 0o777 == 0o600 if done else True
    result = run_simulation(parse_config(CFG), out, resume=True, **QUIET)
    assert outputs(result) == reference
    assert resume_point(out) is None  # a finished run keeps only its final checkpoint
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_after_round"] == (done or None)
    assert summary["rounds_lost_in_crash"] == []


@pytest.mark.parametrize("crash_round", [2, 7])  # before any resume point / after the second
def test_released_rounds_lost_in_a_crash_stay_accounted_and_get_fresh_noise(tmp_path, reference,
                                                                            crash_round):
    out = tmp_path / "run"
    with pytest.raises(Crash):
        run_simulation(parse_config(CFG), out, before_round=crash_before(crash_round), **QUIET)
    before = ReleaseLog(out / "releases.jsonl").released_rounds()
    assert len(before) == crash_round  # every round that ran was released and logged
    done = 3 * (crash_round // 3)
    result = run_simulation(parse_config(CFG), out, resume=True, **QUIET)
    after = ReleaseLog(out / "releases.jsonl").released_rounds()
    assert after[:crash_round] == before  # released rounds are never rewritten or redone
    check_no_reuse(after)
    assert [r["round"] for r in after] == list(range(1, 10))
    fresh = after[crash_round]
    assert fresh["restart"] and fresh["t"] == 1 and fresh["tree_id"] > max(r["tree_id"] for r in before)
    # the accounting and the participation log cover every release, lost ones included
    log = [json.loads(line) for line in (out / "participation.jsonl").read_text().splitlines()]
    assert [e["devices"] for e in log] == [r["participants"] for r in after]
    assert result.privacy["rounds"] == 9 and crash_round in result.privacy["restarts"]
    assert 0 < result.privacy["epsilon"] < float("inf")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds_lost_in_crash"] == list(range(done + 1, crash_round + 1))
    assert [m["round"] for m in result.metrics] == list(range(1, 10))


def test_resume_refuses_changed_client_data(tmp_path, monkeypatch, capsys):
    import dpfleet.coordinator.engine.simulation as simulation

    out = tmp_path / "run"
    config = tmp_path / "tiny.toml"
    config.write_text(to_toml(parse_config(CFG).resolved()))
    with pytest.raises(Crash):
        run_simulation(parse_config(CFG), out, before_round=crash_before(4), **QUIET)
    real = simulation.prepare_data

    def one_client_edited(cfg, *args):  # stands in for a client whose text changed before --resume
        tokenizer, data = real(cfg, *args)
        data.train[1].examples[0, 1] = (data.train[1].examples[0, 1] + 1) % tokenizer.vocab_size
        return tokenizer, data

    monkeypatch.setattr(simulation, "prepare_data", one_client_edited)
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--resume", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert "other client data" in err
    assert len(ReleaseLog(out / "releases.jsonl").released_rounds()) == 4  # nothing was lost


def test_resume_point_survives_a_crash_between_its_two_renames(tmp_path, reference):
    out = tmp_path / "run"
    with pytest.raises(Crash):
        run_simulation(parse_config(CFG), out, before_round=crash_before(6), **QUIET)
    (out / "resume").rename(out / "resume.old")  # the old point moved aside, the new one not yet in
    assert outputs(run_simulation(parse_config(CFG), out, resume=True, **QUIET)) == reference


@pytest.fixture(scope="module")
def interrupted_once(tmp_path_factory):
    out = tmp_path_factory.mktemp("interrupted") / "run"
    with pytest.raises(Crash):
        run_simulation(parse_config(CFG), out, before_round=crash_before(6), **QUIET)
    return out


@pytest.fixture
def interrupted(interrupted_once, tmp_path):
    """Crashed right after the resume point of round 6: nothing released was lost. Each test gets
    its own copy (modes kept: the 0600 key files) of one crashed run, which the tests edit or
    resume; the copy resumes exactly like the original (test_cli_resume: equal to `reference`)."""
    return Path(shutil.copytree(interrupted_once, tmp_path / "run", symlinks=True))


def test_resume_refuses_another_config(interrupted):
    other = dict(CFG, dp=dict(CFG["dp"], noise_multiplier=1.5))
    with pytest.raises(DpfleetError, match="another config.*dp"):
        run_simulation(parse_config(other), interrupted, resume=True, **QUIET)


def test_resume_refuses_a_log_that_does_not_replay(interrupted):
    log = interrupted / "releases.jsonl"
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    users = {d for e in entries for d in e["participants"]}
    outsider = sorted(users - set(entries[1]["participants"]))[0]
    entries[1]["participants"][0] = outsider  # a device the coordinator did not select in round 2
    log.write_text("".join(json.dumps(e) + "\n" for e in entries))
    with pytest.raises(DpfleetError, match="round 2 of the log does not replay"):
        run_simulation(parse_config(CFG), interrupted, resume=True, **QUIET)


@pytest.mark.parametrize(("name", "message"), [
    ("metrics.jsonl", "has 4 rounds but the resume point has 6"),
    ("releases.jsonl", "has 4 released rounds but the resume point has 6"),
])
def test_resume_refuses_a_truncated_log(interrupted, name, message):
    log = interrupted / name
    log.write_text("".join(log.read_text().splitlines(keepends=True)[:4]))
    with pytest.raises(DpfleetError, match=message):
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


def test_resume_refuses_a_resume_point_with_another_noise_key(interrupted, tmp_path):
    other_key = dict(CFG, dp=dict(CFG["dp"], noise_seed=6))  # same model shape, other noise
    other = tmp_path / "other"
    with pytest.raises(Crash):
        run_simulation(parse_config(other_key), other, before_round=crash_before(6), **QUIET)
    shutil.rmtree(interrupted / "resume")
    shutil.copytree(other / "resume", interrupted / "resume")
    with pytest.raises(DpfleetError, match="noise key is not the one round 6 was released with"):
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
    import dpfleet.coordinator.engine.simulation as simulation

    config = tmp_path / "tiny.toml"
    config.write_text(to_toml(parse_config(CFG).resolved()))
    real_make = simulation.make_trainer
    failing_on_round(monkeypatch, 7, KeyboardInterrupt)  # Ctrl-C while round 7's clients train
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(["simulate", str(config), "--out", str(out), "--quiet"])
    assert exc.value.code == 130
    assert f"continue with: dpfleet simulate --resume {out}" in capsys.readouterr().err
    monkeypatch.setattr(simulation, "make_trainer", real_make)
    main(["simulate", "--resume", str(out), "--quiet"])
    assert (out / "metrics.jsonl").read_text() == reference["metrics"]


def test_a_resume_point_of_the_old_format_resumes_and_its_node_vectors_are_never_read(interrupted, reference):
    """An older dpfleet saved the live tree nodes (tree_node_i arrays, the count nodes in the
    JSON). They are ignored: replaced by garbage here, the run still resumes bit for bit."""
    from safetensors.numpy import save_file

    point = interrupted / "resume"
    arrays = load_file(str(point / "server_state.safetensors"))
    state = json.loads((point / "server_state.json").read_text())
    live = len(state["tree"]["nodes"])
    save_file({**arrays, **{f"tree_node_{i}": np.full_like(arrays["theta"], 1e6) for i in range(live)}},
              str(point / "server_state.safetensors"))
    state["clip_estimator"]["tree"]["noise"] = [1e6] * len(state["clip_estimator"]["tree"]["nodes"])
    (point / "server_state.json").write_text(json.dumps(state))
    assert outputs(run_simulation(parse_config(CFG), interrupted, resume=True, **QUIET)) == reference


def test_a_resume_point_whose_tree_positions_were_edited_is_refused(interrupted):
    path = interrupted / "resume" / "server_state.json"
    state = json.loads(path.read_text())
    state["tree"]["nodes"] = [[3, 0]]  # a node no live tree of 1 round has
    path.write_text(json.dumps(state))
    with pytest.raises(DpfleetError, match="lists the live nodes .* the resume point was edited"):
        run_simulation(parse_config(CFG), interrupted, resume=True, **QUIET)


def test_resume_refuses_clients_that_would_train_at_another_precision(interrupted, monkeypatch):
    """`client.precision = "auto"` resolves per CPU: a run resumed where it resolves to another
    precision than the run trained at would switch silently in the middle of the run. Here the
    run trained at float32 and the resume asks "auto" on a CPU faked to have AMX-BF16."""
    import dpfleet.edge.precision as precision

    saved = json.loads((resume_point(interrupted) / "server_state.json").read_text())["precision"]
    assert saved == "float32"  # CFG takes client.precision's default
    monkeypatch.setattr(precision, "native_bf16", lambda: "AMX-BF16")
    monkeypatch.setattr(precision, "AUTO_BF16_MIN_PARAMS", 0)  # this tiny model counts as large
    auto = dict(CFG, client={**CFG["client"], "precision": "auto"})
    before = (interrupted / "releases.jsonl").read_bytes()
    with pytest.raises(DpfleetError, match="trained at float32, this resume would train at bfloat16"):
        run_simulation(parse_config(auto), interrupted, resume=True, **QUIET)
    assert (interrupted / "releases.jsonl").read_bytes() == before and resume_point(interrupted)


def test_naming_the_resolved_precision_is_not_another_config(interrupted):
    """The check is on the precision as resolved, so `auto` and the name it gave are one config."""
    from dpfleet.coordinator.state.resume import check_resumable

    saved = json.loads((resume_point(interrupted) / "server_state.json").read_text())["precision"]
    check_resumable(interrupted, parse_config(dict(CFG, client={**CFG["client"], "precision": saved}))
                    .resolved())


@pytest.mark.skipif(__import__("dpfleet.edge.precision", fromlist=["x"]).native_bf16() is None,
                    reason="client.precision = 'bfloat16' needs a CPU with native BF16")
def test_a_resume_on_other_bfloat16_kernels_is_said_in_the_log_and_in_the_summary(tmp_path, monkeypatch):
    """At bfloat16 the bits come from the C kernels as this machine builds them (source, compiler,
    flags, CPU: `native_cell.Cell.identity`). A resume where they differ (here: the loaded
    kernel renamed, standing in for another compiler's build) continues, but says so: the
    resume point keeps the kernels of the rounds so far, the log warns and summary.json lists
    both. A resume on the same kernels (the control) says nothing."""
    from dpfleet.edge import native_cell

    bf16 = parse_config(dict(CFG, client={**CFG["client"], "precision": "bfloat16"}))
    crashed = tmp_path / "crashed"
    with pytest.raises(Crash):
        run_simulation(bf16, crashed, before_round=crash_before(6), **QUIET)
    here = native_cell.cell().identity
    assert json.loads((resume_point(crashed) / "server_state.json").read_text())["kernels"] == [here]
    results = {}
    for case, identity in (("same", here), ("other", "lstm_cell-0123456789abcdef.so")):
        monkeypatch.setattr(native_cell, "cell", lambda i=identity: dataclasses.replace(
            native_cell.load(os.environ), identity=i))
        out = Path(shutil.copytree(crashed, tmp_path / case, symlinks=True))
        lines: list[str] = []
        run_simulation(bf16, out, resume=True, progress=False, log=lines.append)
        summary = json.loads((out / "summary.json").read_text())
        results[case] = (summary["precision"].get("kernels_used"), [ln for ln in lines if "kernels" in ln])
    assert results["same"] == (None, [])
    used, warned = results["other"]
    assert used == [here, "lstm_cell-0123456789abcdef.so"]
    assert len(warned) == 1 and f"earlier rounds ran the bfloat16 kernels {here}" in warned[0]
