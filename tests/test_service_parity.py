"""`simulate` and `dpfleet service serve` are one round driver (`round_driver.drive`) over two
collectors; over real sockets, with the same dp.noise_seed, serve's run (devices training
remotely through fleet/link.py + fleet/participant.py) releases what simulate releases. Plain
aggregation: the same participation, DP metrics and final model, bit for bit (the service sums
the float32 reports in position order in float64, as PlainAggregator does). SecAgg: the same
participation and privacy figures, with the device model's dropouts in each SecAgg phase too
(abandoned and reopened rounds included), and in research mode (`dp.noise_seed`, as here) the
same final model bit for bit: each device rounds its update to the ring with the keyed randomness
its assignment carries (`secagg.encoding.rounding_seed`), the simulation with the same."""

import asyncio
import json
import re

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.numpy import load_file
from service_fleet import TINY, fleet_data, run_devices, tiny_cfg

from dpfleet.coordinator.engine.round_engine import RoundEngine
from dpfleet.coordinator.engine.simulation import run_simulation
from dpfleet.edge.devices import Behaviour
from dpfleet.fleet.participant import local_policy
from dpfleet.service.server import shutdown, start


def run_service(cfg, root, device_kw=None, per_device=None, **start_kw):
    """Serve `cfg` on loopback to its end, every train client an emulated device that vanishes
    where the device model says (`Behaviour`: client i is device i, as `simulate` and the fleet
    number them; `device_kw`: more `take_part` arguments, e.g. the pinned fleet keys SecAgg's
    signed mode needs; `per_device`: one device's own `device_loop` arguments)."""
    users, examples = fleet_data(cfg, root / "fleet")
    per_device = {u: {"behaviour": Behaviour(cfg.devices, cfg.seed, i, None, cfg.participation.round_minutes),
                      **(per_device or {}).get(u, {})} for i, u in enumerate(users)}
    keys = {u: Ed25519PrivateKey.generate() for u in users}
    if cfg.aggregation.kind == "secagg":  # each device pins the fleet's keys and its policy,
        # and in research mode takes the assignment's rounding seed
        device_kw = {"pinned": {u: k.public_key().public_bytes_raw() for u, k in keys.items()},
                     "policy": lambda n: local_policy(cfg.dp.report_goal, cfg.aggregation.graph,
                                                      cfg.aggregation.corruption, n),
                     "research_rounding": cfg.dp.noise_seed >= 0,
                     **(device_kw or {})}

    async def main():
        running = await start(cfg, root / "state", log=lambda s: None, **start_kw)
        devices = asyncio.create_task(run_devices(running.url, keys, examples, per_device,
                                                  runtime=cfg.client.runtime, **(device_kw or {})))
        await asyncio.wait_for(asyncio.shield(running.task), 120)
        outcomes = await asyncio.wait_for(devices, 30)
        status = running.driver.status()
        await shutdown(running)
        return status, outcomes

    return asyncio.run(main())


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


# timer participation (every device available, a 15-minute timer: MinS 1 over 10-minute rounds)
# and adaptive clipping (plain: the count from the reports' norms; SecAgg: masked in the vector)
TIMER_ADAPTIVE = {"participation": {"mode": "timer", "timer_period": 0.25}, "devices": {"availability": 1.0},
                  "dp": {"adaptive_clipping": True, "clip_count_stddev": 1.0}}


def with_extra(extra: dict) -> dict:
    """`tiny_cfg` sections: TINY's, updated with `extra`'s keys."""
    return {k: {**TINY.get(k, {}), **v} for k, v in extra.items()}


@pytest.mark.parametrize(("runtime", "extra"), [
    ("eager", {}), pytest.param("onnx", {}, marks=pytest.mark.slow),
    pytest.param("eager", TIMER_ADAPTIVE, marks=pytest.mark.slow, id="eager-timer-adaptive")])
