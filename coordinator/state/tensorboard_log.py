"""TensorBoard scalars of a run: its per-round metrics records, as the run goes (`tensorboard = true`).

Why fed from the metrics record and nothing else: that record is what the run already releases
(DP quantities and the held-out evaluation, metrics.jsonl), so watching a run in TensorBoard shows
nothing the run directory does not. Un-noised client telemetry goes there only when the run asked
for it (`debug_nonprivate = true`), under its own tag group `debug_nonprivate_NOT_DP/`.

The folder is RUN_DIR/tensorboard/ (`tensorboard --logdir runs/` shows every run side by side).
It always mirrors the records: an engine that opens a run (fresh, resumed, a restarted service)
writes it anew from the records so far, then each round as it commits. `export` does the same for
a finished run's metrics.jsonl (`dpfleet compare --tensorboard`). Writer: tensorboardX (about
90 kB, no TensorFlow; the `tensorboard` extra), flushed after every round.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from dpfleet.errors import DpfleetError

TENSORBOARD = "tensorboard"  # the folder in a run directory
DEBUG_GROUP = "debug_nonprivate_NOT_DP"  # the tag group of un-noised telemetry (outside the guarantee)
INSTALL = "pip install 'dpfleet[tensorboard]'"

# a metrics record's key -> its tag group in TensorBoard (a key not listed goes to "round/")
GROUPS = {
    "accuracy": "eval", "loss": "eval", "perplexity": "eval",
    "epsilon": "privacy", "zcdp": "privacy", "min_separation": "privacy",
    "max_participation": "privacy",
    "clip": "dp", "noise_std": "dp", "clip_estimate": "dp", "restart": "dp",
    "clients": "participation", "refused": "participation",
    "clock_hours": "clock", "waited_hours": "clock",
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

    def __init__(self, folder: Path, backlog: Iterable[Mapping[str, Mapping]] = ()):
        """`backlog`: each earlier round's logs, {"metrics": record, "debug_nonprivate": record}."""
        if not available():
            raise DpfleetError(f"tensorboard = true needs tensorboardX: {INSTALL}")
        from tensorboardX import SummaryWriter

        self.folder = Path(folder)
        shutil.rmtree(self.folder, ignore_errors=True)  # an earlier opening's (or overwritten run's)
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

    def close(self) -> None:
        self.writer.close()


def read_jsonl(path: Path) -> list[dict]:
    """A JSON-lines log (metrics.jsonl); a missing file is empty, a torn last line is left out."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a killed append: nothing after it was committed
    return out


def run_backlog(run_path: Path, metrics: Iterable[Mapping]) -> list[dict]:
    """Each round's logs so far: `metrics` with the run directory's debug_nonprivate lines."""
    debug = {d["round"]: d for d in read_jsonl(Path(run_path) / "debug_nonprivate.jsonl")}
    return [{"metrics": m, **({"debug_nonprivate": debug[m["round"]]} if m["round"] in debug else {})}
            for m in metrics]


def export(run_path: Path, folder: Path) -> Path:
    """A run directory's metrics.jsonl (and debug_nonprivate.jsonl) as TensorBoard scalars in
    `folder`, replaced if it exists."""
    log = TensorBoardLog(folder, run_backlog(run_path, read_jsonl(Path(run_path) / "metrics.jsonl")))
    log.close()
    return Path(folder)
