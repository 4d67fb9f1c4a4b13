"""The round engine's contract, driven by hand phase by phase as the networked coordinator will
drive it: the same run as `run_simulation`, bit for bit; phases out of order refused without
touching the state; Stop returned at the end of the budget or the population; the release record
durable before close_round returns, so a crash right after it never recomputes that round."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from crashes import Crash
from safetensors.numpy import load_file

from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.backends import make_trainer, trainer_precision
from dpfleet.coordinator.engine.evaluation import split_held_out
from dpfleet.coordinator.engine.round_engine import RoundEngine, RoundPlan, RoundStateError, Stop
from dpfleet.coordinator.engine.simulation import (
    derive_seed,
    make_aggregator,
    make_runtime,
    prepare_data,
    run_simulation,
    train_plan,
)
from dpfleet.coordinator.state.release_log import RELEASES, ReleaseLog, check_no_reuse, release_hash
from dpfleet.coordinator.state.resume import data_fingerprint, fingerprint_secret
from dpfleet.coordinator.state.run_dir import RunDir
from dpfleet.export.models import build_model

ROUNDS = 6
# timer participation with waits and refusals, adaptive clipping with a restart, research-mode
# noise (dp.noise_seed) so that two runs of the config can be compared exactly
CFG = {
    "rounds": ROUNDS, "eval_every": 3, "seed": 3, "checkpoint_every": 2,
    "data": {"dataset": "shakespeare", "max_clients": 10, "eval_examples": 40, "max_examples": 8,
             "keyboard_words": 0},  # no keyboard metrics: seconds a run, read by none
    "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024},
    "model": {"arch": "cifg", "embedding_dim": 8, "hidden_dim": 8, "projection_dim": 8},
    "client": {"lr": 1.0, "batch_size": 8},
    "dp": {"noise_multiplier": 1.0, "clip_norm": 0.5, "report_goal": 3, "momentum": 0.5,
           "adaptive_clipping": True, "clip_count_stddev": 1.0, "restart_rounds": [4],
           "noise_seed": 11},
    "participation": {"mode": "timer", "timer_period": 0.5, "round_minutes": 10.0},
    "devices": {"availability": 0.7},
}
QUIET = {"progress": False, "log": lambda s: None}
LOGS = ("participation.jsonl", RELEASES, "metrics.jsonl")


def cfg_with(**dp):
    return parse_config({**CFG, "dp": {**CFG["dp"], **dp}})


def by_hand(cfg, out):
    """What a service does, in-process: the engine plus a trainer and an aggregator of its own."""
    run = RunDir(out)
    run.write_config(cfg.resolved())
    parts, train_and_sum, fingerprint = engine_parts(cfg, out)
    engine = RoundEngine(cfg, run, **parts, fingerprint=fingerprint(fingerprint_secret(out, create=True)))
    return engine, train_and_sum


def engine_parts(cfg, out):
    """The engine's model, fleet and held-out rows; the devices' side (train, then sum); and the
    training data's fingerprint under a given secret."""
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(max(1, cfg.client.threads))
    tokenizer, data = prepare_data(cfg, out / "vocabulary")
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
    model = build_model(model_cfg)
    runtime = make_runtime(cfg, model_cfg, out / "programs")
    trainer = make_trainer(cfg.client.trainer, runtime, model_cfg, seq_len=cfg.data.seq_len,
                           batch_size=cfg.client.batch_size, device=cfg.client.device,
                           memory_mb=cfg.client.cohort_memory_mb, backend=cfg.backend,
                           precision=cfg.client.precision)  # as simulate: auto resolves per CPU
    test_rows, _ = split_held_out(data.test, cfg.data.eval_examples or None)
    aggregator = make_aggregator(cfg)

    def train_and_sum(plan: RoundPlan):  # in a service: devices train, SecAgg messages sum
        updates = train_plan(cfg, trainer, data.train, plan)
        agg_seed = derive_seed(cfg.seed, "agg", plan.round)
        return aggregator.aggregate([u.delta for u in updates], agg_seed), updates

    parts = {"model": model, "model_cfg": model_cfg, "tokenizer": tokenizer,
             "users": [c.user for c in data.train], "test_rows": test_rows,
             "precision": trainer_precision(trainer)["used"]}
    return parts, train_and_sum, lambda secret: data_fingerprint([c.examples for c in data.train],
                                                                  tokenizer, secret)


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """The simulation of CFG (noise seed 11), read by the by-hand and the other-seed tests."""
    return run_simulation(cfg_with(), tmp_path_factory.mktemp("sim") / "sim", **QUIET)