def test_the_service_run_is_the_simulation_bit_for_bit(tmp_path, runtime, extra):
    # an exported runtime builds its training program on first use: a longer report deadline
    cfg = tiny_cfg(client={"runtime": runtime}, service={"report_deadline_s": 120.0},
                   **with_extra(extra))
    sim = run_simulation(cfg, tmp_path / "sim", progress=False, log=lambda s: None)
    status, outcomes = run_service(cfg, tmp_path)
    state = tmp_path / "state"
    assert status["run_state"] == "finished" and status["rounds_committed"] == cfg.rounds
    assert status["rounds_failed"] == 0
    assert lines(state / "participation.jsonl") == lines(tmp_path / "sim" / "participation.jsonl")
    reported = sorted((r, d) for d, outs in outcomes.items() for r, _, o in outs
                      if o.kind == "reported")
    assert reported == sorted((e["round"] + 1, d) for e in lines(state / "participation.jsonl")
                              for d in e["devices"])
    served, simulated = lines(state / "metrics.jsonl"), sim.metrics
    for a, b in zip(served, simulated, strict=True):
        for key in ("round", "clients", "noise_std", "epsilon", "accuracy", "loss", "clip",
                    "clip_estimate", "refused"):
            assert a.get(key) == b.get(key), key
    ours = load_file(state / "checkpoint" / "model.safetensors")
    theirs = load_file(tmp_path / "sim" / "checkpoint" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name in ours:  # bitwise (max |diff| = 0), the strongest tolerance there is
        np.testing.assert_array_equal(ours[name], theirs[name])
    assert json.loads((state / "privacy.json").read_text())["epsilon"] == sim.privacy["epsilon"]
    for name in ("privacy_report.md", "accuracy.png", "summary.json", "service.log", "config.toml",
                 "config.json"):
        assert (state / name).is_file()
    assert not (state / "admin.json").exists()  # the token goes with the process


def assert_same_secagg_rounds(root, sim, survivors: int, cost_keys=()) -> list[dict]:
    """serve's run in root/state and `sim` (in root/sim): the same participation, per-round DP
    figures and SecAgg protocol facts (and `cost_keys`' values), `survivors` in every sum, the
    same privacy.json figures. Returns serve's metrics records."""
    state = root / "state"
    assert lines(state / "participation.jsonl") == lines(root / "sim" / "participation.jsonl")
    served = lines(state / "metrics.jsonl")
    for a, b in zip(served, sim.metrics, strict=True):
        for key in ("round", "clients", "clip", "noise_std", "epsilon", "zcdp", "min_separation",
                    "max_participation", "restart", "clip_estimate", "refused"):
            assert a.get(key) == b.get(key), key
        for key in PROTOCOL_FACTS + tuple(cost_keys):
            assert a["aggregation"][key] == b["aggregation"][key], key
        assert a["clients"] == a["aggregation"]["survivors"] == survivors
    ours, theirs = (json.loads((d / "privacy.json").read_text()) for d in (state, root / "sim"))
    assert (ours["epsilon"], ours["zcdp"]) == (theirs["epsilon"], theirs["zcdp"])
    return served


def assert_same_models(root, served_sums, simulated_sums) -> None:
    """Research mode: every committed sum of both drivers and the final models, bit for bit."""
    assert len(served_sums) == len(simulated_sums)
    for ours, theirs in zip(served_sums, simulated_sums, strict=True):
        np.testing.assert_array_equal(ours.total, theirs.total)
    ours = load_file(root / "state" / "checkpoint" / "model.safetensors")
    theirs = load_file(root / "sim" / "checkpoint" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name])


@pytest.fixture
def engine_sums(monkeypatch) -> list:
    """Every aggregate `RoundEngine.close_round` is handed, in order (both drivers')."""
    sums, close = [], RoundEngine.close_round

    def spy(self, plan, aggregate, stats):
        sums.append(aggregate)
        return close(self, plan, aggregate, stats)

    monkeypatch.setattr(RoundEngine, "close_round", spy)
    return sums


# The aggregation record's figures that are facts of the protocol and the encoding: the same from
# both drivers for the same config and survivors (`secagg.round_sum`). Of its costs, the SecAgg
# message bytes agree too when every device stays; the `*seconds` cannot: simulate times the
# whole emulated protocol in one process, serve the coordinator's side.
PROTOCOL_FACTS = ("aggregation", "graph", "k", "threshold", "threshold_bounded", "assumed_corrupt",
                  "signed", "bits", "padded_length", "scale", "sensitivity", "norm_inflation",
                  "quantization_bound", "survivors", "rejected_messages")


@pytest.mark.slow  # ~35-60 s each on a loaded machine: a simulation and a served run, SecAgg in both
@pytest.mark.parametrize("extra", [{}, TIMER_ADAPTIVE], ids=["uniform", "timer-adaptive"])
def test_a_secagg_service_run_matches_the_simulation(tmp_path, engine_sums, extra):
    """SecAgg (signed, discrete noise in the ring) through `simulate` and through `serve` with an
    emulated fleet: the same participation, per-round DP figures, privacy.json figures and the
    same `aggregation` record (its keys; its protocol facts' and message bytes' values), and in
    research mode the same sums and final model bit for bit. Dropouts: the next test."""
    sums = engine_sums
    cfg = tiny_cfg(rounds=2, eval_every=2, aggregation={"kind": "secagg", "signed": True},
                   service={"report_deadline_s": 60.0, "secagg_phase_deadline_s": 30.0},
                   **with_extra(extra))
    sim = run_simulation(cfg, tmp_path / "sim", progress=False, log=lambda s: None)
    simulated_sums, sums[:] = list(sums), []
    status, _ = run_service(cfg, tmp_path)
    assert status["run_state"] == "finished" and status["rounds_committed"] == cfg.rounds
    assert status["rounds_failed"] == 0
    served = assert_same_secagg_rounds(tmp_path, sim, 3, ("bytes_sent_per_client",
                                                          "bytes_received_per_client"))
    for a, b in zip(served, sim.metrics, strict=True):
        assert ("clip_estimate" in a) == cfg.dp.adaptive_clipping
        assert sorted(a["aggregation"]) == sorted(b["aggregation"])
        assert a["aggregation"]["encode_seconds"] is None  # the devices' time: serve cannot see it
        assert a["aggregation"]["aggregation"] == "secagg"
    assert len(sums) == len(simulated_sums) == cfg.rounds
    assert_same_models(tmp_path, sums, simulated_sums)


