"""The public-pool quality grid (benchmarks/quality/public_pool.py): its arms, pairs and configs."""

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

QUALITY = Path(__file__).parents[1] / "benchmarks" / "quality"
sys.path.insert(0, str(QUALITY))  # the script imports its siblings grid / paired
try:
    _spec = importlib.util.spec_from_file_location("public_pool", QUALITY / "public_pool.py")
    public_pool = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(public_pool)
finally:
    sys.path.remove(str(QUALITY))  # no benchmark module shadows another test's imports


def _args(**over) -> argparse.Namespace:
    base = dict(pool=[10_000, 10_000, 3_000], q=[0.005, 0.02, 0.1], epochs=2.0, fewer_epochs=[],
                batch_size=32, seeds=[0, 1, 2], noise=[0.7], momentum=[0.5], rounds=50,
                report_goal=20, eval_examples=1500, teacher="gemma3-270m")
    return argparse.Namespace(**(base | over))


def test_main_rows_train_about_the_asked_epochs_on_their_selection():
    arms = public_pool.arms(_args())
    main = {(a["selection"], a["q"]): a for a in arms if a["name"] != "none"
            and a["epochs"] < 3}
    assert set(main) == {(s, q) for s in ("match", "random") for q in (0.005, 0.02, 0.1)}
    assert {a["selected"] for a in main.values()} == {115, 460, 2300}  # ceil(q * 23,000)
    for a in main.values():
        assert 2.0 <= a["epochs"] < 2.0 + 32 / a["selected"] + 1e-9  # one batch of rounding
    assert main["match", 0.1]["steps"] == 144  # ceil(2 * 2300 / 32)


def test_fixed_step_rows_share_the_largest_selections_budget():
    arms = public_pool.arms(_args())
    budget = [a for a in arms if a["steps"] == 144]
    assert {(a["selection"], a["q"]) for a in budget} == {
        ("match", 0.1), ("random", 0.1), ("match", 0.02), ("match", 0.005)}
    names = [a["name"] for a in arms]
    assert len(names) == len(set(names)) == 9 and names[0] == "none"


def test_comparisons_pair_like_with_like():
    arms = public_pool.arms(_args(fewer_epochs=[0.5]))
    by = {a["name"]: a for a in arms}
    pairs = public_pool.comparisons(arms)
    for family, row, base in pairs:
        r, b = by[row], by[base]
        if family.startswith("matching vs random"):
            assert (r["q"], r["steps"]) == (b["q"], b["steps"]) and r["selection"] != b["selection"]
        elif family.startswith("same steps"):
            assert r["steps"] == b["steps"] and r["q"] < b["q"]
        elif family.startswith("same selection"):
            assert r["q"] == b["q"] and r["steps"] < b["steps"] and r["selection"] == "match"
        else:
            assert base == "none"
    families = {f.split(" (")[0] for f, _, _ in pairs}
    assert {"same steps", "same selection", "vs no public data"} <= families
    fewer = [row for f, row, _ in pairs if f == "same selection (q = 10%), fewer steps"]
    assert fewer == ["match-q10%-36st"]  # the --fewer-epochs 0.5 row


def test_configs_are_valid_paired_and_teacher_free():
    from dpfleet.public.pipeline import parse_pipeline

    args = _args()
    cfgs = [parse_pipeline(public_pool.config(args, a, 1)) for a in public_pool.arms(args)]
    assert all(c.simulation.dp.noise_seed == 1 for c in cfgs)  # same noise draws across arms
    assert all(c.public.kd_beta == 0 and c.public.match_beta == 1 for c in cfgs)  # no teacher
    assert all(c.simulation.data.dataset == "shakespeare-solo" for c in cfgs)
    assert cfgs[0].public.selection == "none"


def test_a_private_pool_source_is_refused():
    from dpfleet.errors import DpfleetError
    from dpfleet.public.pipeline import parse_pipeline

    cfg = public_pool.config(_args(), public_pool.arms(_args())[1], 0)
    cfg["pool"]["sources"] = ["wikitext2", "kjv", "shakespeare"]  # contains the private data
    with pytest.raises(DpfleetError, match="not public"):
        parse_pipeline(cfg)


def test_a_run_folder_is_claimed_by_one_live_worker(tmp_path):
    import os
    import subprocess

    run = tmp_path / "match-q10%-144st-s0"
    (run).mkdir()
    (run / "worker.pid").write_text(str(os.getppid()))  # a live process holds it
    assert not public_pool.claim(run)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (run / "worker.pid").write_text(str(dead.pid))  # a killed worker's stale claim
    assert public_pool.claim(run)
    assert (run / "worker.pid").read_text() == str(os.getpid())
    assert public_pool.claim(run)  # our own claim stays ours
