"""`tensorboard = true` (coordinator/state/tensorboard_log.py): each round's metrics record as
TensorBoard scalars in RUN_DIR/tensorboard/, read back here from the event file's own format
(TFRecord frames of `Event` protos) and compared with metrics.jsonl; un-noised telemetry only when
the run asked for it, under its own tag group; a resumed run's folder is the whole record once."""

import copy
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from crashes import Crash, failing_on_round
from tensorboardX.proto import event_pb2  # the tensorboard extra, in the test extra: CI runs this
from test_api import CONFIG, USERS, TinyLM, WordIds

import dpfleet
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.run import run
from dpfleet.coordinator.state import tensorboard_log
from dpfleet.coordinator.state.resume import differing_keys
from dpfleet.coordinator.state.run_dir import INITIAL_EVAL
from dpfleet.coordinator.state.tensorboard_log import DEBUG_GROUP, TENSORBOARD, export, scalars
from dpfleet.errors import DpfleetError

TB = {**CONFIG, "rounds": 3, "eval_every": 2, "tensorboard": True}


def read_events(folder: Path) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in `folder`'s event files: TFRecord frames (length u64,
    its crc u32, the Event proto, its crc u32)."""
    out = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (length,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + length])
            out += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
            i += 12 + length + 4
    return out


def rounds_of(run_path: Path, folder: Path | None = None) -> list[tuple[int, str, float]]:
    """The events of a run's TensorBoard folder (or of `folder`, an export) after step 0, which
    is checked here to be the starting model's evaluation (initial_eval.json), nothing else."""
    events = read_events(folder or run_path / TENSORBOARD)
    initial = json.loads((run_path / INITIAL_EVAL).read_text())
    assert [(t, v) for s, t, v in events if s == 0] == [
        (f"eval/{k}", np.float32(initial[k])) for k in ("accuracy", "loss", "perplexity")]
    return [e for e in events if e[0] != 0]


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def simulate(tmp_path, name, config=TB):
    return dpfleet.simulate(copy.deepcopy(config), model=TinyLM(), users=USERS, tokenizer=WordIds(),
                            progress=False, run_dir=tmp_path / name)


def test_scalars_groups_a_record_and_leaves_out_what_is_no_number():
    record = {"round": 3, "clients": 5, "epsilon": 2.5, "accuracy": None, "restart": True,
              "clip": 0.5, "mechanism": "tree", "new_key": 7, "epsilon_inf": float("inf"),
              "aggregation": {"bits": 32, "graph": "harary", "dropped": 1}}
    assert dict(scalars(record)) == {
        "participation/clients": 5.0, "privacy/epsilon": 2.5, "dp/restart": 1.0, "dp/clip": 0.5,
        "round/new_key": 7.0, "aggregation/bits": 32.0, "aggregation/dropped": 1.0}
    assert dict(scalars({"round": 1, "train_loss": 2.0}, DEBUG_GROUP)) == {
        f"{DEBUG_GROUP}/train_loss": 2.0}


def test_a_run_writes_each_rounds_metrics_as_scalars_and_no_telemetry(tmp_path):
    path = simulate(tmp_path, "run").run_dir
    metrics = lines(path / "metrics.jsonl")
    events = rounds_of(path)
    expected = [(m["round"], tag, v) for m in metrics for tag, v in scalars(m)]
    assert [(s, t) for s, t, _ in events] == [(s, t) for s, t, _ in expected]
    assert np.array_equal([v for *_, v in events], np.float32([v for *_, v in expected]))
    got = {(s, t): v for s, t, v in events}
    for m in metrics:  # the figures people look for, under the tags they are documented with
        assert got[m["round"], "privacy/epsilon"] == np.float32(m["epsilon"])
        assert got[m["round"], "dp/noise_std"] == np.float32(m["noise_std"])
        assert got[m["round"], "participation/clients"] == m["clients"]
        assert ((m["round"], "eval/accuracy") in got) == (m["accuracy"] is not None)
    assert {s for s, *_ in events} == {1, 2, 3}
    assert got[2, "eval/accuracy"] == np.float32(metrics[1]["accuracy"])
    assert not any(t.startswith(DEBUG_GROUP) for _, t, _ in events)


def test_telemetry_only_when_asked_and_under_its_own_group(tmp_path):
    path = simulate(tmp_path, "debug", {**TB, "debug_nonprivate": True}).run_dir
    debug = lines(path / "debug_nonprivate.jsonl")
    events = rounds_of(path)
    telemetry = {(s, t): v for s, t, v in events if t.startswith(DEBUG_GROUP + "/")}
    assert telemetry == {(d["round"], f"{DEBUG_GROUP}/{k}"): np.float32(v)
                         for d in debug for k, v in d.items() if k != "round"}
    assert {t for _, t in telemetry} >= {f"{DEBUG_GROUP}/train_loss", f"{DEBUG_GROUP}/clipped_fraction"}
    # the DP tags hold only the metrics record: no telemetry under another name
    assert len(events) - len(telemetry) == sum(len(list(scalars(m))) for m in lines(path / "metrics.jsonl"))


