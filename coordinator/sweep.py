"""A sweep: one config run over a grid of config values, each point with several seeds.

Why: one run of a DP experiment says little (the noise is fresh every run, the users held out
depend on the seed), and the question is usually how the final figure moves with one key. A
sweep runs every point of the grid with N seeds, each as an ordinary run directory
(`SWEEP/<point>-seed<s>/`), and summarises each point's final figures as a mean with a 95%
t-interval over its seeds (sample sd), the way dpfleet's own benchmarks report results.

`sweep.json` at the top of the folder says what the sweep is (the config, the overrides, the
grid, the seeds, the runs); it marks the folder as a sweep's, so a rerun of the same command
continues it (finished runs are kept, interrupted ones resumed) and a different sweep is refused
there instead of mixing with it.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dpfleet.coordinator.config_overrides import toml_value
from dpfleet.errors import DpfleetError
from dpfleet.io import atomic_write
from dpfleet.jsonio import dumps, write_json

SWEEP_FILE = "sweep.json"
FIGURES = ("accuracy", "perplexity", "epsilon")  # the final figures a sweep summarises


@dataclass(frozen=True)
class SweepRun:
    """One run of a sweep: its folder name, the swept keys' values and its seed."""

    name: str
    values: dict
    seed: int


def split_values(text: str) -> list[str]:
    """"a,b,[1, 2],\"x,y\"" as its comma-separated items, commas inside brackets or quotes kept."""
    items, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items]


def parse_grid(texts: Sequence[str]) -> dict[str, list]:
    """`["dp.noise_multiplier=0.5,1,2", ...]` as {"dp.noise_multiplier": [0.5, 1, 2]}: each value
    read as TOML, like `--set`'s."""
    grid: dict[str, list] = {}
    for text in texts:
        key, sep, raw = text.partition("=")
        key = key.strip()
        values = split_values(raw) if sep else []
        if not key or not values or not all(values):
            raise DpfleetError(f"--grid {text!r}: give KEY=V1,V2,... (e.g. dp.noise_multiplier=0.5,1,2)")
        if key in grid:
            raise DpfleetError(f"--grid names {key} twice: give all its values in one --grid")
        parsed = [toml_value(v) for v in values]
        if len({json.dumps(v) for v in parsed}) < len(parsed):
            raise DpfleetError(f"--grid {key}: a value is repeated ({raw})")
        grid[key] = parsed
    if not grid:
        raise DpfleetError("give at least one --grid KEY=V1,V2,...")
    return grid


def _slug(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text)[:40] or "_"


def expand(grid: Mapping[str, Sequence], seeds: Sequence[int]) -> list[SweepRun]:
    """Every point of the grid (the first key slowest) with every seed, each with a folder name
    that says both (`dp.noise_multiplier=0.5-seed0`)."""
    keys = list(grid)
    runs = []
    for combo in itertools.product(*(grid[k] for k in keys)):
        values = dict(zip(keys, combo, strict=True))
        point = "_".join(f"{k.rpartition('.')[2]}={_slug(v)}" for k, v in values.items())
        runs += [SweepRun(f"{point}-seed{s}", values, s) for s in seeds]
    if len({r.name for r in runs}) < len(runs):  # two values with one slug: number the folders
        runs = [SweepRun(f"{i:03d}-{r.name}", r.values, r.seed) for i, r in enumerate(runs)]
    return runs


def open_sweep(folder: Path, spec: dict) -> None:
    """Mark `folder` as this sweep's (a new or empty folder), or check that it already is: another
    sweep's folder, or a folder of anything else, is refused so that nothing is mixed or lost."""
    marker = folder / SWEEP_FILE
    if marker.is_file():
        try:
            saved = json.loads(marker.read_text())
        except (OSError, ValueError) as exc:
            raise DpfleetError(f"{marker} is not readable JSON ({exc}); choose another --out") from None
        wanted = json.loads(dumps(spec))  # like with like: tuples as lists
        if saved != wanted:
            changed = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
            raise DpfleetError(f"{folder} holds another sweep (it differs in {', '.join(changed)}); "
                               "rerun that sweep's command to continue it, or choose another --out")
        return
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise DpfleetError(f"{folder} exists and is not a sweep's folder (no {SWEEP_FILE}); choose "
                           "another --out")
    folder.mkdir(parents=True, exist_ok=True)
    write_json(marker, spec, indent=2)


