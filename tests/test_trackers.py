"""`wandb = true` / `mlflow = true` (coordinator/state/trackers.py): each round's metrics record
logged to W&B and MLflow, read back here from what they stored locally (W&B's offline run file,
MLflow's sqlite store in a temporary folder) and compared with metrics.jsonl; un-noised telemetry
only when the run asked for it, under its own tag group; a resumed run has each step once. Nothing
goes to a network: W&B runs offline, MLflow's tracking URI is a file here."""

import copy
import json
import struct
from pathlib import Path

import pytest
from crashes import Crash, failing_on_round
from hypothesis import given, settings
from hypothesis import strategies as st
from test_api import CONFIG, USERS, TinyLM, WordIds

import dpfleet
from dpfleet.cli import main
from dpfleet.coordinator import config as config_module
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.run import run
from dpfleet.coordinator.state.resume import differing_keys
from dpfleet.coordinator.state.tensorboard_log import DEBUG_GROUP, STARTING_TAGS, scalars, tagged
from dpfleet.errors import DpfleetError

TRACKED = {**CONFIG, "rounds": 3, "eval_every": 2, "wandb": True, "mlflow": True}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One MLflow file store for the module: the same client calls as MLflow's default sqlite
    store (which the slow test uses), without its ~12 s of table creation."""
    return tmp_path_factory.mktemp("mlflow").as_uri()


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path, store, request):
    """W&B offline with its settings and cache under tmp_path; MLflow in the module's store, an
    experiment per test."""
    for var in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_API_KEY", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps it, in maintenance mode
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", request.node.name[:200])


KEYS = st.sampled_from(["round", "epsilon", "accuracy", "clip", "train_loss", "clipped_fraction",
                         "aggregation", "bits", "new_key"])
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.text(max_size=3),
                   st.floats(allow_nan=True, allow_infinity=True))
RECORDS = st.recursive(st.dictionaries(KEYS, VALUES, max_size=6),
                       lambda inner: st.dictionaries(KEYS, st.one_of(VALUES, inner), max_size=4),
                       max_leaves=12)


@settings(max_examples=80, deadline=None)
@given(metrics=RECORDS, debug=st.one_of(st.none(), RECORDS))
def test_what_a_tracker_gets_is_the_record_and_telemetry_only_under_its_group(metrics, debug):
    """Whatever a round's records hold: the DP tags are exactly the metrics record's numbers, and
    every un-noised number is under debug_nonprivate_NOT_DP/, never beside the DP ones."""
    logs = {"metrics": {**metrics, "round": 1}, **({"debug_nonprivate": debug} if debug is not None else {})}
    got = list(tagged(logs))
    dp = [(t, v) for t, v in got if not t.startswith(DEBUG_GROUP + "/")]
    assert dp == list(scalars(logs["metrics"]))
    telemetry = got[len(dp):]
    assert telemetry == (list(scalars(debug, DEBUG_GROUP)) if debug else [])
    assert all(isinstance(v, float) and v == v and abs(v) != float("inf") for _, v in got)


def wandb_records(path: Path) -> list:
    """The `Record` protos of one offline W&B run file: W&B's LevelDB-log framing, a 7-byte file
    header, then records of crc u32, length u16, type u8 in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, i, chunk, out = path.read_bytes(), 7, b"", []
    while i + 7 <= len(data):
        if 32768 - i % 32768 < 7:  # a block's tail too short for a header: padding
            i += 32768 - i % 32768
            continue
        length, kind = struct.unpack("<HB", data[i + 4:i + 7])
        if kind == 0 and length == 0:
            break
        chunk += data[i + 7:i + 7 + length]
        i += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            out.append(pb.Record.FromString(chunk))
            chunk = b""
    return out


def wandb_runs(run_dir: Path) -> list[list]:
    return [wandb_records(p) for p in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))]