def test_engine_by_hand_gives_the_simulation_bit_for_bit(simulated, tmp_path):
    cfg, sim = cfg_with(), simulated
    engine, train_and_sum = by_hand(cfg, tmp_path / "hand")
    while not isinstance(plan := engine.open_round(), Stop):
        assert plan.theta_sha256 == release_hash(plan.theta)  # what devices download, by hash
        engine.close_round(plan, *train_and_sum(plan))
        if engine.resume_point_due():
            engine.save_resume_point()
    assert plan.reason == "done"
    engine.finish(stopped_early=None, baseline={"accuracy": 0.0}, started=0.0)
    for name in LOGS:  # participation, releases (model hashes, tree positions), DP metrics: exact
        hand, ref = (tmp_path / "hand" / name).read_text(), (sim.run_dir / name).read_text()
        if name == RELEASES:  # all but the data fingerprint, a MAC under each run's own secret
            hand, ref = ([{k: v for k, v in json.loads(line).items() if k != "data_sha256"}
                          for line in text.splitlines()] for text in (hand, ref))
        assert hand == ref, name
    fingerprints = {r["data_sha256"] for d in (tmp_path / "hand", sim.run_dir)
                    for r in ReleaseLog(d / RELEASES).released_rounds()}
    assert len(fingerprints) == 2  # one per run: independent secrets
    released = [r["participants"] for r in ReleaseLog(sim.run_dir / RELEASES).released_rounds()]
    assert len(released) == ROUNDS and any(r["restart"] for r in sim.metrics[1:])
    assert len({tuple(p) for p in released}) > 1  # the timer really rotated devices
    hand = load_file(str(tmp_path / "hand" / "checkpoint" / "server_state.safetensors"))
    ref = load_file(str(sim.run_dir / "checkpoint" / "server_state.safetensors"))
    assert hand.keys() == ref.keys() and all(np.array_equal(hand[k], ref[k]) for k in ref)
    assert json.loads((tmp_path / "hand" / "privacy.json").read_text())["epsilon"] == sim.privacy["epsilon"]


def test_a_different_noise_seed_changes_the_released_models(simulated, tmp_path):
    """The equality above is not vacuous: the release hashes do depend on the noise."""
    assert CFG["dp"]["noise_seed"] == 11
    a = simulated.run_dir / RELEASES
    b = run_simulation(cfg_with(noise_seed=12), tmp_path / "b", **QUIET).run_dir / RELEASES
    ra, rb = ReleaseLog(a).released_rounds(), ReleaseLog(b).released_rounds()
    assert [r["participants"] for r in ra] == [r["participants"] for r in rb]
    assert all(x["released"] != y["released"] for x, y in zip(ra, rb, strict=True))


def test_phases_out_of_order_are_refused_and_change_nothing(tmp_path):
    engine, train_and_sum = by_hand(cfg_with(), tmp_path / "run")
    first = engine.open_round()
    with pytest.raises(RoundStateError, match="is open"):
        engine.open_round()
    with pytest.raises(RoundStateError, match="is open"):
        engine.save_resume_point()
    agg1, stats1 = train_and_sum(first)
    with pytest.raises(RoundStateError, match="client reports"):
        engine.close_round(first, agg1, stats1[:-1])
    engine.close_round(first, agg1, stats1)
    theta, released = engine.server.theta.copy(), len(engine.releases.released_rounds())
    with pytest.raises(RoundStateError, match="no round is open"):  # the same plan twice
        engine.close_round(first, agg1, stats1)
    second = engine.open_round()
    with pytest.raises(RoundStateError, match="round 2 is open"):  # round 1's sum in round 2
        engine.close_round(first, agg1, stats1)
    forged = dataclasses.replace(second)  # equal fields, but not the plan the engine handed out
    with pytest.raises(RoundStateError):
        engine.close_round(forged, *train_and_sum(second))
    assert np.array_equal(engine.server.theta, theta) and engine.server.tree.t == 1
    assert len(ReleaseLog(tmp_path / "run" / RELEASES).released_rounds()) == released == 1
    record = engine.close_round(second, *train_and_sum(second))
    assert record["round"] == 2 and engine.server.tree.t == 2