def read_sweep(folder: Path) -> dict:
    """A sweep folder's `sweep.json`; one line when it is not one."""
    try:
        spec = json.loads((Path(folder) / SWEEP_FILE).read_text())
        runs = [SweepRun(r["name"], dict(r["values"]), int(r["seed"])) for r in spec["runs"]]
        grid = {str(k): list(v) for k, v in spec["grid"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DpfleetError(f"{folder}/{SWEEP_FILE} is not a sweep's description ({exc!r})") from None
    return {**spec, "grid": grid, "runs": runs}


def t_interval(values: Sequence[float]) -> tuple[float, float | None]:
    """(mean, half-width of its 95% interval: Student's t with the sample sd); None for one value."""
    from scipy.stats import t

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    return mean, float(t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))


def final_figures(run_dir: Path) -> dict | None:
    """A finished run's final figures (summary.json, privacy.json); None while it is unfinished."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        privacy = json.loads((run_dir / "privacy.json").read_text())
        return {"accuracy": float(summary["final"]["accuracy"]),
                "perplexity": float(summary["final"]["perplexity"]),
                "epsilon": None if privacy.get("epsilon") is None else float(privacy["epsilon"]),
                "unigram_accuracy": float(summary["unigram_baseline"]["accuracy"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def summarize(folder: Path) -> dict:
    """Each grid point's final figures over its finished seeds: {"grid", "points": [{"values",
    "seeds", "finished", figure: {"mean", "ci95"}}]}, in the grid's order."""
    spec = read_sweep(folder)
    points: dict[str, dict] = {}
    for run in spec["runs"]:
        key = json.dumps(run.values, sort_keys=True)
        point = points.setdefault(key, {"values": run.values, "seeds": 0, "finished": 0, "_rows": []})
        point["seeds"] += 1
        figures = final_figures(Path(folder) / run.name)
        if figures is not None:
            point["finished"] += 1
            point["_rows"].append(figures)
    out = []
    for point in points.values():
        rows = point.pop("_rows")
        for name in (*FIGURES, "unigram_accuracy"):
            values = [r[name] for r in rows if r[name] is not None and math.isfinite(r[name])]
            mean, half = t_interval(values) if values else (None, None)
            point[name] = {"mean": mean, "ci95": half, "n": len(values)}
        out.append(point)
    return {"path": str(folder), "grid": spec["grid"], "points": out}


def _cell(figure: dict, digits: int) -> str:
    if figure["mean"] is None:
        return "-"
    half = "" if figure["ci95"] is None else f" ± {figure['ci95']:.{digits}f}"
    return f"{figure['mean']:.{digits}f}{half}"


def render_summary(summary: dict) -> str:
    """The sweep as a table that fits a terminal: a row per grid point, its swept values, how many
    seeds finished, and mean ± 95% half-interval of the final accuracy, eps and perplexity."""
    keys = list(summary["grid"])
    header = [*keys, "seeds", "accuracy (95% CI)", "eps", "perplexity", "unigram"]
    rows = [[*(json.dumps(p["values"][k]) if not isinstance(p["values"][k], str) else p["values"][k]
               for k in keys),
             f"{p['finished']}/{p['seeds']}", _cell(p["accuracy"], 4), _cell(p["epsilon"], 2),
             _cell(p["perplexity"], 1), _cell(p["unigram_accuracy"], 4)]
            for p in summary["points"]]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in (header, *rows)]
    note = ("mean ± half-width of the 95% t-interval over the point's finished seeds (sample sd);\n"
            "none with one seed")
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:], "", note])


def plot_summary(summary: dict, out: Path, metadata: dict | None = None) -> Path:
    """Final accuracy (mean, 95% interval) against the first swept key, one line per value of the
    other keys, with the unigram baseline: where a reader would rather look than read. Written
    atomically; `out`'s suffix picks the format, `metadata` goes into the file."""
    from matplotlib.figure import Figure  # not pyplot: the caller's backend is left alone

    keys = list(summary["grid"])
    x_key, others = keys[0], keys[1:]
    x_values = summary["grid"][x_key]
    numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in x_values)
    position = {json.dumps(v): (v if numeric else i) for i, v in enumerate(x_values)}
    fig = Figure(figsize=(6.5, 4), dpi=110)
    ax = fig.subplots()
    series: dict[str, list[dict]] = {}
    for p in summary["points"]:
        label = ", ".join(f"{k}={p['values'][k]}" for k in others) or "final accuracy"
        series.setdefault(label, []).append(p)
    for label, points in series.items():
        done = [p for p in points if p["accuracy"]["mean"] is not None]
        xs = [position[json.dumps(p["values"][x_key])] for p in done]
        ys = [p["accuracy"]["mean"] for p in done]
        err = [p["accuracy"]["ci95"] or 0.0 for p in done]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
    baselines = [p["unigram_accuracy"]["mean"] for p in summary["points"] if p["unigram_accuracy"]["mean"]]
    if baselines:
        ax.axhline(statistics.fmean(baselines), color="grey", linestyle="--", label="unigram baseline")
    if not numeric:
        ax.set_xticks(range(len(x_values)), [str(v) for v in x_values])
    ax.set_xlabel(x_key, usetex=False, parse_math=False)
    ax.set_ylabel("final held-out accuracy (mean, 95% CI)")
    ax.grid(alpha=0.3)
    for text in ax.legend().get_texts():  # values are text, never mathtext ("$" in a value)
        text.set_parse_math(False)
    fig.tight_layout()
    atomic_write(out, lambda fh: fig.savefig(fh, format=Path(out).suffix[1:] or "png", metadata=metadata))
    return out
