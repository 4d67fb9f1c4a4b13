"""A run directory: config, per-round metrics, participation log, checkpoint, plots, privacy.

Layout (every file is written atomically, by `dpfleet.io.atomic_write`: a crash never leaves a
half-written file):
    config.toml / config.json   the resolved config
    metrics.jsonl               one JSON object per round (DP quantities and held-out evaluation)
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

from dpfleet.io import atomic_write, write_secret  # noqa: F401 (the run directory's writers: the floor's)
from dpfleet.jsonio import dumps


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


class RunDir:
    def __init__(self, path: Path, overwrite: bool = False, resume: bool = False):
        self.path = Path(path)
        if resume:  # an interrupted run: its logs are kept (and truncated by `resume`)
            return
        if self.path.exists() and any(self.path.iterdir()) and not overwrite:
            from dpfleet.errors import DpfleetError

            raise DpfleetError(
                f"run directory {self.path} is not empty; pass --overwrite or choose another --out"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "participation.jsonl", "releases.jsonl"):
            (self.path / name).write_text("")

    def write_config(self, resolved: dict) -> None:
        """config.toml and config.json; a mechanism binding config.json already holds is kept (a
        restarted service writes its config again: the run's fingerprint must survive it)."""
        path = self.path / "config.json"
        bound = json.loads(path.read_text()).get("mechanism") if path.is_file() else None
        atomic_write(self.path / "config.toml", to_toml(resolved))
        atomic_write(path, dumps({**resolved, **({"mechanism": bound} if bound else {})}, indent=2))

    def append(self, name: str, record: dict) -> None:
        with (self.path / name).open("a") as fh:
            fh.write(dumps(record) + "\n")
            fh.flush()

    def write_json(self, name: str, obj: dict) -> Path:
        atomic_write(self.path / name, dumps(obj, indent=2))
        return self.path / name


def plot_accuracy(metrics: list[dict], baseline: float, out: Path, title: str) -> Path:
    # a Figure of its own, not pyplot's: the caller's backend (a notebook's inline plots) is left alone
    from matplotlib.figure import Figure

    pts = [(m["round"], m["accuracy"]) for m in metrics if m.get("accuracy") is not None]
    fig = Figure(figsize=(6, 4), dpi=110)
    ax = fig.subplots()
    if pts:
        xs, ys = np.array(pts).T
        ax.plot(xs, ys, marker="o", label="DP-FTRL model (held-out clients)")
    ax.axhline(baseline, color="grey", linestyle="--", label="unigram baseline")
    ax.set_xlabel("round")
    ax.set_ylabel("next-token accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    return out
