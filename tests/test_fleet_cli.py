"""`dpfleet fleet emulate | run` as a user runs them: clean errors, and `fleet run` end to end on
loopback with Ctrl-C in the middle and a rerun that continues (subprocesses, real sockets)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from cli_helpers import run_here
from test_cli_errors import assert_clean_error, run_cli

TINY_TOML = """
rounds = {rounds}
eval_every = 2
seed = 5
checkpoint_every = 0

[data]
dataset = "shakespeare"
max_clients = 8
eval_examples = 40
max_examples = 8
keyboard_words = 0  # no keyboard metrics: seconds a run, read by none

[tokenizer]
kind = "sentencepiece"
vocab_size = 1024

[model]
arch = "cifg"
embedding_dim = 8
hidden_dim = 8
projection_dim = 8

[client]
lr = 1.0
batch_size = 8
trainer = "sequential"

[dp]
noise_multiplier = 1.0
clip_norm = 0.5
report_goal = 3
momentum = 0.5

[participation]
mode = "uniform"

[service]
checkin_retry_s = 0.2
checkin_window_s = 1.0
report_deadline_s = 10.0

[devices]
latency_ms = {latency_ms}
link_sigma = 0.0
"""


def tiny_toml(tmp_path, rounds=3, latency_ms=2.0):
    path = tmp_path / "fleet.toml"
    path.write_text(TINY_TOML.format(rounds=rounds, latency_ms=latency_ms))
    return path


def test_bad_fleet_config_is_one_clean_line(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[devices]\ndropout_trian = 0.1\n")
    assert_clean_error(run_here("fleet", "emulate", str(cfg), "--coordinator", "http://127.0.0.1:9"),
                       "did you mean 'devices.dropout_train'")
    cfg.write_text("[devices]\ndropout_train = 2.0\n")
    assert_clean_error(run_here("fleet", "run", str(cfg), "--state", str(tmp_path / "s")),
                       "devices.dropout_train must be a probability")
    cfg.write_text("[fleet]\ndropout_train = 0.1\n")  # a config written before [devices]
    assert_clean_error(run_here("fleet", "run", str(cfg), "--state", str(tmp_path / "s")),
                       "config key 'fleet.dropout_train' moved to 'devices.dropout_train'")
    cfg.write_text('[tokenizer]\nkind = "word"\n')
    assert_clean_error(run_here("fleet", "run", str(cfg), "--state", str(tmp_path / "s")),
                       "DP word vocabulary")


def test_fleet_help_explains_the_commands():
    proc = run_here("fleet", "--help")
    assert proc.returncode == 0 and "emulate" in proc.stdout and "run" in proc.stdout
    proc = run_here("fleet", "run", "--help")
    assert "Ctrl-C" in proc.stdout and "continues" in proc.stdout


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def pids_in(text: str) -> list[int]:
    """The coordinator's and the fleet's pids from `fleet run`'s own lines."""
    out = []
    for line in text.splitlines():
        if line.startswith(("coordinator:", "fleet:")) and "(pid " in line:
            out.append(int(line.split("(pid ")[1].split(",")[0].split(")")[0]))
    return out


def committed(state) -> int:
    """Rounds committed so far, from the running coordinator's admin API (token in admin.json)."""
    from dpfleet.edge.wire.admin_client import AdminClient, target_from_state
    from dpfleet.errors import DpfleetError

    try:
        return AdminClient(target_from_state(state), timeout=5.0).status()["rounds_committed"]
    except DpfleetError:
        return 0


def gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow  # ~60-90 s: two runs, each starting a coordinator and two spawned workers
def test_fleet_run_ctrl_c_stops_both_and_a_rerun_continues(tmp_path):
    from test_fleet_emulate import check_committed_log

    from dpfleet.coordinator.config import load_config

    config = tiny_toml(tmp_path, rounds=5, latency_ms=300.0)
    state = tmp_path / "state"
    cmd = [sys.executable, "-m", "dpfleet", "fleet", "run", str(config), "--state", str(state),
           "--processes", "2", "--grace", "20"]
    out = tmp_path / "first.out"
    with open(out, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 240
        while committed(state) < 1 and time.monotonic() < deadline:
            assert proc.poll() is None, out.read_text()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)  # what Ctrl-C in a terminal sends
        rc = proc.wait(90)
    text = out.read_text()
    assert rc == 130, text  # Ctrl-C exits 130, as in every command
    assert "stopping" in text and "Traceback" not in text
    assert f"interrupted; continue with: dpfleet fleet run {config} --state {state}" in text
    pids = pids_in(text)
    assert len(pids) == 2 and all(gone(p) for p in pids), text  # coordinator and fleet both ended
    first = int(text.split(" of 5 rounds committed")[0].rsplit(" ", 1)[1])
    assert 1 <= first < 5, text

    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"run directory: {state}" in done.stdout + done.stderr
    cfg = load_config(config)
    check_committed_log(state, cfg)  # all 5 rounds, each once, eps = a fresh account
    assert len(lines(state / "metrics.jsonl")) == 5
    assert (state / "checkpoint" / "model.safetensors").is_file()
    assert (state / "privacy_report.md").is_file() and (state / "service.log").is_file()
    fleet_dir = tmp_path / "state_fleet"
    assert (fleet_dir / "fleet_keys.json").stat().st_mode & 0o077 == 0
    summary = json.loads((fleet_dir / "summary.json").read_text())
    assert summary["counts"]["done"] == 8 and summary["restarts"] == 0
    assert os.path.getsize(fleet_dir / "serve.console.log") > 0


def test_fleet_run_refuses_what_serve_refuses_before_it_starts_anything(tmp_path):
    """Research-mode noise: `fleet run` says serve's own `error:` line, exit 2, and neither the
    state nor the fleet folder exists (no coordinator, no fleet was started)."""
    config = tiny_toml(tmp_path)
    config.write_text(config.read_text().replace("[dp]\n", "[dp]\nnoise_seed = 5\n"))
    state = tmp_path / "state"
    served = run_here("service", "serve", str(config), "--state", str(tmp_path / "served"))
    ran = run_here("fleet", "run", str(config), "--state", str(state))
    assert ran.returncode == 2 and served.returncode == 2
    assert_clean_error(ran, "dp.noise_seed = 5 is research mode")
    assert ran.stderr == served.stderr  # the same check, the same words
    assert not state.exists() and not (tmp_path / "state_fleet").exists()


def test_emulate_of_a_planned_config_needs_the_coordinators_plan(tmp_path):
    config = tiny_toml(tmp_path)
    text = config.read_text().replace("noise_multiplier = 1.0\n", "").replace("report_goal = 3\n", "")
    config.write_text(text.replace("[dp]\n", "[dp]\ntarget_epsilon = 8.0\n"))
    url = "http://127.0.0.1:9"
    assert_clean_error(run_here("fleet", "emulate", str(config), "--coordinator", url,
                               "--fleet-dir", str(tmp_path / "f")), "--plan STATE/plan.json")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"target_epsilon": 4.0, "delta": 1e-6, "rounds": 3,
                                "mechanism_choice": "tree"}))
    assert_clean_error(run_here("fleet", "emulate", str(config), "--coordinator", url, "--plan",
                               str(plan), "--fleet-dir", str(tmp_path / "f")),
                       "target_epsilon 4.0 -> 8.0")


