"""`dpfleet plan --trace` (coordinator/engine/launch_plan.py): replaying the timer-mode participation
over an availability trace, the realised MinS / MaxP, the choice rule, the CLI's one-line errors,
and a plan checked by running `simulate` with the config it emits on the same trace."""

import json
import tomllib

import pytest

from dpfleet.cli import main
from dpfleet.coordinator.config import ParticipationSection, parse_config
from dpfleet.coordinator.engine.launch_plan import (
    Candidate,
    choose,
    plan_over_trace,
    realised_participation,
    replay,
)
from dpfleet.coordinator.engine.simulation import run_simulation
from dpfleet.edge.devices import DevicesSection
from dpfleet.edge.trace_gen import generate
from dpfleet.edge.traces import write_trace
from dpfleet.errors import DpfleetError

H = 3600


def write_five(path):
    """Five devices over 6 hours, read at 1-hour round slots (slot s at s h):
      device 0: [0, 1), [2, 3), [5, 6) h -> slots 0, 2, 5
      device 1: [1, 2), [3, 5) h         -> slots 1, 3, 4
      device 2: [0, 2) h                 -> slots 0, 1
      device 3: [2, 4) h                 -> slots 2, 3
      device 4: [4, 6) h                 -> slots 4, 5
    so exactly two devices are available at every slot: {0,2} {1,2} {0,3} {1,3} {1,4} {0,4}."""
    lines = [{"format": "dpfleet-trace", "version": 1, "duration": 6 * H},
             {"id": "a", "intervals": [[0, H], [2 * H, 3 * H], [5 * H, 6 * H]]},
             {"id": "b", "intervals": [[H, 2 * H], [3 * H, 5 * H]]},
             {"id": "c", "intervals": [[0, 2 * H]]},
             {"id": "d", "intervals": [[2 * H, 4 * H]]},
             {"id": "e", "intervals": [[4 * H, 6 * H]]}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _section(path, timer):
    return ParticipationSection(mode="timer", timer_period=timer, round_minutes=60.0)


def _devices(path):
    return DevicesSection(trace=str(path))


def test_realised_min_separation_and_max_participation_by_hand(tmp_path):
    path = write_five(tmp_path / "five.jsonl")
    # a 1 h timer at 1 h rounds: back the next slot, the guard's MinS is 0; report goal 2 takes
    # both available devices at each of the 6 slots of a quarter day:
    # rounds {0,2} {1,2} {0,3} {1,3} {1,4} {0,4}; device 0 in rounds 0, 2, 5 (gaps 1, 2), device 1
    # in 1, 3, 4 (gaps 1, 0), devices 2, 3, 4 twice in a row (gap 0): MinS 0, MaxP 3
    run = replay(_section(path, 1.0), _devices(path), 5, 2, 0, 0.25)
    assert (run.rounds, run.slots, run.enforced_min_separation) == (6, [0, 1, 2, 3, 4, 5], 0)
    assert (run.min_separation, run.max_participation) == (0, 3)
    # a 2 h timer: back 2 slots later, the guard's MinS 1. slot 0: {0,2}; slot 1: 2 is away, wait;
    # slot 2: the guard refuses 0 (0 rounds between), wait; slot 3: {1,3}; slot 4: 1 is away, wait;
    # slot 5: {0,4} (device 0: round 0 then round 2, 1 round between); slot 6 is after the launch
    run = replay(_section(path, 2.0), _devices(path), 5, 2, 0, 0.25)
    assert (run.rounds, run.slots, run.enforced_min_separation) == (3, [0, 3, 5], 1)
    assert (run.min_separation, run.max_participation) == (1, 2)
    assert realised_participation([[0, 2], [1, 3], [0, 4]]) == (1, 2)
    assert realised_participation([[0], [1], [2]]) == (None, 1)  # nobody twice: no MinS



def test_a_replay_stops_scanning_the_trace_at_the_launchs_end(tmp_path, monkeypatch):
    """A round that cannot fill before the launch ends fails at the end, not after scanning up to
    30 simulated days of the trace (for a 10^5-device trace, minutes per candidate)."""
    from dpfleet.edge.devices import SlottedDevices
    path = write_five(tmp_path / "five.jsonl")
    scanned = []
    check_in = SlottedDevices.check_in
    monkeypatch.setattr(SlottedDevices, "check_in", lambda self, slot: scanned.append(slot)
                        or check_in(self, slot))
    # report goal 3: never more than two devices at a slot, so no round fills in the 6 slots
    run = replay(_section(path, 1.0), _devices(path), 5, 3, 0, 0.25)
    assert (run.rounds, scanned) == (0, [0, 1, 2, 3, 4, 5])

def _row(m, timer, rounds, nsr):
    return Candidate(m, timer, rounds, rounds / 2, rounds / 48, 0, 1, 1, None, 1,
                     None if nsr is None else "tree", None if nsr is None else 1.0,
                     None if nsr is None else 1.0, nsr, None, None, None)


def test_the_choice_is_the_least_noise_to_signal_with_its_tie_breaks():
    rows = [_row(50, 1.0, 0, None),       # filled no round: never chosen, whatever its M
            _row(20, 6.0, 5, 0.10),       # the least noise-to-signal, but only 5 rounds
            _row(10, 1.0, 30, 0.25),
            _row(12, 1.0, 40, 0.25),      # tied at 0.25: more rounds wins
            _row(8, 6.0, 40, 0.25),       # tied again with 40 rounds: the smaller report goal
            _row(8, 1.0, 40, 0.25)]       # and at the same report goal, the shorter timer
    assert choose(rows) is rows[1]
    assert choose(rows, min_rounds=6) is rows[5]
    assert choose(rows[:5], min_rounds=6) is rows[4]
    assert choose(rows[:4], min_rounds=6) is rows[3]
    with pytest.raises(DpfleetError, match="no candidate fills 41 round"):
        choose(rows, min_rounds=41)


R60 = ["--round-minutes", "60"]


@pytest.mark.parametrize("args, message", [
    (["--trace", "{missing}", "--days", "1", *R60], "no such trace file"),
    (["--trace", "{five}", "--days", "0", *R60], "--days must be a positive number of days"),
    (["--trace", "{five}", "--days", "-1", *R60], "--days must be a positive number of days"),
    # at most 2 of the 5 devices are ever available at once: a report goal of 3 fills no round
    (["--trace", "{five}", "--days", "1", "-M", "3", "-N", "5", *R60], "no candidate fills 1 round"),
    (["--trace", "{five}", "--days", "1", "-T", "10", *R60], "--rounds is not planned over a trace"),
    (["--days", "1", "-N", "5", "-T", "10"], "--days plans over a trace: give --trace"),
    (["--trace", "{five}"], "--trace needs --days and --round-minutes"),
    (["--trace", "{five}", "--days", "1", "--emit-config", "{five}", *R60], "exists: give a new file"),
    (["--trace", "{five}", "--days", "1", "--emit-projection", "{five}", *R60],
     "--emit-projection"),
    (["--generate", "20", "--days", "1", *R60], "--generate writes its trace into --out"),
])
def test_plan_over_a_trace_errors_are_one_line(tmp_path, capsys, args, message):
    five = write_five(tmp_path / "five.jsonl")
    before = five.read_bytes()
    args = [a.format(missing=tmp_path / "nope.jsonl", five=five) for a in args]
    out = [] if "--generate" in args else ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exc:
        main(["plan", *args, "--target-epsilon", "8", "--delta", "1e-6", "--mechanism", "tree", *out])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code != 0 and err[-1].startswith("error: ") and message in err[-1], err
    assert "Traceback" not in "\n".join(err)
    assert not (tmp_path / "out").exists() and five.read_bytes() == before


TINY = {
    "eval_every": 1000, "checkpoint_every": 0,
    "data": {"dataset": "shakespeare", "max_clients": 60, "eval_examples": 100, "max_examples": 8},
    "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024},
    "model": {"arch": "cifg", "embedding_dim": 16, "hidden_dim": 32, "projection_dim": 16},
    "client": {"lr": 1.0, "batch_size": 8, "threads": 1},
    "dp": {"clip_norm": 0.5},
}


@pytest.mark.slow
def test_a_trace_plan_is_what_simulate_replays(tmp_path):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, generate(300, days=2, seed=3))
    emitted = tmp_path / "plan.toml"
    main_args = ["plan", "--trace", str(trace), "--days", "2", "--round-minutes", "120", "-N", "60",
                 "--target-epsilon", "8", "--delta", "1e-6", "--mechanism", "tree", "--seed", "7",
                 "-M", "3", "--timer-hours", "2", "--timer-hours", "6", "--out", str(tmp_path / "plan"),
                 "--emit-config", str(emitted)]
    main(main_args)
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    chosen = plan["chosen"]
    assert chosen["rounds"] >= 3 and (tmp_path / "plan" / "plan.png").stat().st_size > 0
    fragment = tomllib.loads(emitted.read_text())
    assert fragment["dp"]["report_goal"] == 3 and fragment["devices"]["trace"] == str(trace)
    cfg = parse_config({**TINY, **{k: v for k, v in fragment.items() if k != "dp"},
                        "dp": {**TINY["dp"], **fragment["dp"]}})
    result = run_simulation(cfg, tmp_path / "run", progress=False, log=lambda s: None)
    privacy = json.loads((result.run_dir / "privacy.json").read_text())
    assert result.stopped_early is None and privacy["population"] == 60
    lines = (result.run_dir / "participation.jsonl").read_text().splitlines()
    log = [json.loads(x)["devices"] for x in lines]
    # the same rounds at the same slots (2 h each), so the same realised MinS / MaxP
    assert len(log) == chosen["rounds"] == len(result.metrics)
    assert [m["clock_hours"] for m in result.metrics] == [s * 2.0 for s in chosen["slots"]]
    assert realised_participation(log) == (chosen["realised_min_separation"],
                                           chosen["realised_max_participation"])
    assert privacy["epsilon"] <= chosen["epsilon"] * (1 + 1e-9)
    assert privacy["epsilon"] == pytest.approx(chosen["realised_epsilon"], rel=1e-6)


