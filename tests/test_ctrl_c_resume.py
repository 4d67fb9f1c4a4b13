"""Ctrl-C (and SIGTERM) commit a resume point for the last released round before the process
exits, so `simulate --resume` loses nothing: its final weights and its eps are the uninterrupted
run's, bit for bit (with `dp.noise_seed`, so that a separate reference run has the same noise).
`checkpoint_every` is larger than the run here: every resume point below is the interrupt's.

The first test sends a real SIGINT (and, slow, SIGTERM) to a `dpfleet simulate` process; the
others interrupt an in-process run at known points: inside a round's training (a restart round),
a real SIGINT inside a round's commit, which must be held until the commit is whole, and while
the run finishes."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from crashes import failing_on_round
from safetensors.numpy import load_file

from dpfleet.cli import main
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.simulation import run_simulation
from dpfleet.coordinator.state.release_log import ReleaseLog
from dpfleet.coordinator.state.resume import resume_point
from dpfleet.coordinator.state.run_dir import to_toml

# adaptive clipping with a tree restart, momentum and timer participation: every piece of
# state the resume point saves (theta, momentum, live tree nodes, the clip estimator's count
# tree) or the release log replays (device timers, the accountant) is exercised
CFG = {
    "rounds": 6, "eval_every": 3, "seed": 11, "checkpoint_every": 100,
    "data": {"dataset": "shakespeare", "max_clients": 12, "eval_examples": 100, "max_examples": 16,
             "keyboard_words": 0},  # no keyboard metrics: seconds a run, read by none
    "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024},
    "model": {"arch": "cifg", "embedding_dim": 16, "hidden_dim": 32, "projection_dim": 16},
    "client": {"lr": 1.0, "batch_size": 16, "threads": 1},
    "dp": {"noise_multiplier": 1.0, "clip_norm": 0.5, "report_goal": 4, "momentum": 0.5,
           "adaptive_clipping": True, "clip_count_stddev": 1.0, "restart_rounds": [3],
           "noise_seed": 5},
    "participation": {"mode": "timer", "timer_period": 0.5, "round_minutes": 10.0},
    "devices": {"availability": 0.6},
}
QUIET = {"progress": False, "log": lambda s: None}

# `dpfleet simulate` with each round's training slowed by 0.3 s, so that a signal sent once
# round 2 is released lands in a later round (the process, the signal and the CLI are real)
SLOW_CLI = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even under nohup
import dpfleet.coordinator.engine.simulation as simulation
real = simulation.train_plan
def slow(*args, **kwargs):
    time.sleep(0.3)
    return real(*args, **kwargs)
simulation.train_plan = slow
from dpfleet.cli import main
main(sys.argv[1:])
"""


def outputs(path):
    """What must not depend on whether the run was interrupted: the final weights and server
    state, eps and the whole privacy summary, every round's metrics and participation."""
    checkpoint = path / "checkpoint"
    return {
        "model": {k: v.tobytes() for k, v in load_file(str(checkpoint / "model.safetensors")).items()},
        "server": {k: v.tobytes() for k, v in
                   load_file(str(checkpoint / "server_state.safetensors")).items()},
        "privacy": json.loads((path / "privacy.json").read_text()),
        "metrics": (path / "metrics.jsonl").read_text(),
        "participation": (path / "participation.jsonl").read_text(),
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    run_simulation(parse_config(CFG), out, **QUIET)
    return outputs(out)


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(to_toml(parse_config(CFG).resolved()))
    return path


def released(out) -> int:
    return len(ReleaseLog(out / "releases.jsonl").released_rounds())


def rounds_in_resume_point(out) -> int:
    return json.loads((resume_point(out) / "server_state.json").read_text())["rounds_done"]


def resume_and_check(out, reference, capsys, after: int) -> None:
    """`simulate --resume`: goes on after the last released round (nothing lost) and ends where
    the uninterrupted run ended."""
    capsys.readouterr()
    main(["simulate", "--resume", str(out), "--quiet"])
    log = capsys.readouterr().out
    assert f"resuming after round {after} of 6" in log and "were released but" not in log
    assert json.loads((out / "summary.json").read_text())["rounds_lost_in_crash"] == []
    assert outputs(out) == reference


# a process of its own (torch's import, the data) with slowed rounds: 5 s on a quiet machine; the
# same path once more for SIGTERM with the slow tests
@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_a_real_signal_commits_a_resume_point_and_resume_equals_the_uninterrupted_run(
        tmp_path, config_file, reference, capsys, sig):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CLI, "simulate", str(config_file), "--out",
                             str(out), "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").is_file() or \
                len((out / "metrics.jsonl").read_text().splitlines()) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert f"interrupted; continue with: dpfleet simulate --resume {out}" in err
    assert "Traceback" not in err
    done = released(out)
    assert 2 <= done < 6  # interrupted after round 2 was released, before the end
    assert rounds_in_resume_point(out) == done  # no released round outside the resume point
    assert (out / "resume" / "noise_key").stat().st_mode & 0o777 == 0o600
    resume_and_check(out, reference, capsys, done)


