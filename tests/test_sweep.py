"""`dpfleet sweep`: a grid of configs with seeds, each an ordinary run directory, resumable after
Ctrl-C, summarised as mean and 95% t-interval per grid point (a table that fits a terminal and a
plot), and refused where another sweep or a user's folder already is."""

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

import dpfleet.coordinator.run as coordinator_run
from dpfleet.cli import cli
from dpfleet.coordinator.sweep import expand, parse_grid, render_summary, split_values, summarize, t_interval
from dpfleet.errors import DpfleetError

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny.toml"
# no keyboard metrics: they were 40% of the runs' time, and nothing of a sweep reads them
ARGS = ["--grid", "dp.target_epsilon=4,8", "--set", "dp.noise_seed=3", "--set", "rounds=2",
        "--set", "data.keyboard_words=0", "--quiet"]


def sweep(out: Path, *extra: str):
    return CliRunner().invoke(cli, ["sweep", str(TINY), *ARGS, "--out", str(out), *extra])


def test_grid_values_are_toml_and_split_outside_brackets_and_quotes():
    assert split_values('0.5, 1,[1, 2],"a,b"') == ["0.5", "1", "[1, 2]", '"a,b"']
    assert parse_grid(["dp.noise_multiplier=0.5,1", 'participation.mode=uniform,"disjoint"']) == {
        "dp.noise_multiplier": [0.5, 1], "participation.mode": ["uniform", "disjoint"]}
    for bad, message in [(["dp.clip_norm"], "give KEY=V1,V2"), (["x=1,,2"], "give KEY=V1,V2"),
                         (["x=1,1"], "a value is repeated"), (["x=1", "x=2"], "names x twice"),
                         ([], "at least one --grid")]:
        with pytest.raises(DpfleetError, match=message):
            parse_grid(bad)
    runs = expand({"dp.a": [1, 2], "b": ["x y"]}, [0, 1])
    assert [r.name for r in runs] == ["a=1_b=x_y-seed0", "a=1_b=x_y-seed1", "a=2_b=x_y-seed0",
                                      "a=2_b=x_y-seed1"]


def test_the_interval_is_students_t_with_the_sample_sd():
    mean, half = t_interval([1.0, 2.0, 3.0])  # sd 1, t(0.975, 2) = 4.302653
    assert mean == 2.0 and half == pytest.approx(4.302653 / math.sqrt(3), rel=1e-6)
    assert t_interval([0.25]) == (0.25, None)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "reference"
    result = sweep(out)
    assert result.exit_code == 0, result.output
    return out, result.output


def test_a_sweep_runs_every_point_and_summarises_it(reference):
    out, output = reference
    spec = json.loads((out / "sweep.json").read_text())
    assert [r["name"] for r in spec["runs"]] == ["target_epsilon=4-seed0", "target_epsilon=8-seed0"]
    for run in spec["runs"]:  # each point is an ordinary, finished run of its values
        config = json.loads((out / run["name"] / "config.json").read_text())
        assert config["dp"]["target_epsilon"] == run["values"]["dp.target_epsilon"]
        assert (out / run["name"] / "summary.json").is_file()
    summary = summarize(out)
    assert [p["values"] for p in summary["points"]] == [{"dp.target_epsilon": 4}, {"dp.target_epsilon": 8}]
    eps = [p["epsilon"]["mean"] for p in summary["points"]]
    assert eps[0] <= 4.0 + 1e-9 and eps[1] <= 8.0 + 1e-9 and eps[0] < eps[1]
    table = render_summary(summary)
    assert table in output and max(len(line) for line in table.splitlines()) <= 100
    assert (out / "sweep.png").stat().st_size > 0


@pytest.mark.slow
def test_ctrl_c_then_the_same_command_continues_bit_for_bit(reference, tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    real_run, calls = coordinator_run.run, []

    def run(*args, **kwargs):  # the second run is interrupted after its first committed round
        calls.append(kwargs.get("resume"))
        if len(calls) == 2:
            def stop(record):
                raise KeyboardInterrupt
            kwargs["on_round"] = stop
        return real_run(*args, **kwargs)

    monkeypatch.setattr(coordinator_run, "run", run)
    stopped = sweep(out)
    assert stopped.exit_code != 0 and "continue with: dpfleet" in stopped.output
    assert (out / "target_epsilon=4-seed0" / "summary.json").is_file()
    assert not (out / "target_epsilon=8-seed0" / "summary.json").exists()
    again = sweep(out)
    assert again.exit_code == 0, again.output
    assert "[1/2] target_epsilon=4-seed0: finished earlier, kept" in again.output
    assert "[2/2] target_epsilon=8-seed0: resuming" in again.output
    assert calls == [False, False, True]  # the kept run was not run again
    ref = reference[0]
    for name in ("target_epsilon=4-seed0", "target_epsilon=8-seed0"):
        model = Path("checkpoint") / "model.safetensors"
        assert (out / name / model).read_bytes() == (ref / name / model).read_bytes()


def test_another_sweep_or_a_users_folder_is_refused(reference, tmp_path):
    out, _ = reference
    other = CliRunner().invoke(cli, ["sweep", str(TINY), "--grid", "dp.target_epsilon=2,4",
                                     "--out", str(out)])
    assert isinstance(other.exception, DpfleetError)  # the CLI prints it as one error: line
    assert "holds another sweep (it differs in grid, overrides, runs)" in str(other.exception)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    refused = sweep(mine)
    assert "is not a sweep's folder" in str(refused.exception)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_compare_of_a_sweep_shows_each_point_with_its_interval(reference, tmp_path):
    out, _ = reference
    shown = CliRunner().invoke(cli, ["compare", str(out), "--json", "--plot", str(tmp_path / "s.png")])
    assert shown.exit_code == 0, shown.output
    summary = json.loads(shown.output[: shown.output.rindex("}") + 1])
    assert summary == json.loads(json.dumps(summarize(out)))
    assert [p["finished"] for p in summary["points"]] == [1, 1]
    assert (tmp_path / "s.png").stat().st_size > 0
    mine = tmp_path / "mine.png"
    mine.write_bytes(b"a user's figure")
    refused = CliRunner().invoke(cli, ["compare", str(out), "--plot", str(mine)])
    assert "exists and is not a file this command wrote" in str(refused.exception)
    assert mine.read_bytes() == b"a user's figure"