def wandb_history(run_dir: Path) -> list[dict[int, dict[str, float]]]:
    """Each offline W&B run in RUN_DIR/wandb/: {step: {tag: value}}."""
    runs = []
    for records in wandb_runs(run_dir):
        steps = {}
        for record in records:
            if record.WhichOneof("record_type") == "history":
                items = {"/".join(it.nested_key) or it.key: json.loads(it.value_json)
                         for it in record.history.item}
                steps[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
        runs.append(steps)
    return runs


def mlflow_history(run_dir: Path) -> list[dict[int, dict[str, float]]]:
    """Each active MLflow run of this run directory: {step: {tag: value}}, every logged value
    (a step logged twice under a tag would be a list of two)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    where = str(run_dir.resolve())
    found = client.search_runs([e.experiment_id for e in client.search_experiments()],
                               f"tags.`dpfleet.run_dir` = '{where}'")
    out = []
    for found_run in found:
        steps: dict[int, dict] = {}
        for tag in found_run.data.metrics:
            for m in client.get_metric_history(found_run.info.run_id, tag):
                assert tag not in steps.setdefault(m.step, {}), f"step {m.step} of {tag} twice"
                steps[m.step][tag] = m.value
        out.append(steps)
    return out


def expected(run_dir: Path, debug: bool = False) -> dict[int, dict[str, float]]:
    """What metrics.jsonl (and debug_nonprivate.jsonl) say each step must hold; step 0 is the
    starting model's evaluation (initial_eval.json)."""
    initial = json.loads((run_dir / "initial_eval.json").read_text())
    out = {0: dict(scalars({k: initial[k] for k in STARTING_TAGS}))}
    out.update({m["round"]: dict(scalars(m)) for m in lines(run_dir / "metrics.jsonl")})
    summary = run_dir / "summary.json"
    keyboard = json.loads(summary.read_text()).get("keyboard") if summary.is_file() else None
    if keyboard:  # a finished run's suggestion strip, logged live at the last round's step
        strips = {k: v for k, v in keyboard.items() if isinstance(v, dict)}
        out[max(out)].update(scalars({"keyboard": strips}))
    if debug:
        for d in lines(run_dir / "debug_nonprivate.jsonl"):
            out[d["round"]].update(scalars(d, DEBUG_GROUP))
    return out


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def tiny_config(folder: Path) -> Path:
    """The packaged tiny example (`dpfleet init --example tiny`) in `folder`."""
    config = folder / "tiny.toml"
    config.write_text((Path(dpfleet.__file__).parent / "configs" / "tiny.toml").read_text())
    return config


def simulate(tmp_path, name, config=TRACKED):
    return dpfleet.simulate(copy.deepcopy(config), model=TinyLM(), users=USERS, tokenizer=WordIds(),
                            progress=False, run_dir=tmp_path / name).run_dir


def test_a_run_logs_each_rounds_metrics_to_wandb_and_mlflow_and_no_telemetry(tmp_path):
    path = simulate(tmp_path, "run")
    want = expected(path)
    assert sorted(want) == [0, 1, 2, 3] and "eval/accuracy" in want[2] and "eval/accuracy" not in want[1]
    assert "privacy/epsilon" in want[3] and "dp/noise_std" in want[3]
    [wandb_run] = wandb_history(path)
    [mlflow_run] = mlflow_history(path)
    assert wandb_run == want  # every number of metrics.jsonl, exactly, and nothing else
    assert mlflow_run == want
    assert not any(t.startswith(DEBUG_GROUP) for step in wandb_run.values() for t in step)
    assert (path / "wandb").stat().st_mode & 0o777 == 0o700  # W&B's files: the run's reader's only


def test_telemetry_goes_only_under_its_own_group_and_only_when_asked(tmp_path):
    path = simulate(tmp_path, "debug", {**TRACKED, "debug_nonprivate": True})
    want = expected(path, debug=True)
    assert any(t == f"{DEBUG_GROUP}/train_loss" for t in want[1])
    assert wandb_history(path) == [want]
    assert mlflow_history(path) == [want]


def test_a_resumed_run_has_each_step_once(tmp_path, monkeypatch):
    """Crashed in round 3 after a resume point at round 2: the reopened engine logs the run anew
    (W&B: one offline run left; MLflow: the earlier run deleted), each round once."""
    out = tmp_path / "run"

    def once(**options):
        cfg = parse_config({**copy.deepcopy(TRACKED), "rounds": 4, "checkpoint_every": 2})
        run(cfg, out, model=TinyLM(), users=USERS, tokenizer=WordIds(), progress=False,
            log=lambda s: None, **options)

    failing_on_round(monkeypatch, 3)
    with pytest.raises(Crash):
        once()
    assert [sorted(h) for h in mlflow_history(out)] == [[0, 1, 2]]
    once(resume=True)
    want = expected(out)
    assert sorted(want) == [0, 1, 2, 3, 4]
    assert wandb_history(out) == [want] and mlflow_history(out) == [want]


def run_statuses(run_dir: Path) -> tuple[list[str], list[int]]:
    """(each MLflow run's status, each W&B run's exit code) of this run directory."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    found = client.search_runs([e.experiment_id for e in client.search_experiments()],
                               f"tags.`dpfleet.run_dir` = '{run_dir.resolve()}'")
    exits = [r.exit.exit_code for records in wandb_runs(run_dir) for r in records
             if r.WhichOneof("record_type") == "exit"]
    return [r.info.status for r in found], exits


@pytest.mark.parametrize(("exc", "status"), [(Crash, "FAILED"), (KeyboardInterrupt, "KILLED")])
def test_a_run_that_fails_or_is_stopped_is_marked_so_not_left_running(tmp_path, monkeypatch, exc, status):
    """An exception out of round 2, or Ctrl-C there: MLflow's run says FAILED / KILLED (it said
    RUNNING forever) and W&B's exits non-zero; the rounds before it are logged, and a finished
    run still says FINISHED, exit 0."""
    out = tmp_path / "run"
    failing_on_round(monkeypatch, 2, exc)
    with pytest.raises(exc):
        run(parse_config(copy.deepcopy(TRACKED)), out, model=TinyLM(), users=USERS,
            tokenizer=WordIds(), progress=False, log=lambda s: None)
    assert run_statuses(out) == ([status], [1])
    assert [sorted(h) for h in mlflow_history(out)] == [[0, 1]]
    assert run_statuses(simulate(tmp_path, "finished")) == (["FINISHED"], [0])


def test_the_cli_turns_them_on_with_set(tmp_path, capsys):
    """`dpfleet simulate CONFIG --set wandb=true --set mlflow=true` for one run."""
    out = tmp_path / "cli"
    main(["simulate", str(tiny_config(tmp_path)), "--out", str(out), "--quiet", "--rounds", "2",
          "--set", "wandb=true", "--set", "mlflow=true"])
    want = expected(out)
    assert sorted(want) == [0, 1, 2]
    assert wandb_history(out) == [want] and mlflow_history(out) == [want]
    assert json.loads((out / "config.json").read_text())["wandb"] is True


@pytest.mark.parametrize("key, module", [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_without_the_extra_the_config_is_refused_in_one_line(monkeypatch, capsys, tmp_path, key, module):
    real = config_module.importlib.util.find_spec  # the config checks the package (`missing_extras`)
    monkeypatch.setattr(config_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == module else real(name, *a))
    with pytest.raises(DpfleetError, match=rf"^{key} = true needs {module}: "
                                           rf"pip install 'dpfleet\[{key}\]'$"):
        parse_config({**CONFIG, key: True})
    parse_config(copy.deepcopy(CONFIG))  # only a run that asks for it needs it
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", str(tiny_config(tmp_path)), "--out", str(tmp_path / "no"), "--set", f"{key}=true"])
    assert exit_.value.code == 2 and not (tmp_path / "no").exists()
    assert capsys.readouterr().err == f"error: {key} = true needs {module}: pip install 'dpfleet[{key}]'\n"


def test_switching_a_tracker_is_no_other_config_for_a_resume_or_a_restart():
    cfg = parse_config(copy.deepcopy(TRACKED)).resolved()
    saved = {k: v for k, v in cfg.items() if k not in ("wandb", "mlflow")}
    assert differing_keys(saved, cfg) == []
    assert differing_keys({**cfg, "wandb": False, "mlflow": False}, cfg) == []
    assert differing_keys({**cfg, "seed": 99}, cfg) == ["seed"]


@pytest.mark.slow  # a coordinator and its devices over loopback, MLflow's sqlite store: ~35 s
def test_a_served_run_logs_its_metrics_to_both(tmp_path, monkeypatch):
    """`service serve` with wandb and mlflow on: what they hold is STATE/metrics.jsonl; MLflow
    in its default kind of store, an SQLite database (the mlflow extra's SQLAlchemy)."""
    import asyncio

    from service_fleet import device_keys, fleet_data, serve_to_end, tiny_cfg

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    cfg = tiny_cfg(rounds=2, wandb=True, mlflow=True, data={"keyboard_words": 30})  # the strip too
    users, examples = fleet_data(cfg, tmp_path / "fleet")
    state = tmp_path / "state"
    status = asyncio.run(serve_to_end(cfg, state, device_keys(users), examples, devices_s=30))
    assert status["run_state"] == "finished"
    want = expected(state)
    assert sorted(want) == [0, 1, 2]
    assert wandb_history(state) == [want] and mlflow_history(state) == [want]


def test_a_bad_wandb_mode_is_one_line_and_leaves_no_run_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "bogus")
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", str(tiny_config(tmp_path)), "--out", str(out), "--quiet", "--rounds", "1",
              "--set", "wandb=true"])
    assert exit_.value.code == 2 and not out.exists()
    assert capsys.readouterr().err == ("error: wandb = true: WANDB_MODE=bogus is none of W&B's modes "
                                       "(offline, online, disabled, shared)\n")


