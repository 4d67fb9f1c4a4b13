"""Experiment trackers: a run's per-round metrics records go to TensorBoard, W&B and MLflow as the
run goes (config keys `tensorboard`, `wandb`, `mlflow`; each an optional extra).

Why one concept with three writers: every tracker is fed the same (tag, value) stream, `tagged()`
of each round's logs, which is the metrics record (DP quantities and the held-out evaluation, what
metrics.jsonl already releases) and, only when the run asked for it (`debug_nonprivate = true`),
the un-noised telemetry under its own tag group `debug_nonprivate_NOT_DP/`. So no tracker shows
anything the run directory does not, and a new tracker is a class with `round` and `close`.

Each tracker mirrors the records, like TensorBoard's folder: an engine that opens a run (fresh,
resumed, a restarted service) writes the rounds so far again, and no step is there twice:

* W&B: offline unless WANDB_MODE says otherwise (nothing leaves the machine by default; `wandb
  sync RUN_DIR/wandb/offline-run-*` uploads later). The run keeps one W&B id (RUN_DIR/wandb/
  dpfleet_run_id); an opening removes the offline folders of that id it wrote before and writes
  the whole backlog into a new one. Online, it resumes the W&B run and logs only the rounds W&B
  has not seen (W&B's steps only go forward). WANDB_PROJECT names the project (default dpfleet).
* MLflow: MLflow's own tracking URI (MLFLOW_TRACKING_URI, else MLflow's default sqlite:///mlflow.db
  in the working folder), experiment MLFLOW_EXPERIMENT_NAME (default dpfleet). The MLflow run is
  tagged with the run directory; an opening deletes the earlier MLflow runs of that directory
  and logs the backlog into a new one, the resolved config as its parameters.

Both get the resolved config (to compare runs by) without research mode's `dp.noise_seed`: a
tracker is often shared, and the seed rebuilds the noise.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dpfleet.coordinator.config import TRACKER_PACKAGES
from dpfleet.coordinator.state.tensorboard_log import (
    TENSORBOARD,
    TensorBoardLog,
    run_backlog,
    tagged,
)
from dpfleet.errors import DpfleetError
from dpfleet.io import atomic_write

Logs = Mapping[str, Mapping]  # a round's {"metrics": record, "debug_nonprivate": record}


# how a run ended, in MLflow's words: a finished run, an exception, Ctrl-C / SIGTERM
ENDINGS = ("FINISHED", "FAILED", "KILLED")


class Tracker(Protocol):
    """Where a run's metrics go: every round's logs as it commits, then closed at the run's end
    with how it ended (`ENDINGS`)."""

    def round(self, logs: Logs) -> None: ...

    def close(self, status: str = "FINISHED") -> None: ...


def _step(logs: Logs) -> int:
    return int(logs["metrics"]["round"])


class WandbLog:
    """One run's W&B run (offline in RUN_DIR/wandb/ unless WANDB_MODE says otherwise)."""

    ID_FILE = "dpfleet_run_id"
    MODES = ("offline", "online", "disabled", "shared")
    # the W&B run each run directory has open in this process: one an engine left open (an
    # exception out of a round, Ctrl-C in a notebook) is finished before the next opening
    _open: dict[Path, WandbLog] = {}

    def __init__(self, run_path: Path, backlog: Sequence[Logs], config: Mapping):
        import wandb

        folder = Path(run_path) / "wandb"
        self.key = folder.resolve()
        stale = self._open.pop(self.key, None)
        if stale is not None:
            stale.close()
        id_file = folder / self.ID_FILE
        earlier = id_file.read_text().strip() if id_file.is_file() else ""
        mode = os.environ.get("WANDB_MODE") or "offline"
        if mode not in self.MODES:
            raise DpfleetError(f"wandb = true: WANDB_MODE={mode} is none of W&B's modes "
                               f"({', '.join(self.MODES)})")
        if earlier and mode == "offline":  # this run's earlier openings' folders: written anew below
            for old in folder.glob(f"offline-run-*-{earlier}"):
                shutil.rmtree(old)
        run_id = earlier if earlier and backlog else secrets.token_hex(6)  # a new run: a new W&B id
        folder.mkdir(mode=0o700, exist_ok=True)  # like the run directory: its reader's business
        folder.chmod(0o700)
        atomic_write(id_file, run_id + "\n")
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or "dpfleet", dir=str(run_path), mode=mode,
                id=run_id, name=Path(run_path).name, config=dict(config),
                resume="allow" if mode == "online" else None, reinit="create_new",  # never a user's run
                settings=wandb.Settings(silent=True, console="off", save_code=False,
                                        x_disable_stats=True, x_disable_meta=True))
        except Exception as exc:  # no API key online, a bad WANDB_MODE, ...: one line
            why = " ".join(str(exc).split())[:300]  # one line
            raise DpfleetError(f"wandb = true: W&B did not start ({type(exc).__name__}: {why}); "
                               "WANDB_MODE=offline logs to RUN_DIR/wandb/ without an account") from exc
        self._open[self.key] = self
        seen = self.run.step if mode == "online" and self.run.resumed else 0  # W&B has rounds < seen
        for logs in backlog:
            if _step(logs) >= seen:
                self.round(logs)

    def round(self, logs: Logs) -> None:
        self.run.log(dict(tagged(logs)), step=_step(logs))

    def close(self, status: str = "FINISHED") -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)  # W&B shows a failed run
        if self._open.get(self.key) is self:
            del self._open[self.key]


