"""TensorBoard scalars of a run: its per-round metrics records, as the run goes (`tensorboard = true`).

Why fed from the metrics record and nothing else: that record is what the run already releases
(DP quantities and the held-out evaluation, metrics.jsonl), so watching a run in TensorBoard shows
nothing the run directory does not. Un-noised client telemetry goes there only when the run asked
for it (`debug_nonprivate = true`), under its own tag group `debug_nonprivate_NOT_DP/`.

The folder is RUN_DIR/tensorboard/ (`tensorboard --logdir runs/` shows every run side by side).
It always mirrors the records: an engine that opens a run (fresh, resumed, a restarted service)
writes it anew from the records so far, then each round as it commits. `export` does the same for
a finished run's metrics.jsonl (`dpfleet compare --tensorboard`). Step 0 is the starting model's
held-out evaluation (round 0, before any private round: no privacy cost). Writer: tensorboardX (about
90 kB, no TensorFlow; the `tensorboard` extra), flushed after every round.

Why a marker file (`MARKER`): rewriting means deleting the earlier events, and a folder named on
the command line may be anything (`--tensorboard runs` once made `runs/<run>` the run itself).
dpfleet writes the marker into every folder it creates and replaces only a folder holding it, and
in it only its own event files; any other existing folder is refused in one line.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from dpfleet.coordinator.state.run_dir import read_initial
from dpfleet.errors import DpfleetError

TENSORBOARD = "tensorboard"  # the folder in a run directory
DEBUG_NONPRIVATE = "debug_nonprivate.jsonl"  # a run's un-noised telemetry, only when it asked
DEBUG_GROUP = "debug_nonprivate_NOT_DP"  # the tag group of un-noised telemetry (outside the guarantee)
STARTING_TAGS = ("accuracy", "loss", "perplexity")  # round 0's figures, at step 0 under eval/
INSTALL = "pip install 'dpfleet[tensorboard]'"
MARKER = ".dpfleet-tensorboard"  # in every folder dpfleet creates for events: it may replace them
EVENTS = "events.out.tfevents.*"  # tensorboardX's event files, the only files replaced

# a metrics record's key -> its tag group in TensorBoard (a key not listed goes to "round/")
GROUPS = {
    "accuracy": "eval", "loss": "eval", "perplexity": "eval",
    # TFF's three next-word accuracies (engine/field_metrics.py)
    "tff_accuracy": "eval", "tff_accuracy_without_out_of_vocab": "eval",
    "tff_accuracy_without_out_of_vocab_or_end_of_sentence": "eval",
    "epsilon": "privacy", "zcdp": "privacy", "min_separation": "privacy",
    "max_participation": "privacy",
    "clip": "dp", "noise_std": "dp", "clip_estimate": "dp", "restart": "dp",
    "clients": "participation", "refused": "participation",
    # timer mode: how the round closed (`participation.Selection.outcome`)
    **dict.fromkeys(("selected", "failed", "missed_deadline", "over_goal", "committed", "abandoned",
                     "abandoned_selected"), "participation"),
    "clock_hours": "clock", "waited_hours": "clock", "round_duration_minutes": "clock",
}


def available() -> bool:
    """Whether the writer (tensorboardX, the `tensorboard` extra) is installed."""
    return importlib.util.find_spec("tensorboardX") is not None


def scalars(record: Mapping, group: str | None = None) -> Iterator[tuple[str, float]]:
    """(tag, value) of each number in a round's record; a nested table (`aggregation`) is a group
    of its own, and text, None (a round without evaluation) and "round" itself are left out."""
    for key, value in record.items():
        if key == "round" or value is None or isinstance(value, str):
            continue
        if isinstance(value, Mapping):
            yield from scalars(value, f"{group}/{key}" if group else key)
        elif isinstance(value, bool | int | float) and math.isfinite(value):
            yield f"{group or GROUPS.get(key, 'round')}/{key}", float(value)


def tagged(logs: Mapping[str, Mapping]) -> Iterator[tuple[str, float]]:
    """(tag, value) of a round's logs, what every tracker gets (`trackers`): its metrics record,
    and its un-noised telemetry under DEBUG_GROUP only if the run wrote some (debug_nonprivate)."""
    yield from scalars(logs["metrics"])
    if logs.get("debug_nonprivate"):
        yield from scalars(logs["debug_nonprivate"], DEBUG_GROUP)


class TensorBoardLog:
    """One run's TensorBoard folder, rewritten from `backlog` (the rounds so far) when opened."""

    def __init__(self, folder: Path, backlog: Iterable[Mapping[str, Mapping]] = (), *,
                 in_run: bool = False):
        """`backlog`: each earlier round's logs, {"metrics": record, "debug_nonprivate": record}.
        `in_run`: `folder` is a run directory's own tensorboard/ (see `claim`)."""
        if not available():
            raise DpfleetError(f"tensorboard = true needs tensorboardX: {INSTALL}")
        from tensorboardX import SummaryWriter

        self.folder = claim(Path(folder), in_run=in_run)  # an earlier opening's events: dropped
        self.writer = SummaryWriter(logdir=str(self.folder), flush_secs=3600)
        for logs in backlog:
            self._write(logs)
        self.writer.flush()

    def _write(self, logs: Mapping[str, Mapping]) -> None:
        step = int(logs["metrics"]["round"])
        for tag, value in tagged(logs):
            self.writer.add_scalar(tag, value, step)

    def round(self, logs: Mapping[str, Mapping]) -> None:
        """A committed round's logs, on disk when this returns."""
        self._write(logs)
        self.writer.flush()

    def close(self, status: str = "FINISHED") -> None:  # events have no run status
        self.writer.close()