def test_research_modes_noise_seed_is_never_logged(tmp_path):
    """dp.noise_seed rebuilds the noise: the config the trackers log leaves it out (the rest of
    the config is there, to compare runs by)."""
    from mlflow.tracking import MlflowClient

    path = simulate(tmp_path, "seeded", {**TRACKED, "rounds": 1, "dp": {**TRACKED["dp"], "noise_seed": 4242}})
    assert json.loads((path / "config.json").read_text())["dp"]["noise_seed"] == 4242
    [records] = wandb_runs(path)
    logged = {it.key: json.loads(it.value_json) for r in records if r.WhichOneof("record_type") == "run"
              for it in r.run.config.update}
    assert logged["dp"]["noise_multiplier"] == 0.5 and logged["seed"] == 1
    assert "noise_seed" not in logged["dp"] and "4242" not in json.dumps(logged)
    [found] = MlflowClient().search_runs(
        [e.experiment_id for e in MlflowClient().search_experiments()],
        f"tags.`dpfleet.run_dir` = '{path.resolve()}'")
    params = found.data.params
    assert params["dp.noise_multiplier"] == "0.5" and params["seed"] == "1"
    assert not any("noise_seed" in k for k in params) and "4242" not in params.values()


def test_an_ending_that_is_none_of_the_trackers_words_is_refused():
    from dpfleet.coordinator.state.trackers import Trackers

    with pytest.raises(ValueError, match="FINISHED"):
        Trackers().close("DONE")
