"""`--set SECTION.KEY=VALUE` (coordinator/config_overrides.py): TOML values, applied to the raw
config before it is parsed, so a typo or a wrong type is the same one-line error as in the file;
wired into `simulate`, `audit` and `service serve` (the run itself is stubbed here: the config
each command would run is what is checked; tests/test_compare.py runs real overridden runs)."""

import pytest

from dpfleet.cli import main
from dpfleet.coordinator.config import SimulationConfig, load_config
from dpfleet.coordinator.config_overrides import apply_overrides, parse_overrides, toml_value, with_values
from dpfleet.errors import DpfleetError

BASE = ("rounds = 4\nseed = 1\n[data]\nmax_clients = 20\n"
        "[dp]\nnoise_multiplier = 1.0\nclip_norm = 0.5\nreport_goal = 5\n")


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "base.toml"
    path.write_text(BASE)
    return path


@pytest.mark.parametrize(("text", "value"), [
    ("true", True), ("3", 3), ("0.5", 0.5), ("1e-6", 1e-6), ('"a b"', "a b"), ("[1, 2]", [1, 2]),
    ("uniform", "uniform"),  # a bare word is a string
    ("data/my users.jsonl", "data/my users.jsonl"), ("", ""), ("2024-01-02", "2024-01-02"),
])
def test_values_are_read_as_toml_and_a_bare_word_is_a_string(text, value):
    assert toml_value(text) == value and type(toml_value(text)) is type(value)


def test_overrides_reach_every_kind_of_key_and_the_file_is_the_rest(config):
    sets = parse_overrides(["rounds=7", "dp.noise_multiplier=2", "participation.mode=uniform",
                            "dp.restart_rounds=[2, 3]", "debug_nonprivate=true",
                            "model.hidden_dim=40", "data.path=users.jsonl", "rounds=9"])
    cfg = load_config(config, sets)
    assert cfg.rounds == 9  # the later --set of a key wins
    assert cfg.dp.noise_multiplier == 2.0 and isinstance(cfg.dp.noise_multiplier, float)
    assert cfg.participation.mode == "uniform" and cfg.dp.restart_rounds == [2, 3]
    assert cfg.debug_nonprivate is True and cfg.model.hidden_dim == 40
    assert cfg.data.path.endswith("users.jsonl")
    assert cfg.seed == 1 and cfg.dp.clip_norm == 0.5 and cfg.data.max_clients == 20  # untouched
    assert load_config(config).resolved() != cfg.resolved()


def test_the_raw_values_are_not_changed_in_place():
    values = {"dp": {"clip_norm": 0.5}}
    out = apply_overrides(values, {"dp.clip_norm": 2.0, "client.lr": 0.1}, SimulationConfig)
    assert values == {"dp": {"clip_norm": 0.5}}
    assert out == {"dp": {"clip_norm": 2.0}, "client": {"lr": 0.1}}


def test_an_override_goes_through_the_files_validation(config):
    """Range and cross-key checks apply to an override as to the file: nothing bypasses them."""
    with pytest.raises(DpfleetError, match="dp.clip_norm must be > 0"):
        load_config(config, parse_overrides(["dp.clip_norm=-1"]))
    with pytest.raises(DpfleetError, match="'participation.mode' must be one of"):
        load_config(config, parse_overrides(["participation.mode=poisson"]))
    with pytest.raises(DpfleetError, match="config key 'dp.report_goal' must be int, got 2.5"):
        load_config(config, parse_overrides(["dp.report_goal=2.5"]))
    with pytest.raises(DpfleetError, match="config key 'dp.noise_multiplier' must be float, got 'high'"):
        load_config(config, parse_overrides(["dp.noise_multiplier=high"]))