def test_stop_is_returned_when_the_budget_runs_out(tmp_path):
    engine, train_and_sum = by_hand(cfg_with(budget_epsilon=6.0), tmp_path / "run")
    closed = []
    while not isinstance(plan := engine.open_round(), Stop):
        closed.append(engine.close_round(plan, *train_and_sum(plan)))
    assert plan.reason == "budget" and 0 < len(closed) < ROUNDS
    assert f"before round {len(closed) + 1}" in plan.message
    assert closed[-1]["epsilon"] <= 6.0
    assert isinstance(engine.open_round(), Stop)  # asking again is still an answer, not a crash


def test_stop_is_returned_when_the_population_runs_out(tmp_path):
    values = {**CFG, "participation": {"mode": "uniform", "max_participation": 1}}
    engine, train_and_sum = by_hand(parse_config(values), tmp_path / "run")
    closed = 0
    while not isinstance(plan := engine.open_round(), Stop):
        engine.close_round(plan, *train_and_sum(plan))
        closed += 1
    assert plan.reason == "unfillable" and closed == 10 // 3
    assert "before round 4" in plan.message


@pytest.mark.parametrize("point", ["pending_written", "release_line", "metrics_line"])
def test_the_release_is_durable_with_its_metrics_before_close_round_returns(tmp_path, point):
    """A crash inside round 3's commit (`release_log` rule 4): before the release line, round 3
    was never released and is computed again, bit for bit; after it, round 3 is on disk WITH its
    metrics line (the round's own record, written once, not a stub), and resuming never computes
    it again (its state was not saved: a fresh tree)."""
    cfg, out = cfg_with(), tmp_path / "run"
    engine, train_and_sum = by_hand(cfg, out)
    for _ in range(2):
        engine.close_round(plan := engine.open_round(), *train_and_sum(plan))
    engine.save_resume_point()
    plan = engine.open_round()

    def crash(at):
        if at == point:
            raise Crash

    engine.releases.fault = crash
    with pytest.raises(Crash):
        engine.close_round(plan, *train_and_sum(plan))
    released = point != "pending_written"
    on_disk = ReleaseLog(out / RELEASES).released_rounds()  # read back as a restart would
    assert [r["round"] for r in on_disk] == [1, 2, 3][: 2 + released]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics] == [1, 2, 3][: 2 + released]  # rolled forward on open
    assert not (out / "round.pending").exists()
    assert len((out / "participation.jsonl").read_text().splitlines()) == 2

    resumed = run_simulation(cfg, out, resume=True, **QUIET)
    records = ReleaseLog(out / RELEASES).released_rounds()
    assert [r["round"] for r in records] == list(range(1, ROUNDS + 1))
    check_no_reuse(records)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics] == list(range(1, ROUNDS + 1))  # each round once
    assert all("epsilon" in m and "rebuilt_after_crash" not in m for m in metrics)
    summary = json.loads((out / "summary.json").read_text())
    if released:
        assert records[2] == on_disk[2]  # round 3 was not recomputed
        assert records[3]["restart"] and records[3]["tree_id"] > on_disk[2]["tree_id"]  # fresh tree
        assert summary["rounds_lost_in_crash"] == [3]
        assert metrics[2]["clients"] == len(on_disk[2]["participants"])
    else:
        assert summary["rounds_lost_in_crash"] == []
        assert resumed.metrics[2]["round"] == 3 and not records[3]["restart"]
    log = [json.loads(x) for x in (out / "participation.jsonl").read_text().splitlines()]
    assert log[2]["devices"] == records[2]["participants"]  # still accounted