def test_the_run_configs_participation_flows_through_the_replay_into_the_emitted_config(tmp_path):
    path = write_five(tmp_path / "five.jsonl")
    # the run config states MinS 2 (the 1 h timer alone gives 0), so the guard refuses a device
    # for 2 rounds after it took part. By hand: slot 0 {0,2} -> round 0; slot 1 {1,2}: 2 refused,
    # wait; slot 2 {0,3}: 0 refused, wait; slot 3 {1,3} -> round 1; slot 4 {1,4}: 1 refused; slot
    # 5 {0,4}: 0 refused (rounds 0 and 2 have 1 between): 2 rounds, nobody twice
    base = ParticipationSection(min_separation=2)
    plan = plan_over_trace(path, 0.25, 60.0, 1.0, delta=1e-3, seed=0, report_goals=[2],
                           timer_hours=[1.0], mechanism="tree", section=base, progress=False)
    c = plan.chosen
    assert (c.rounds, c.slots, c.min_separation, c.realised_min_separation) == (2, (0, 3), 2, None)
    assert (c.cap, c.realised_max_participation, c.filled) == (1, 1, pytest.approx(2 / 6))
    fragment = plan.to_dict()["config"]
    assert fragment["participation"]["min_separation"] == 2
    assert fragment["participation"]["max_participation"] == 1
    assert fragment["rounds"] == 2 and fragment["dp"]["report_goal"] == 2