def test_emulate_names_every_missing_flag_at_once_or_takes_them_from_state(tmp_path):
    """A planned bundle config without --coordinator, --plan, --bundle-key: one line names all
    three (and --state); with --state the URL, plan and key come from the coordinator's folder."""
    from test_fleet_bundle import bundle_toml

    from dpfleet.service.run_bundle import bundle_key

    config = bundle_toml(tmp_path)
    text = config.read_text().replace("noise_multiplier = 1.0\n", "").replace("report_goal = 3\n", "")
    config.write_text(text.replace("[dp]\n", "[dp]\ntarget_epsilon = 8.0\n"))
    line = run_here("fleet", "emulate", str(config), "--fleet-dir", str(tmp_path / "f"))
    assert_clean_error(line, "fleet emulate needs --coordinator URL (the URL `service serve` "
                             "prints); --plan STATE/plan.json (")
    for flag in ("--bundle-key STATE/bundle_key.pub", "or give --state STATE"):
        assert flag in line.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_clean_error(run_here("fleet", "emulate", str(config), "--state", str(empty)),
                       f"{empty} does not hold them")
    state = tmp_path / "state"  # what `service serve --state` leaves while it runs
    state.mkdir()
    (state / "admin.json").write_text(json.dumps({"url": "http://127.0.0.1:9", "token": "t",
                                                  "pid": 1, "tls_cert": None}))
    (state / "plan.json").write_text(json.dumps({"target_epsilon": 4.0, "delta": 1e-6, "rounds": 3,
                                                 "mechanism_choice": "tree"}))
    bundle_key(state)  # bundle_key.pem and its public half, bundle_key.pub
    assert_clean_error(run_here("fleet", "emulate", str(config), "--state", str(state),
                                "--fleet-dir", str(tmp_path / "f")),
                       "target_epsilon 4.0 -> 8.0")  # the state's plan.json was read
    (tmp_path / "u").mkdir()
    unplanned = bundle_toml(tmp_path / "u")
    (state / "bundle_key.pub").write_text("not a key")
    assert_clean_error(run_here("fleet", "emulate", str(unplanned), "--state", str(state),
                                "--fleet-dir", str(tmp_path / "f")),
                       "not an Ed25519 public key")  # the state's bundle_key.pub was read


@pytest.mark.slow  # ~30-60 s: a coordinator and two spawned workers
def test_fleet_run_of_a_planned_config_runs_the_coordinators_plan(tmp_path):
    """dp.target_epsilon through `fleet run`: serve plans at boot (plan.json), the fleet follows
    it (--plan), the run finishes with the planned participation limits obeyed."""
    from dpfleet.coordinator.run_privacy.config_plan import planned_values

    config = tiny_toml(tmp_path, rounds=3)
    text = config.read_text().replace("noise_multiplier = 1.0\n", "").replace("report_goal = 3\n", "")
    config.write_text(text.replace("[dp]\n", "[dp]\ntarget_epsilon = 8.0\nmechanism = \"auto\"\n"))
    state = tmp_path / "state"
    done = run_cli("fleet", "run", str(config), "--state", str(state), "--processes", "2")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    plan = json.loads((state / "plan.json").read_text())
    assert plan["population"] == 8 and plan["target_epsilon"] == 8.0
    serve_log = (tmp_path / "state_fleet" / "serve.console.log").read_text()
    assert sum(x.startswith("plan: eps 8 at delta 1e-06, N 8, 3 rounds") for x in serve_log.splitlines()) == 1
    config_json = json.loads((state / "config.json").read_text())
    for key, value in planned_values(plan).items():  # config.json holds the plan, as simulate's
        section, name = key.split(".")
        assert config_json[section][name] == value
    chosen = plan["chosen"]
    log = lines(state / "participation.jsonl")
    assert [e["round"] for e in log] == [0, 1, 2]
    assert all(len(e["devices"]) >= chosen["report_goal"] for e in log)
    seen: dict[str, list[int]] = {}
    for entry in log:
        for device in entry["devices"]:
            seen.setdefault(device, []).append(entry["round"])
    assert all(len(r) <= chosen["max_participation"] for r in seen.values())
    gaps = [b - a for r in seen.values() for a, b in zip(r, r[1:], strict=False)]
    assert all(g > chosen["min_separation"] for g in gaps)
    assert 0 < json.loads((state / "privacy.json").read_text())["epsilon"] <= 8.0
    from dpfleet.coordinator.cli.result_block import saved_result_lines

    block = saved_result_lines(state)  # fleet run ends with the block simulate ends with
    assert done.stdout.splitlines()[-len(block):] == block


def test_emulate_never_replaces_a_file_it_did_not_write(tmp_path):
    """--summary at a run's summary.json (or any file emulate did not write) is refused before
    anything runs, and the file keeps its bytes."""
    theirs = tmp_path / "summary.json"
    theirs.write_text('{"final": {"accuracy": 0.2}}')
    line = run_here("fleet", "emulate", str(tmp_path / "any.toml"), "--summary", str(theirs))
    assert_clean_error(line, f"{theirs} exists and is not a file this command wrote: choose another "
                             "--summary")
    assert theirs.read_text() == '{"final": {"accuracy": 0.2}}'
