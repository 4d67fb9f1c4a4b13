"""The figure of `dpfleet compare`: held-out accuracy and eps per round, one line per run, and
each finished run's wall time. Drawn from the records the runs committed (metrics.jsonl), with
the headless Agg backend, so it works over SSH and in CI.

Why the plot carries a mark (`MARK`, in the file's metadata): `--plot PATH` replaces PATH, and a
PATH may be anyone's file (a figure of a paper, a run's own accuracy.png). A file is replaced
only if an earlier compare drew it; the new one is written atomically, so a failure leaves the
old file, never half a plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dpfleet.coordinator.cli.compare_table import starting_accuracy
from dpfleet.coordinator.state.run_dir import check_replaceable as replaceable
from dpfleet.coordinator.state.run_record import RunRecord
from dpfleet.errors import DpfleetError
from dpfleet.io import atomic_write

MARK = "dpfleet compare"
METADATA_KEY = {".png": "Software", ".pdf": "Creator", ".svg": "Creator"}  # the formats, their key


def check_replaceable(out: Path) -> None:
    """Refuse `out` unless it is absent or a plot an earlier compare drew (it holds `MARK`)."""
    if out.suffix.lower() not in METADATA_KEY:
        raise DpfleetError(f"cannot write the plot {out}: its suffix must be .png, .pdf or .svg")
    replaceable(out, MARK, "--plot")


def plot_runs(records: Sequence[RunRecord], labels: Sequence[str], out: Path) -> Path:
    """Write the three panels to `out` (its suffix picks the format: .png, .pdf, .svg)."""
    out = Path(out)
    check_replaceable(out)
    import matplotlib

    with matplotlib.rc_context({"text.parse_math": False}):  # labels are paths: `$` is no mathtext
        return _draw(records, labels, out)


def _draw(records: Sequence[RunRecord], labels: Sequence[str], out: Path) -> Path:
    import matplotlib
    from matplotlib.figure import Figure  # not pyplot: the caller's backend is left alone
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(15, 4.2), dpi=110)
    acc, eps, wall = fig.subplots(1, 3)
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (record, label) in enumerate(zip(records, labels, strict=True)):
        color = colors[i % len(colors)]
        start = starting_accuracy(record)  # round 0, the starting model (initial_eval.json)
        points = ([] if start is None else [(0, start)]) + [
            (m["round"], m["accuracy"]) for m in record.metrics if m.get("accuracy") is not None]
        if points:
            acc.plot(*zip(*points, strict=True), marker="o", color=color, label=label)
        baseline = (record.summary or {}).get("unigram_baseline", {}).get("accuracy")
        if baseline is not None:
            acc.axhline(baseline, color=color, linestyle="--", linewidth=1)
        points = [(m["round"], m["epsilon"]) for m in record.metrics if m.get("epsilon") is not None]
        if points:
            eps.plot(*zip(*points, strict=True), color=color, label=label)
        seconds = (record.summary or {}).get("wall_seconds")
        wall.barh(i, seconds or 0, color=color)
        if seconds is None:
            wall.text(0, i, " unfinished", va="center")
    acc.set(xlabel="round", ylabel="held-out next-token accuracy",
            title="accuracy (dashed: unigram baseline)")
    eps.set(xlabel="round", ylabel="eps so far (metrics.jsonl)", title="privacy spent")
    wall.set(xlabel="seconds", title="wall time", yticks=range(len(labels)), yticklabels=labels)
    wall.invert_yaxis()
    for ax in (acc, eps):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a run with no round yet draws no line
            ax.legend(fontsize="small")
    wall.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    suffix = out.suffix.lower()
    metadata = {METADATA_KEY[suffix]: MARK}
    try:
        atomic_write(out, lambda fh: fig.savefig(fh, format=suffix[1:], metadata=metadata))
    except (OSError, ValueError) as exc:  # unwritable, missing folder
        raise DpfleetError(f"cannot write the plot {out}: {getattr(exc, 'strerror', None) or exc}") \
            from None
    return Path(out)