@pytest.mark.parametrize(("text", "message"), [
    ("dp.nope=1", "--set dp.nope: [dp] has no key 'nope'; "),
    ("dp.clipnorm=1", "did you mean 'clip_norm'?"),
    ("nope.x=1", "--set nope.x: the config has no key 'nope'; its keys: rounds, "),
    ("dp=3", "--set dp: [dp] is a section; set one of its keys, dp.KEY=VALUE (noise_multiplier, "),
    ("rounds.x=3", "--set rounds.x: rounds is a key, not a section"),
    ("model.arch.x=1", "model.arch is a key, not a section"),
    ("mechanism=tree", "the config has no key 'mechanism'"),  # config.json's binding is no setting
])
def test_an_unknown_key_names_the_key_and_what_the_section_holds(text, message):
    with pytest.raises(DpfleetError, match=None) as err:
        apply_overrides({}, parse_overrides([text]), SimulationConfig)
    assert message in str(err.value) and "\n" not in str(err.value)
    if text.startswith("dp."):  # the valid keys of the section are listed
        assert "its keys: noise_multiplier, clip_norm, report_goal" in str(err.value)


@pytest.mark.parametrize("text", ["dp.clip_norm", "=3", "dp..x=1", ".x=1", "dp.=1"])
def test_a_malformed_override_is_refused(text):
    with pytest.raises(DpfleetError, match="give SECTION.KEY=VALUE"):
        parse_overrides([text])


def _error_line(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("command", ["simulate", "audit"])
def test_cli_a_bad_override_is_one_line_and_writes_nothing(tmp_path, capsys, config, command):
    out = tmp_path / "run"
    line = _error_line(capsys, [command, str(config), "--out", str(out), "--set", "dp.nope=1"])
    assert "--set dp.nope: [dp] has no key 'nope'" in line and "clip_norm" in line
    line = _error_line(capsys, [command, str(config), "--out", str(out), "--set", "dp.clip_norm=x"])
    assert "config key 'dp.clip_norm' must be float, got 'x'" in line
    assert not out.exists()


def test_cli_serve_a_bad_override_is_one_line_and_writes_no_state(tmp_path, capsys, config):
    state = tmp_path / "state"
    line = _error_line(capsys, ["service", "serve", str(config), "--state", str(state),
                                "--set", "service.time_scal=2"])
    assert "did you mean 'time_scale'?" in line and not state.exists()


def test_cli_resume_refuses_overrides(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    line = _error_line(capsys, ["simulate", "--resume", str(run), "--set", "rounds=9"])
    assert "--set" in line and "its own config" in line


def _captured_config(monkeypatch, module: str, name: str) -> list:
    """Stub `module.name` (the call that runs the config) to keep the config it is given."""
    import importlib

    seen = []

    def stub(cfg, *args, **kwargs):
        seen.append((cfg, kwargs.get("plan")))
        raise DpfleetError("stub: not run")

    monkeypatch.setattr(importlib.import_module(module), name, stub)
    return seen


SETS = ["--set", "dp.noise_multiplier=3", "--set", "participation.mode=uniform", "--set", "rounds=2"]


@pytest.mark.parametrize(("argv", "module", "name"), [
    (["simulate"], "dpfleet.coordinator.run", "run"),
    (["audit"], "dpfleet.coordinator.audit.canaries", "run_audit"),
    (["service", "serve"], "dpfleet.service.server", "serve"),
])
def test_cli_each_command_runs_the_overridden_config(tmp_path, capsys, monkeypatch, config, argv,
                                                     module, name):
    seen = _captured_config(monkeypatch, module, name)
    where = ["--state", str(tmp_path / "state")] if argv[0] == "service" else \
        ["--out", str(tmp_path / "run")]
    with pytest.raises(SystemExit):
        main([*argv, str(config), *where, *SETS])
    said = capsys.readouterr()
    assert said.err.splitlines()[-1] == "error: stub: not run"
    assert 'overrides: dp.noise_multiplier=3 participation.mode="uniform" rounds=2' in said.out + said.err
    ((cfg, plan),) = seen
    expected = with_values(load_config(config), {"rounds": 2, "participation.mode": "uniform",
                                                 "dp.noise_multiplier": 3.0})
    assert cfg.resolved() == expected.resolved()
    assert plan.given == {"dp.report_goal": 5, "dp.noise_multiplier": 3,
                          "participation.mode": "uniform"}  # a planned run checks these