class MlflowLog:
    """One run's MLflow run, in the tracking store MLflow is configured with."""

    TAG = "dpfleet.run"  # a digest of the run directory's path: its MLflow runs, whatever the quoting

    def __init__(self, run_path: Path, backlog: Sequence[Logs], config: Mapping):
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        where = str(Path(run_path).resolve())
        digest = hashlib.sha256(where.encode()).hexdigest()[:32]
        try:
            self.client = MlflowClient()
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "dpfleet"
            experiment = self.client.get_experiment_by_name(name)
            eid = experiment.experiment_id if experiment else self.client.create_experiment(name)
            for old in self.client.search_runs([eid], f"tags.`{self.TAG}` = '{digest}'"):
                self.client.delete_run(old.info.run_id)  # an earlier opening's: logged anew below
            self.run_id = self.client.create_run(
                eid, run_name=Path(run_path).name,
                tags={self.TAG: digest, "dpfleet.run_dir": where}).info.run_id
        except MlflowException as exc:  # an unreachable server, a store MLflow cannot open: one line
            first = str(exc.message).splitlines()[0]
            raise DpfleetError(f"mlflow = true: MLflow did not start ({first})") from exc
        params = [Param(k, str(v)[:6000]) for k, v in _flat(config)]
        for i in range(0, len(params), 100):  # MLflow takes 100 parameters per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        for logs in backlog:
            self.round(logs)

    def round(self, logs: Logs) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(tag, value, now, _step(logs))
                                                    for tag, value in tagged(logs)])

    def close(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status)


# config keys a tracker never gets: research mode's noise seed rebuilds the noise (anyone who
# reads it in a shared tracker could subtract it); the privacy report says research mode anyway
UNPUBLISHED = {"dp": ("noise_seed",)}


def published_config(resolved: Mapping) -> dict:
    """The resolved config as the trackers log it (W&B's config, MLflow's parameters)."""
    return {k: ({kk: vv for kk, vv in v.items() if kk not in UNPUBLISHED.get(k, ())}
                if isinstance(v, Mapping) else v) for k, v in resolved.items()}


def _flat(config: Mapping, prefix: str = "") -> Iterable[tuple[str, object]]:
    for key, value in config.items():
        if isinstance(value, Mapping):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@dataclass(frozen=True)
class Writer:
    """A tracker as a config key: the module it needs, its extra, how a run opens it."""

    module: str
    extra: str
    open: Callable[[Path, Sequence[Logs], Mapping], Tracker]


WRITERS = {  # module and extra: the config's (`TRACKER_PACKAGES`, which validation checks)
    "tensorboard": Writer(*TRACKER_PACKAGES["tensorboard"],
                          lambda path, backlog, _config: TensorBoardLog(path / TENSORBOARD, backlog,
                                                                        in_run=True)),
    "wandb": Writer(*TRACKER_PACKAGES["wandb"], WandbLog),
    "mlflow": Writer(*TRACKER_PACKAGES["mlflow"], MlflowLog),
}


def chosen(cfg: object) -> list[str]:
    """The trackers a config switches on (its keys `tensorboard`, `wandb`, `mlflow`)."""
    return [key for key in WRITERS if getattr(cfg, key, False)]


class Trackers:
    """The run's trackers as one: each round's logs to all of them, closed together."""

    def __init__(self, trackers: Sequence[Tracker] = ()):
        self.trackers = list(trackers)

    def round(self, logs: Logs) -> None:
        """A committed round's logs, handed to every tracker."""
        for tracker in self.trackers:
            tracker.round(logs)

    def close(self, status: str = "FINISHED") -> None:
        """Each tracker closed once, told how the run ended. A run that failed or was stopped
        (`status` FAILED / KILLED) is marked so, not left RUNNING in MLflow; a tracker that
        cannot be told then (its server gone) never hides the run's own error."""
        if status not in ENDINGS:
            raise ValueError(f"a run ends as one of {ENDINGS}, not {status!r}")
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            if status == "FINISHED":
                tracker.close(status)
            else:
                with contextlib.suppress(Exception):
                    tracker.close(status)


def open_trackers(cfg: object, run_path: Path, metrics: Sequence[Mapping]) -> Trackers:
    """The trackers `cfg` asks for, each holding the rounds so far (`metrics`, with the run
    directory's debug_nonprivate lines) when this returns."""
    keys = chosen(cfg)
    if not keys:
        return Trackers()
    backlog = run_backlog(run_path, metrics)
    config = published_config(cfg.resolved() if hasattr(cfg, "resolved") else {})
    return Trackers([WRITERS[key].open(Path(run_path), backlog, config) for key in keys])
