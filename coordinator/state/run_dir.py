"""A run directory: config, per-round metrics, participation log, checkpoint, plots, privacy.

Every file is written by the floor's helpers (`dpfleet.io`; a JSON file by `dpfleet.jsonio.write_json`):
atomically (a crash never leaves a half-written file) and under its permission rule, the folder
0700 and every file 0600 (a resume point next to config.json and the model is one reader's
business). Layout:
    config.toml / config.json   the resolved config
    metrics.jsonl               one JSON object per round (DP quantities and held-out evaluation)
    initial_eval.json           round 0: the starting model's held-out evaluation, written when the
                                run starts and read back on resume (no privacy cost)
    debug_nonprivate.jsonl      un-noised client telemetry, only with debug_nonprivate (not DP)
    vocabulary/                 a DP word vocabulary and its privacy summary (tokenizer.kind word)
    participation.jsonl         {"round", "devices", "restart"} per round (for the accountant)
    releases.jsonl              what each round released, fsynced before release (release_log.py)
    round.pending               only inside a round's commit: its metrics / debug lines, written
                                before its release line and finished or dropped on reopening
    resume/                     while unfinished: resume point + noise_key (0600; resume.py)
    checkpoint/                 model.safetensors, model_config.json, tokenizer/, server_state
    accuracy.png                held-out accuracy per round against the unigram baseline
    privacy.json                the privacy summary
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dpfleet.errors import DpfleetError
from dpfleet.io import (  # noqa: F401 (the run directory's writers: the floor's)
    append_text,
    atomic_write,
    private_mkdir,
    write_secret,
)
from dpfleet.jsonio import dumps, write_json

INITIAL_EVAL = "initial_eval.json"  # round 0: the starting model's held-out evaluation
# what round 0 is, said with its figure
STARTING_MODEL = ("round 0: the starting model (the config's init or the model passed in, after "
                  "public pretraining if any), evaluated before any private round: no privacy cost")


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def to_toml(resolved: dict) -> str:
    """The resolved config as TOML (scalars first, then one table per section)."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in resolved.items() if not isinstance(v, dict)]
    for section, values in resolved.items():
        if isinstance(values, dict):
            lines += ["", f"[{section}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


# the logs every run directory gets first (`RunDir`): what marks a folder as a run's
RUN_LOGS = ("metrics.jsonl", "participation.jsonl", "releases.jsonl")


def is_run_dir(path: Path) -> bool:
    """Whether `path` has a run directory's layout (`RUN_LOGS`), so dpfleet made it."""
    return all((Path(path) / name).is_file() for name in RUN_LOGS)


def check_not_a_run(path: Path, option: str) -> None:
    """Refuse `path` as the folder of `option`'s output when it is, or is directly inside, a run
    directory or a coordinator's state (a run's layout, or its config.json): a run's files (its
    checkpoint/ too) are not another command's to add to or replace."""
    path = Path(path)
    if any(is_run_dir(p) or (p / "config.json").is_file() for p in (path, path.absolute().parent)):
        raise DpfleetError(f"{option} {path} is a run directory or inside one: give a folder of its own")


def check_replaceable(path: Path, mark: str, option: str) -> None:
    """Refuse to write `path` unless it is absent or a file an earlier run of the same command
    wrote (it holds `mark`): no dpfleet command replaces a file it did not create (a run's
    privacy.json, a user's notes). `option` names the flag to change, for the one-line error."""
    path = Path(path)
    if not (path.exists() or path.is_symlink()):
        return
    if path.is_file() and not path.is_symlink() and mark.encode() in path.read_bytes():
        return
    raise DpfleetError(f"{path} exists and is not a file this command wrote: choose another {option}, "
                       "or remove it yourself")


class RunDir:
    def __init__(self, path: Path, overwrite: bool = False, resume: bool = False):
        """`overwrite`: reuse a non-empty folder, only if it is a run directory (`is_run_dir`):
        overwriting clears what a run leaves there, so a folder of someone's files is refused."""
        self.path = Path(path)
        if resume:  # an interrupted run: its logs are kept (and truncated by `resume`)
            return
        if self.path.exists() and not self.path.is_dir():
            raise DpfleetError(f"run directory {self.path} is a file; choose another one")
        if self.path.exists() and any(self.path.iterdir()):
            if not overwrite:
                raise DpfleetError(
                    f"run directory {self.path} is not empty; choose another one, or overwrite it "
                    "(--overwrite; overwrite=True in Python)")
            if not is_run_dir(self.path):
                raise DpfleetError(
                    f"{self.path} is not a run directory (no {', '.join(RUN_LOGS)}): overwriting "
                    "reuses only a run's folder, never one of other files; choose another one")
        private_mkdir(self.path)
        for name in RUN_LOGS:
            atomic_write(self.path / name, "")

    def write_config(self, resolved: dict) -> None:
        """config.toml and config.json; a mechanism binding config.json already holds is kept (a
        restarted service writes its config again: the run's fingerprint must survive it)."""
        path = self.path / "config.json"
        bound = json.loads(path.read_text()).get("mechanism") if path.is_file() else None
        atomic_write(self.path / "config.toml", to_toml(resolved))
        write_json(path, {**resolved, **({"mechanism": bound} if bound else {})}, indent=2)

    def append(self, name: str, record: dict) -> None:
        append_text(self.path / name, dumps(record) + "\n")

    def write_json(self, name: str, obj: dict) -> Path:
        return write_json(self.path / name, obj, indent=2)

    def write_initial(self, evaluation: dict) -> dict:
        """Round 0's record (the starting model's held-out `evaluation`, said to cost no privacy)
        written to `INITIAL_EVAL`; returned as written."""
        record = {"round": 0, **evaluation, "privacy": STARTING_MODEL}
        self.write_json(INITIAL_EVAL, record)
        return record

    def initial(self) -> dict | None:
        """Round 0's record as the run wrote it (`read_initial`)."""
        return read_initial(self.path)


def read_initial(path: Path) -> dict | None:
    """The run directory's round-0 record (`INITIAL_EVAL`), or None: a run of an older dpfleet, or
    one that stopped before its engine started (an unreadable file counts as absent too)."""
    try:
        record = json.loads((Path(path) / INITIAL_EVAL).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def accuracy_points(metrics: list[dict], initial: dict | None = None) -> list[tuple[int, float]]:
    """(round, held-out accuracy): round 0 (the starting model) first when evaluated, then each
    evaluated round."""
    start = [(0, initial["accuracy"])] if initial and initial.get("accuracy") is not None else []
    return start + [(m["round"], m["accuracy"]) for m in metrics if m.get("accuracy") is not None]


def plot_accuracy(metrics: list[dict], baseline: float, out: Path, title: str,
                  initial: dict | None = None) -> Path:
    """accuracy.png: the released models' held-out accuracy per round from the starting model's
    (`initial`, round 0) on, against the unigram baseline."""
    # a Figure of its own, not pyplot's: the caller's backend (a notebook's inline plots) is left alone
    from matplotlib.figure import Figure

    pts = accuracy_points(metrics, initial)
    fig = Figure(figsize=(6, 4), dpi=110)
    ax = fig.subplots()
    if pts:
        xs, ys = np.array(pts).T
        ax.plot(xs, ys, marker="o", label="DP-FTRL model (held-out clients; round 0: starting model)")
    ax.axhline(baseline, color="grey", linestyle="--", label="unigram baseline")
    ax.set_xlabel("round")
    ax.set_ylabel("next-token accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write(out, lambda fh: fig.savefig(fh, format="png"))  # 0600, never half-written
    return out
