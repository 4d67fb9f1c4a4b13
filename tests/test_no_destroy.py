"""No dpfleet command deletes or overwrites what it did not create.

Attacks as a careless user would make them, through the CLI: `compare --tensorboard` aimed at the
folder that holds the runs (its `DIR/<run name>` is the compared run itself), at a user's own
folder, or at a run directory; `simulate --overwrite` aimed at a folder of the user's files. Each
asserts on the bytes: every file that was there is still there, unchanged. What dpfleet made
itself (a marked TensorBoard folder, a run directory) it may still replace."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cli_helpers import run_here
from test_compare import CONFIG
from test_tensorboard import read_events

from dpfleet.coordinator.state import tensorboard_log
from dpfleet.coordinator.state.run_dir import to_toml
from dpfleet.errors import DpfleetError


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """runs/base: one finished tiny run (2 rounds), its config at runs/../tiny.toml."""
    root = tmp_path_factory.mktemp("no-destroy")
    (root / "tiny.toml").write_text(to_toml(CONFIG))
    (root / "runs").mkdir()
    proc = run_here("simulate", str(root / "tiny.toml"), "--out", str(root / "runs" / "base"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    return root / "runs"


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative path -> bytes)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_error(proc) -> str:
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_tensorboard_into_the_folder_of_runs_keeps_the_compared_run(runs):
    """`--tensorboard runs`: runs/base is the run being compared; it deleted it (13 entries -> 1
    events file). Now refused, and every file of the run (releases, privacy.json, ...) is intact."""
    before = snapshot(runs / "base")
    assert {"releases.jsonl", "privacy.json", "config.json", "summary.json"} <= set(before)
    line = one_error(run_here("compare", str(runs / "base"), "--no-plot", "--tensorboard", str(runs)))
    assert f"{runs / 'base'}" in line and "not a TensorBoard folder dpfleet wrote" in line
    assert snapshot(runs / "base") == before


def test_tensorboard_refuses_a_users_folder_and_a_run_directory(runs, tmp_path):
    mine = tmp_path / "tb" / "base"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("my notes")
    (mine / "events.out.tfevents.1.mine").write_bytes(b"another tool's events")
    before = snapshot(mine)
    one_error(run_here("compare", str(runs / "base"), "--no-plot", "--tensorboard", str(tmp_path / "tb")))
    assert snapshot(mine) == before
    run_before = snapshot(runs / "base")  # DIR a run directory: nothing written into it
    line = one_error(run_here("compare", str(runs / "base"), "--no-plot", "--tensorboard",
                              str(runs / "base")))
    assert "is a run directory" in line and snapshot(runs / "base") == run_before


def test_tensorboard_replaces_only_its_own_folder_and_its_own_events(runs, tmp_path):
    """A folder dpfleet marked is rewritten (one events file, the run's rounds), and a file the
    user put into it is left alone."""
    for _ in range(2):
        proc = run_here("compare", str(runs / "base"), "--no-plot", "--tensorboard", str(tmp_path))
        assert proc.returncode == 0, proc.stderr
        (tmp_path / "base" / "mine.txt").write_text("kept")
    folder = tmp_path / "base"
    assert (folder / tensorboard_log.MARKER).is_file() and (folder / "mine.txt").read_text() == "kept"
    assert len(list(folder.glob("events.out.tfevents.*"))) == 1
    assert {step for step, *_ in read_events(folder)} == {0, 1, 2}  # 0: the starting model


def test_simulate_overwrite_keeps_a_folder_that_is_no_run(runs, tmp_path):
    """`simulate --overwrite --out FOLDER` on a folder of the user's files (a vocabulary/ and a
    config.json of their own among them): refused, every byte kept."""
    folder = tmp_path / "project"
    (folder / "vocabulary").mkdir(parents=True)
    (folder / "vocabulary" / "words.txt").write_text("my words")
    (folder / "config.json").write_text('{"mine": true}')
    (folder / "metrics.jsonl").write_text('{"my": "metrics"}\n')
    before = snapshot(folder)
    line = one_error(run_here("simulate", str(runs.parent / "tiny.toml"), "--out", str(folder),
                              "--overwrite", "--quiet"))
    assert "not a run directory" in line and snapshot(folder) == before


def test_the_plot_replaces_only_a_plot_of_compare(runs, tmp_path):
    """`--plot` at a user's file, or at the run's own accuracy.png: refused, bytes kept. The
    default compare.png of an earlier compare is replaced (drawn again, valid PNG)."""
    mine = tmp_path / "figure.png"
    mine.write_bytes(b"\x89PNG\r\n\x1a\n a user's figure")
    for target in (mine, runs / "base" / "accuracy.png"):
        before = target.read_bytes()
        line = one_error(run_here("compare", str(runs / "base"), "--plot", str(target)))
        assert "exists and is not a file this command wrote" in line and target.read_bytes() == before
    for _ in range(2):
        proc = run_here("compare", str(runs / "base"), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compare.png", "figure.png"]  # no temp left


def test_a_legacy_tensorboard_folder_of_a_run_is_adopted_and_no_other(tmp_path):
    """A run's tensorboard/ that an older dpfleet wrote (event files only, no marker) is the run's
    own; the same folder outside a run (`in_run` false), or with any other file, is refused."""
    folder = tmp_path / "tensorboard"
    folder.mkdir()
    (folder / "events.out.tfevents.1.old").write_bytes(b"old events")
    with pytest.raises(DpfleetError, match="not a TensorBoard folder dpfleet wrote"):
        tensorboard_log.claim(folder)
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(DpfleetError, match="not a TensorBoard folder dpfleet wrote"):
        tensorboard_log.claim(folder, in_run=True)
    (folder / "notes.txt").unlink()
    tensorboard_log.claim(folder, in_run=True)
    assert sorted(p.name for p in folder.iterdir()) == [tensorboard_log.MARKER]


def test_offline_stage_replaces_only_a_teacher_it_staged(tmp_path):
    """`public offline-stage --out OUT --teacher FOLDER`: OUT/teachers/<name> that holds a user's
    files (not listed in OUT's staged.json) is refused and kept; one it staged is replaced."""
    teacher = tmp_path / "my-teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text('{"model_type": "tiny"}')
    out = tmp_path / "cache"
    mine = out / "teachers" / "my-teacher"
    mine.mkdir(parents=True)
    (mine / "weights.bin").write_bytes(b"the user's own weights")
    before = snapshot(out)
    args = ("public", "offline-stage", "--out", str(out), "--teacher", str(teacher))
    line = one_error(run_here(*args))
    assert "was not staged by dpfleet" in line and snapshot(out) == before
    (mine / "weights.bin").unlink()
    mine.rmdir()
    for _ in range(2):  # staged, then staged again over its own copy
        proc = run_here(*args)
        assert proc.returncode == 0, proc.stderr
    assert (mine / "config.json").read_text() == '{"model_type": "tiny"}'


def test_plan_out_refuses_a_run_directory(runs, tmp_path):
    """`plan --out RUN`: a planned run keeps its plan.json in its run directory (the plan it ran);
    writing another plan over it is refused, and nothing is added to the run."""
    run = tmp_path / "planned"
    shutil.copytree(runs / "base", run)
    (run / "plan.json").write_text('{"the plan": "this run ran"}\n')
    before = snapshot(run)
    line = one_error(run_here("plan", "-N", "1277", "-T", "60", "--target-epsilon", "8", "--delta", "1e-6",
                              "--out", str(run)))
    assert "is a run directory" in line and snapshot(run) == before


def test_pretrain_overwrite_refuses_a_runs_checkpoint(runs):
    """`public pretrain --out RUN/checkpoint --overwrite` would replace the run's released model
    with a public one (its privacy.json still describing the private one): refused, bytes kept."""
    before = snapshot(runs / "base")
    line = one_error(run_here("public", "pretrain", "--out", str(runs / "base" / "checkpoint"),
                              "--tokenizer", str(runs / "base" / "checkpoint" / "tokenizer"),
                              "--overwrite", "--steps", "1", "--max-records", "50"))
    assert "is a run directory or inside one" in line and snapshot(runs / "base") == before