def interrupt_and_resume(monkeypatch, owner, name, interrupting, tmp_path, reference, capsys,
                         released_rounds: int) -> dict:
    """Run CFG with `owner.name` replaced by `interrupting(real)` (which interrupts the run), check
    that the resume point holds every released round, resume with the real one and check that
    it ends as the uninterrupted run; returns the interrupt's resume point."""
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, interrupting(real))
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run_simulation(parse_config(CFG), out, **QUIET)
    point = json.loads((resume_point(out) / "server_state.json").read_text())
    assert released(out) == released_rounds == point["rounds_done"]
    monkeypatch.setattr(owner, name, real)
    resume_and_check(out, reference, capsys, released_rounds)
    return point


def test_ctrl_c_in_a_restart_round_saves_the_state_before_the_restart(tmp_path, reference, capsys,
                                                                         monkeypatch):
    """Ctrl-C while round 4's devices train. Round 4 restarts the tree and adopts the clip
    estimate when it opens: the point must hold round 3's tree and estimator, not the restarted
    ones, and the resumed run opens round 4 again (same devices, same noise)."""
    import dpfleet.coordinator.engine.simulation as simulation

    def interrupting(real):
        def train_plan(cfg, trainer, clients, plan):
            if plan.round == 3:
                raise KeyboardInterrupt
            return real(cfg, trainer, clients, plan)
        return train_plan

    point = interrupt_and_resume(monkeypatch, simulation, "train_plan", interrupting, tmp_path,
                                 reference, capsys, 3)
    assert point["tree"]["t"] == 3 and point["tree"]["tree_id"] == 0


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signals reach the main thread only")
def test_a_signal_inside_a_rounds_commit_waits_for_the_commit(tmp_path, reference, capsys,
                                                             monkeypatch):
    """SIGINT as soon as round 3's release is logged, before the engine has taken the round as
    done: held until the round is whole, then the resume point holds round 3 (acted on at once,
    it would leave the engine between two states, and no resume point could be saved)."""

    def interrupting(real):
        def record_release(self, **kwargs):
            record = real(self, **kwargs)
            if kwargs["round"] == 3:
                os.kill(os.getpid(), signal.SIGINT)  # delivered now, inside the round's commit
            return record
        return record_release

    interrupt_and_resume(monkeypatch, ReleaseLog, "record_release", interrupting, tmp_path,
                         reference, capsys, 3)


def test_ctrl_c_while_the_run_finishes_keeps_its_last_round(tmp_path, reference, capsys,
                                                            monkeypatch):
    """All 6 rounds released, Ctrl-C while the final checkpoint is written: the resume point
    holds round 6 (not an older model, which a resume would then ship as the final one)."""
    import dpfleet.coordinator.engine.round_engine as round_engine

    def interrupting(real):
        def save_checkpoint(*args, **kwargs):
            raise KeyboardInterrupt
        return save_checkpoint

    interrupt_and_resume(monkeypatch, round_engine, "save_checkpoint", interrupting, tmp_path,
                         reference, capsys, 6)


def test_ctrl_c_before_the_first_release_keeps_nothing(tmp_path, config_file, capsys, monkeypatch):
    """Nothing was released: nothing to resume, and no half-written run directory is left."""
    failing_on_round(monkeypatch, 1, KeyboardInterrupt)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(["simulate", str(config_file), "--out", str(out), "--quiet"])
    assert exc.value.code == 130
    err = capsys.readouterr().err
    # the hint is the last line: no stray `aborted` after it
    assert err.splitlines()[-1] == "interrupted before anything was kept; run the same command again"
    assert "aborted" not in err
    assert not out.exists()