SECAGG_PHASES = ("commit", "advertise", "share", "mask", "consistency", "unmask")


def simulated_drops(said: list[str]) -> dict[tuple[int, int], set[tuple[str, str]]]:
    """{(round, attempt): {(device, phase)}}: the SecAgg dropouts `simulate` drew and logged."""
    drawn = {}
    for line in said:
        m = re.fullmatch(r"round (\d+) \(attempt (\d+)\): SecAgg dropouts \((.*)\)", line)
        if m:
            drawn[int(m[1]), int(m[2])] = {(d, phase) for part in m[3].split("; ")
                                           for phase, ds in [part.split(": ")] for d in ds.split(", ")}
    return drawn


# devices.dropout_secagg 0.11 over 2 timer rounds of 3 devices (the report goal; k and t planned
# for 10% dropout, `fleet_margins`: t = 2 of 3, so a device gone aborts the attempt in the phase
# it vanishes, and a later drawn dropout of that attempt is never reached). With seed 5 the device
# model (edge.devices.drop_draw, hand-listed from its draws) drops, by (round, attempt), the plan's
# positions in these phases (the earliest phase first): (1, 1) 2 share; (1, 2) 2 commit, 0 unmask;
# (1, 3) 1 commit; (1, 4) 0 commit, 2 advertise; (1, 5) 1 share; (1, 6) 0, 1 commit, 2 share;
# (1, 7) 0 unmask; (1, 8) 1 advertise, 0 share; (1, 9) 0 share; (2, 1) 0, 1 consistency; (2, 2)
# 1, 2 mask; (2, 3) 2 commit, 0 advertise, 1 unmask; (2, 4) 2 share, 1 mask. Round 1 commits at
# attempt 10, round 2 at 5: every phase is some attempt's earliest.
DROPOUT_SECAGG = 0.11
ABANDONED = [(1, a) for a in range(1, 10)] + [(2, a) for a in range(1, 5)]


@pytest.mark.slow  # 15 round attempts each way, 13 waiting on a SecAgg phase deadline
def test_device_model_dropouts_in_each_secagg_phase_give_the_same_rounds_from_both_drivers(
        tmp_path, engine_sums):
    """SecAgg (signed), timer participation, adaptive clipping and the device model's SecAgg
    dropouts (`devices.dropout_secagg`): simulate draws them in process, serve's emulated devices
    draw them before each message. The same abandoned attempts, participation, per-round DP
    figures, SecAgg protocol facts and privacy.json figures; every device serve saw vanish is
    one simulate drew, the first of each attempt included, and over the run devices vanished in
    every SecAgg phase. Research mode: the same sums and final model bit for bit (a reopened
    attempt's rounding is keyed by its attempt too)."""
    sums = engine_sums
    extra = with_extra({**TIMER_ADAPTIVE, "devices": {**TIMER_ADAPTIVE["devices"],
                                                       "dropout_secagg": DROPOUT_SECAGG}})
    cfg = tiny_cfg(rounds=2, eval_every=2, aggregation={"kind": "secagg", "signed": True},
                   service={"report_deadline_s": 20.0, "secagg_phase_deadline_s": 3.0,
                            "checkin_window_s": 10.0}, **extra)
    said = []
    sim = run_simulation(cfg, tmp_path / "sim", progress=False, log=said.append)
    simulated_sums, sums[:] = list(sums), []
    drawn = simulated_drops(said)
    assert sorted(drawn) == ABANDONED
    assert [line.split(" abandoned")[0] for line in said if " abandoned: " in line] == [
        f"round {r} (attempt {a})" for r, a in ABANDONED]
    assert {p for drops in drawn.values() for _, p in drops} == set(SECAGG_PHASES)
    status, outcomes = run_service(cfg, tmp_path)
    assert status["run_state"] == "finished" and status["rounds_committed"] == cfg.rounds == 2
    assert status["rounds_failed"] == len(ABANDONED)
    vanished = {}
    for d, outs in outcomes.items():
        for r, a, o in outs:
            if o.kind == "dropped":
                vanished.setdefault((r, a), set()).add((d, o.detail.rsplit(" ", 1)[1]))
    assert sorted(vanished) == ABANDONED
    order = SECAGG_PHASES.index
    for key, gone in vanished.items():  # a later drawn drop is not reached when the attempt aborted first
        assert gone <= drawn[key], key
        assert min(drawn[key], key=lambda x: order(x[1])) in gone, key
    assert {p for gone in vanished.values() for _, p in gone} == set(SECAGG_PHASES), vanished
    assert_same_secagg_rounds(tmp_path, sim, 3)
    assert len(sums) == len(simulated_sums) == cfg.rounds  # abandoned attempts hand in no sum
    assert_same_models(tmp_path, sums, simulated_sums)
