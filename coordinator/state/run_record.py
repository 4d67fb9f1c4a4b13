"""What a run directory records, read back as one object: for comparing runs (`dpfleet compare`).

Why a reader of its own: a finished run is described by summary.json and privacy.json, an
unfinished one (interrupted, still running, a service's state) only by its config and the
metrics lines committed so far; both are worth comparing, so neither file is required beyond
config.json, and what is missing is said rather than guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dpfleet.coordinator.state.tensorboard_log import read_jsonl
from dpfleet.errors import DpfleetError


@dataclass(frozen=True)
class RunRecord:
    """One run directory's files, as written (None: the file is not there)."""

    path: Path
    config: dict  # config.json: the resolved config (overrides included), without the mechanism pin
    metrics: list[dict]  # metrics.jsonl: one record per committed round
    summary: dict | None  # summary.json: only a finished run has one
    privacy: dict | None  # privacy.json

    @property
    def finished(self) -> bool:
        return self.summary is not None

    @property
    def rounds_planned(self) -> int | None:
        return self.config.get("rounds")

    def last(self, key: str) -> tuple[int, float] | None:
        """(round, value) of the last round whose record has `key` (accuracy: evaluated rounds)."""
        for record in reversed(self.metrics):
            if record.get(key) is not None:
                return record["round"], record[key]
        return None


def _json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DpfleetError(f"{path} is not valid JSON ({exc})") from None


def read_run(path: Path) -> RunRecord:
    """The run directory at `path`; one clear error for a folder that is not one."""
    path = Path(path)
    if not path.is_dir():
        raise DpfleetError(f"{path}: no such run directory")
    config = _json(path / "config.json")
    if config is None:
        inside = (path / "model.safetensors").is_file()  # a checkpoint/ given for its run
        hint = " (a run's checkpoint/ is inside its run directory)" if inside else ""
        raise DpfleetError(f"{path} is not a run directory (no config.json){hint}")
    config = {k: v for k, v in config.items() if k != "mechanism"}  # the run's pin, not a setting
    return RunRecord(path, config, read_jsonl(path / "metrics.jsonl"), _json(path / "summary.json"),
                     _json(path / "privacy.json"))