def test_plan_over_a_generated_trace_writes_it_beside_the_plan(tmp_path, capsys):
    out = tmp_path / "out"
    main(["plan", "--generate", "60", "--trace-seed", "2", "--days", "1", "--round-minutes", "60",
          "--target-zcdp", "1", "-M", "2", "--timer-hours", "1", "--mechanism", "tree", "--out", str(out)])
    plan = json.loads((out / "plan.json").read_text())
    assert plan["trace"] == str((out / "trace.jsonl.gz").absolute()) and plan["population"] == 60
    assert plan["chosen"]["rounds"] >= 1 and plan["config"]["devices"]["trace"] == plan["trace"]
    assert "plan: report goal 2, timer 1 h" in capsys.readouterr().out
    # a second plan into the same folder would replay another trace under the first one's name
    with pytest.raises(SystemExit):
        main(["plan", "--generate", "60", "--days", "1", "--round-minutes", "60", "--target-zcdp", "1",
              "--out", str(out)])
    assert "already holds trace.jsonl.gz" in capsys.readouterr().err


def test_the_projection_fragment_rehearses_the_plans_launch_at_its_eps(tmp_path):
    """--emit-projection: a run that adds the planned cohort's noise over the planned population
    accounts the plan's enforced MinS and MaxP cap, so its projected eps is the plan's eps; the run
    keeps its own report goal and participation (no [participation] in the fragment)."""
    from dpfleet.coordinator.mechanisms.matrix import as_mechanism
    from dpfleet.coordinator.run_privacy.projection import projected_privacy

    path = write_five(tmp_path / "five.jsonl")
    plan = plan_over_trace(path, 0.25, 60.0, 1.0, delta=1e-3, seed=0, report_goals=[2],
                           timer_hours=[2.0], mechanism="tree", progress=False)
    fragment = plan.to_dict()["projection_config"]
    # the 2 h timer's replay by hand (test above): 3 rounds, MinS 1, MaxP 2
    assert fragment["projection"] == {"noise_cohort": 2, "population": 5, "min_separation": 1,
                                      "max_participation": 2}
    assert "participation" not in fragment and fragment["rounds"] == 3
    cfg = parse_config({**TINY, "rounds": fragment["rounds"], "projection": fragment["projection"],
                        "dp": {**TINY["dp"], **fragment["dp"], "report_goal": 1}})
    projected = projected_privacy(cfg, as_mechanism(None), "pld")
    assert projected["epsilon"] == pytest.approx(plan.chosen.epsilon, rel=1e-9)
    emitted = tmp_path / "rehearse.toml"
    main(["plan", "--trace", str(path), "--days", "0.25", "--round-minutes", "60", "-M", "2",
          "--timer-hours", "2", "--target-zcdp", "1", "--delta", "1e-3", "--mechanism", "tree",
          "--emit-projection", str(emitted)])
    assert tomllib.loads(emitted.read_text()) == fragment
