"""What a run directory records, read back as one object: for comparing runs (`dpfleet compare`).

Why a reader of its own: a finished run is described by summary.json and privacy.json, an
unfinished one (interrupted, still running, a service's state) only by its config and the
metrics lines committed so far; both are worth comparing, so neither file is required beyond
config.json, and what is missing is said rather than guessed.

Why the files are checked here, at one place, against `SCHEMA`: `compare` formats, plots and
exports what it reads, and a folder given to it may be a damaged copy, a hand edit or anyone's.
Every number must be finite (a run never writes another: `dpfleet.jsonio`), nesting is bounded,
and each field the comparison reads has its type; anything else is one `DpfleetError` naming the
file and the key, before a table, plot or export is written.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from dpfleet.coordinator.state.tensorboard_log import DEBUG_NONPRIVATE, read_jsonl
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


MAX_DEPTH = 32  # a run's files nest 4 deep; deeper is no run's (and would exhaust recursion)
NUMBER, TEXTS = "number", "texts"  # a finite int or float; a list of strings
_KINDS = {None: "null", bool: "true or false", int: "an integer", NUMBER: "a finite number",
          str: "a string", TEXTS: "a list of strings", dict: "an object"}
# each file's fields the comparison reads: key -> the kinds it may have, or a table of its own
# (a key left out is fine: an older run, an unfinished one)
SCHEMA: dict[str, dict] = {
    "config.json": {"rounds": (int,), "dp": {"delta": (NUMBER,)}},
    "summary.json": {
        "final": {"accuracy": (NUMBER, None), "perplexity": (NUMBER, None)},
        "unigram_baseline": {"accuracy": (NUMBER, None)},
        "rounds_completed": (int,), "wall_seconds": (NUMBER, None), "stopped_early": (str, bool, None),
        "noise_mechanism": (str, None), "fully_private": (bool, None), "caveats": (TEXTS,),
        "warnings": (TEXTS, None)},
    "privacy.json": {"epsilon": (NUMBER, None), "delta": (NUMBER,), "noise_mechanism": (str, None),
                     "fully_private": (bool, None), "caveats": (TEXTS,)},
    "metrics.jsonl": {"round": (int,), "accuracy": (NUMBER, None), "perplexity": (NUMBER, None),
                      "epsilon": (NUMBER, None)},
    DEBUG_NONPRIVATE: {"round": (int,)},
}
REQUIRED = {"metrics.jsonl": ("round",), DEBUG_NONPRIVATE: ("round",)}  # a line without it: no round


def _fits(value: object, kind: object) -> bool:
    if kind is None:
        return value is None
    if kind is NUMBER:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is TEXTS:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _unreadable(value: object, depth: int = 0) -> str | None:
    """What no run writes in `value`: nesting deeper than MAX_DEPTH, a number that is not finite."""
    if depth > MAX_DEPTH:
        return f"nests deeper than {MAX_DEPTH}"
    if isinstance(value, dict | list):
        return next(filter(None, (_unreadable(v, depth + 1) for v in
                                  (value.values() if isinstance(value, dict) else value))), None)
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an int beyond float range
            finite = False
        return None if finite else f"holds {value if isinstance(value, float) else 'an int beyond a float'}"
    return None


def check(obj: object, file: Path, schema: dict, prefix: str = "") -> dict:
    """`obj` (one file's, or one line's, JSON) as `schema` expects it, else one DpfleetError."""
    if not isinstance(obj, dict):
        raise DpfleetError(f"{file}: {prefix.rstrip('.') or 'the file'} must be a JSON object, "
                           f"not {type(obj).__name__}")
    if not prefix and (problem := _unreadable(obj)):
        raise DpfleetError(f"{file}: {problem}, which no run writes")
    for key in REQUIRED.get(file.name, ()) if not prefix else ():
        if key not in obj:
            raise DpfleetError(f"{file}: a line has no '{key}'")
    for key, kinds in schema.items():
        if key not in obj:
            continue
        if isinstance(kinds, dict):
            check(obj[key], file, kinds, f"{prefix}{key}.")
        elif not any(_fits(obj[key], kind) for kind in kinds):
            allowed = " or ".join(_KINDS[kind] for kind in kinds)
            raise DpfleetError(f"{file}: '{prefix}{key}' must be {allowed}, not {type(obj[key]).__name__}")
    return obj


def _json(path: Path) -> dict | None:
    """A run's JSON file checked against its `SCHEMA` (None: not there)."""
    if not path.is_file():
        return None
    try:
        obj = json.loads(path.read_bytes())
    except RecursionError:
        raise DpfleetError(f"{path} nests too deep to be a run's file") from None
    except ValueError as exc:  # not JSON, not UTF-8, an integer of more digits than Python reads
        raise DpfleetError(f"{path} is not valid JSON ({exc})") from None
    return check(obj, path, SCHEMA[path.name])


def _jsonl(path: Path) -> list[dict]:
    return [check(line, path, SCHEMA[path.name]) for line in read_jsonl(path)]


def read_run(path: Path) -> RunRecord:
    """The run directory at `path`; one clear error for a folder that is not one, or for a file
    of it that is not what a run writes (`SCHEMA`)."""
    path = Path(path)
    if not path.is_dir():
        raise DpfleetError(f"{path}: no such run directory")
    config = _json(path / "config.json")
    if config is None:
        inside = (path / "model.safetensors").is_file()  # a checkpoint/ given for its run
        hint = " (a run's checkpoint/ is inside its run directory)" if inside else ""
        raise DpfleetError(f"{path} is not a run directory (no config.json){hint}")
    config = {k: v for k, v in config.items() if k != "mechanism"}  # the run's pin, not a setting
    _jsonl(path / DEBUG_NONPRIVATE)  # read again by a TensorBoard export
    return RunRecord(path, config, _jsonl(path / "metrics.jsonl"), _json(path / "summary.json"),
                     _json(path / "privacy.json"))