def claim(folder: Path, *, in_run: bool = False) -> Path:
    """`folder` ready for a fresh set of events: created with `MARKER`, or, if it exists and
    holds the marker, emptied of its event files (nothing else in it is touched). Any other
    existing path is refused: it is not dpfleet's to delete. `in_run`: the folder is a run
    directory's tensorboard/, which an older dpfleet wrote without a marker; holding only event
    files, it is adopted."""
    events = sorted(folder.glob(EVENTS)) if folder.is_dir() else []
    if folder.exists() or folder.is_symlink():
        legacy = in_run and folder.is_dir() and all(p in events for p in folder.iterdir())
        if not (folder.is_dir() and (folder / MARKER).is_file()) and not legacy:
            raise DpfleetError(f"{folder} exists and is not a TensorBoard folder dpfleet wrote (no "
                               f"{MARKER} in it): choose another folder, or remove it yourself")
        for path in events:
            path.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).write_text("dpfleet writes TensorBoard events here and may replace them\n")
    return folder


def read_jsonl(path: Path) -> list[dict]:
    """A JSON-lines log (metrics.jsonl); a missing file is empty, a torn last line is left out
    (a line cut inside a character too); a line nested too deep to parse is one DpfleetError."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_bytes().splitlines():
        try:
            out.append(json.loads(line))
        except RecursionError:
            raise DpfleetError(f"{path}: a line nests too deep to be a run's record") from None
        except ValueError:  # not JSON, not UTF-8
            break  # a killed append: nothing after it was committed
    return out


def run_backlog(run_path: Path, metrics: Iterable[Mapping]) -> list[dict]:
    """Step 0, the starting model's held-out evaluation (`run_dir.INITIAL_EVAL`) when the run has
    one, then each round's logs so far (`round_backlog`)."""
    initial = read_initial(run_path)
    start = [{"metrics": {"round": 0, **{k: initial[k] for k in STARTING_TAGS if k in initial}}}] \
        if initial else []
    return start + round_backlog(run_path, metrics)


def round_backlog(run_path: Path, metrics: Iterable[Mapping]) -> list[dict]:
    """Each round's logs so far: `metrics` with the run directory's debug_nonprivate lines."""
    debug = {d["round"]: d for d in read_jsonl(Path(run_path) / DEBUG_NONPRIVATE)}
    return [{"metrics": m, **({"debug_nonprivate": debug[m["round"]]} if m["round"] in debug else {})}
            for m in metrics]


def export(run_path: Path, folder: Path) -> Path:
    """A run directory's metrics.jsonl (and debug_nonprivate.jsonl) as TensorBoard scalars in
    `folder`: a new folder, or one an earlier export made (`claim`; any other is refused)."""
    log = TensorBoardLog(folder, run_backlog(run_path, read_jsonl(Path(run_path) / "metrics.jsonl")))
    log.close()
    return Path(folder)