def test_a_resumed_run_has_each_round_once(tmp_path, monkeypatch):
    """Crashed in round 3 after a resume point at round 2: the reopened engine writes the folder
    anew from the records, so no round is missing or twice (and one event file remains)."""
    cfg = {**TB, "rounds": 4, "checkpoint_every": 2}
    out = tmp_path / "run"
    failing_on_round(monkeypatch, 3)
    args = dict(model=TinyLM(), users=USERS, tokenizer=WordIds(), progress=False, log=lambda s: None)
    with pytest.raises(Crash):
        run(parse_config(copy.deepcopy(cfg)), out, **args)
    assert {s for s, *_ in rounds_of(out)} == {1, 2}
    run(parse_config(copy.deepcopy(cfg)), out, resume=True, **args)
    events = rounds_of(out)
    expected = [(m["round"], t) for m in lines(out / "metrics.jsonl") for t, _ in scalars(m)]
    assert [(s, t) for s, t, _ in events] == expected and {s for s, _ in expected} == {1, 2, 3, 4}
    events = list((out / TENSORBOARD).glob(tensorboard_log.EVENTS))  # one file, and dpfleet's marker
    assert len(events) == 1 and {p.name for p in (out / TENSORBOARD).iterdir()} == {
        events[0].name, tensorboard_log.MARKER}


def test_export_writes_a_finished_runs_metrics(tmp_path):
    path = simulate(tmp_path, "plain", {**TB, "tensorboard": False}).run_dir
    assert not (path / TENSORBOARD).exists()
    folder = export(path, tmp_path / "tb" / "plain")
    events = rounds_of(path, folder)
    metrics = lines(path / "metrics.jsonl")
    assert [(s, t) for s, t, _ in events] == [(m["round"], t) for m in metrics for t, _ in scalars(m)]
    assert np.array_equal([v for *_, v in events],
                          np.float32([v for m in metrics for _, v in scalars(m)]))


def test_without_the_extra_the_config_is_refused_in_one_line(monkeypatch):
    real = tensorboard_log.importlib.util.find_spec
    monkeypatch.setattr(tensorboard_log.importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboardX" else real(name, *a))
    with pytest.raises(DpfleetError, match=r"^tensorboard = true needs tensorboardX: "
                                           r"pip install 'dpfleet\[tensorboard\]'$"):
        parse_config(copy.deepcopy(TB))
    parse_config(copy.deepcopy(CONFIG))  # only a run that asks for it needs it


def test_switching_tensorboard_is_no_other_config_for_a_resume_or_a_restart():
    """How a run is watched is not what it computes: a run saved before the key existed, or a
    service restarted with it switched, is the same run."""
    cfg = parse_config(copy.deepcopy(TB)).resolved()
    saved = {k: v for k, v in cfg.items() if k != "tensorboard"}
    assert differing_keys(saved, cfg) == [] and differing_keys({**cfg, "tensorboard": False}, cfg) == []
    assert differing_keys({**cfg, "seed": 99}, cfg) == ["seed"]


def test_the_warning_threshold_is_no_other_config_for_a_resume_but_the_noise_is():
    """dp.warn_epsilon only says when the summary warns: a run saved before the key existed
    resumes; a changed dp key that the noise depends on still refuses it."""
    cfg = parse_config(copy.deepcopy(TB)).resolved()
    older = {**cfg, "dp": {k: v for k, v in cfg["dp"].items() if k != "warn_epsilon"}}
    assert differing_keys(older, cfg) == []
    assert differing_keys({**cfg, "dp": {**cfg["dp"], "warn_epsilon": 3.0}}, cfg) == []
    assert differing_keys({**cfg, "dp": {**cfg["dp"], "clip_norm": 9.0}}, cfg) == ["dp"]


@pytest.mark.slow  # a coordinator and its devices over loopback: ~15 s
def test_a_served_run_writes_its_scalars_to_the_state(tmp_path):
    """`service serve` with tensorboard = true: STATE/tensorboard/ is STATE/metrics.jsonl."""
    import asyncio

    from service_fleet import device_keys, fleet_data, serve_to_end, tiny_cfg

    cfg = tiny_cfg(rounds=2, tensorboard=True, data={"keyboard_words": 30})  # the strip too
    users, examples = fleet_data(cfg, tmp_path / "fleet")
    state = tmp_path / "state"
    status = asyncio.run(serve_to_end(cfg, state, device_keys(users), examples, devices_s=30))
    assert status["run_state"] == "finished"
    metrics = lines(state / "metrics.jsonl")
    events = rounds_of(state)
    strip = [e for e in events if e[1].startswith("keyboard/")]  # the finished run's strip, last step
    events = [e for e in events if not e[1].startswith("keyboard/")]
    keyboard = json.loads((state / "summary.json").read_text()).get("keyboard")
    assert {s for s, *_ in strip} == ({2} if keyboard else set())
    assert [(s, t) for s, t, _ in events] == [(m["round"], t) for m in metrics for t, _ in scalars(m)]
    assert np.array_equal([v for *_, v in events], np.float32([v for m in metrics for _, v in scalars(m)]))
    assert {s for s, *_ in events} == {1, 2}


def test_tffs_accuracies_are_eval_scalars():
    record = {"round": 2, "tff_accuracy": 0.25,
              "tff_accuracy_without_out_of_vocab_or_end_of_sentence": 0.5}
    assert dict(scalars(record)) == {
        "eval/tff_accuracy": 0.25, "eval/tff_accuracy_without_out_of_vocab_or_end_of_sentence": 0.5}
