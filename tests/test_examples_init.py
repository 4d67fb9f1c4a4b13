"""The example configs travel in the package and `dpfleet init` writes one where a newcomer works
(issue 33: an installed wheel had no config to run)."""

import os
from pathlib import Path

import pytest

from dpfleet.cli import main
from dpfleet.coordinator.config import load_config
from dpfleet.examples import EXAMPLES, example_text

REPO = Path(__file__).resolve().parent.parent
PACKAGED = REPO / "dpfleet" / "configs"


def dpfleet(capsys, *args):
    """(exit code, stdout, stderr) of `dpfleet ARGS` run in this process."""
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_every_packaged_config_is_an_example_and_the_repository_paths_are_the_same_files():
    assert sorted(e.file for e in EXAMPLES.values()) == sorted(p.name for p in PACKAGED.glob("*.toml"))
    for example in EXAMPLES.values():  # README's `dpfleet simulate examples/shakespeare_cifg.toml`
        repo_path = REPO / "examples" / example.file
        assert repo_path.resolve() == (PACKAGED / example.file).resolve(), repo_path


def test_init_writes_the_main_job_here_and_keeps_an_existing_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = dpfleet(capsys, "init")
    assert code == 0 and "run it: dpfleet simulate shakespeare_cifg.toml" in out
    written = tmp_path / "shakespeare_cifg.toml"
    assert written.read_text() == (REPO / "examples" / "shakespeare_cifg.toml").read_text()
    assert load_config(written).dp.target_epsilon == 8.0

    written.write_text("rounds = 2\n")  # the user's edit
    code, _, err = dpfleet(capsys, "init")
    assert code == 2 and err.strip() == "error: shakespeare_cifg.toml exists: pass --force to overwrite it"
    assert written.read_text() == "rounds = 2\n"
    assert dpfleet(capsys, "init", "--force")[0] == 0
    assert written.read_text() == example_text("shakespeare")


def test_init_path_is_a_file_or_a_folder(tmp_path, capsys):
    code, out, _ = dpfleet(capsys, "init", "--example", "tiny", tmp_path / "mine.toml")
    assert code == 0 and (tmp_path / "mine.toml").read_text() == example_text("tiny")
    assert f"dpfleet simulate {tmp_path / 'mine.toml'}" in out
    (tmp_path / "sub").mkdir()
    assert dpfleet(capsys, "init", "-e", "fleet", tmp_path / "sub")[0] == 0
    assert (tmp_path / "sub" / "fleet.toml").read_text() == example_text("fleet")
    code, _, err = dpfleet(capsys, "init", "-e", "fleet", f"{tmp_path / 'nowhere'}{os.sep}")
    assert code == 2 and err.startswith("error: no folder") and not (tmp_path / "nowhere").exists()


def test_init_into_an_unwritable_place_is_one_error_line(capsys):
    code, out, err = dpfleet(capsys, "init", "/proc/dpfleet-example.toml")  # even root cannot
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert err.startswith("error: cannot write /proc/dpfleet-example.toml")


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_example_parses_with_its_job(name, tmp_path):
    path = tmp_path / EXAMPLES[name].file
    path.write_text(example_text(name))
    if name == "fred":
        from dpfleet.public.fred_job import load_fred_config

        assert load_fred_config(path).fred.cohort_size > 0
    elif name == "public-pipeline":
        from dpfleet.public.pipeline import load_pipeline

        assert load_pipeline(path).simulation.rounds > 0
    else:
        assert load_config(path).rounds > 0
