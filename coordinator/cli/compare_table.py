"""The comparison of runs `dpfleet compare` prints: one column per run, the figures people compare
(accuracy against the starting model's and the unigram baseline's, TFF's three next-word
accuracies against the unigram and most-frequent-word baselines', the suggestion strip, eps,
rounds, wall time, noise) and then the config keys that differ between the runs, which is usually
why they were run. Functions of `RunRecord`s (and, for an unfinished run's round 0, its
initial_eval.json).

A finished run's figures are its summary.json and privacy.json; an unfinished run's are the last
metrics records it committed (accuracy of its last evaluated round, eps so far), marked as such.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

from dpfleet.coordinator.engine.field_metrics import (
    TFF_ACCURACIES,
    finite_number,
    last_evaluated,
    tff_figures,
)
from dpfleet.coordinator.state.run_dir import read_initial
from dpfleet.coordinator.state.run_record import RunRecord
from dpfleet.coordinator.state.trackers import WRITERS

_MISSING = object()
# config keys that say how a run is watched, not what it computes: never a difference worth a row
WATCHING = set(WRITERS)  # tensorboard, wandb, mlflow


def flatten(config: Mapping, prefix: str = "") -> dict[str, object]:
    """{"dp": {"clip_norm": 1}} as {"dp.clip_norm": 1}."""
    out: dict[str, object] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def differing_keys(records: Sequence[RunRecord]) -> list[str]:
    """The config keys (dotted) whose value is not the same in every run, in the config's order."""
    flat = [flatten(r.config) for r in records]
    keys = [k for k in dict.fromkeys(k for f in flat for k in f) if k not in WATCHING]
    return [k for k in keys if len({json.dumps(f.get(k, _MISSING), default=str) for f in flat}) > 1]


def starting_accuracy(record: RunRecord) -> float | None:
    """Round 0's held-out accuracy (the starting model, no privacy cost): summary.json's, or for
    an unfinished run the run directory's initial_eval.json; None for a run of an older dpfleet."""
    initial = (record.summary or {}).get("initial") or read_initial(record.path)
    value = initial.get("accuracy") if isinstance(initial, dict) else None
    number = isinstance(value, int | float) and not isinstance(value, bool)
    # finite only (NaN fails both comparisons); an edited file's text or inf: no figure
    return value if number and -float("inf") < value < float("inf") else None


def run_figures(record: RunRecord, label: str, keys: Sequence[str] = ()) -> dict:
    """One run's figures (the JSON form of a column); None where the run has no such figure."""
    s, p = record.summary or {}, record.privacy or {}
    final = s.get("final", {})  # a summary without it (a hand-made one) has no final figures
    accuracy, perplexity = record.last("accuracy"), record.last("perplexity")
    eps = record.last("epsilon")
    flat = flatten(record.config)
    figures = {
        "run": label, "path": str(record.path), "finished": record.finished,
        "stopped_early": s.get("stopped_early"),
        "accuracy": final.get("accuracy") if s else accuracy and accuracy[1],
        "accuracy_round": None if s or not accuracy else accuracy[0],
        "initial_accuracy": starting_accuracy(record),  # round 0: the starting model
        "unigram_accuracy": s.get("unigram_baseline", {}).get("accuracy"),
        "perplexity": final.get("perplexity") if s else perplexity and perplexity[1],
        # finished: privacy.json's (None where it is no guarantee); else the last round's so far
        "epsilon": p.get("epsilon") if record.finished else eps and eps[1],
        "epsilon_so_far": not record.finished,
        # a projection run: the planned launch's eps, a simulation beside the run's own guarantee
        "projection": _projection(p.get("projection")) if record.finished else None,
        "delta": p.get("delta", flat.get("dp.delta")),
        "rounds_completed": s.get("rounds_completed", len(record.metrics)),
        "rounds_planned": record.rounds_planned,
        "wall_seconds": s.get("wall_seconds"),
        "noise_mechanism": s.get("noise_mechanism", p.get("noise_mechanism")),
        "fully_private": s.get("fully_private", p.get("fully_private")),
        "caveats": s.get("caveats", p.get("caveats", [])),
        "warnings": s.get("warnings"),  # a result that means nothing (None: not recorded)
        # TFF's three next-word accuracies, the model's next to the unigram and most-frequent-word
        # baselines' (an unfinished run: its last evaluated round's, no baselines yet)
        "tff": tff_figures(final if s else last_evaluated(record.metrics), s.get("unigram_baseline")),
        "keyboard": keyboard_figures(s.get("keyboard")),  # the suggestion strip (None: not scored)
        "config": {k: flat[k] for k in keys if k in flat},  # a key an older run lacks: left out
    }
    return figures


def _projection(block: object) -> dict | None:
    """privacy.json's `projection` block as compare shows it (None: not a projection run)."""
    if not isinstance(block, Mapping):
        return None
    return {k: block.get(k) for k in ("label", "epsilon", "delta", "population", "noise_cohort")}


def keyboard_figures(block: object) -> dict | None:
    """summary.json's `keyboard` block without its bookkeeping: each strip's rates and the words
    they are over (None for a run without one: an older dpfleet, a character vocabulary)."""
    if not isinstance(block, Mapping) or not isinstance(block.get("model"), Mapping):
        return None
    strips = {k: {r: finite_number(v) for r, v in block[k].items() if r in RATES}
              for k in ("model", "most_frequent_words") if isinstance(block.get(k), Mapping)}
    return {**strips, "words": finite_number(block.get("words"))}


RATES = ("top1_recall", "top3_recall", "keystroke_savings")


def comparison(records: Sequence[RunRecord], labels: Sequence[str]) -> dict:
    """What `dpfleet compare --json` prints: each run's figures and the keys that differ."""
    keys = differing_keys(records)
    return {"runs": [run_figures(r, label, keys) for r, label in zip(records, labels, strict=True)],
            "differing_keys": keys}


def wall_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, sec = divmod(round(seconds), 60)
    return f"{minutes} min {sec:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def _number(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _status(f: dict) -> str:
    if not f["finished"]:
        return "unfinished"
    return "stopped early" if f["stopped_early"] else "finished"


def _accuracy(f: dict) -> str:
    text = _number(f["accuracy"], ".4f")
    return f"{text} (round {f['accuracy_round']})" if f["accuracy_round"] else text


def _epsilon(f: dict) -> str:
    if f["epsilon"] is None:
        return "none (see caveats)" if f["finished"] else "-"
    text = f"{f['epsilon']:.2f} at delta {f['delta']:g}"
    if f.get("projection"):
        return f"{text}, this run's own"
    return f"{text}, so far" if f["epsilon_so_far"] else text


def _projected(f: dict) -> str:
    q = f.get("projection")
    if not q or q.get("epsilon") is None:
        return "-"
    return f"{q['epsilon']:.2f} at N {q['population']:,} (a projection, not a guarantee)"


def _private(f: dict) -> str:
    if f["fully_private"] is None:
        return "-"
    return "yes" if f["fully_private"] else f"NO ({len(f['caveats'])} caveats)"


def _keyboard(strip: str):
    """The cell of one strip: its top-1 / top-3 recall and keystroke savings."""
    def cell(f: dict) -> str:
        rates = (f["keyboard"] or {}).get(strip)
        return " / ".join(_number(rates.get(r), ".3f") for r in RATES) if rates else "-"

    return cell


def _tff(strip: str):
    """The cell of one of `tff_figures`' strips: its three accuracies, a dash for each missing;
    one dash for a run with none of them."""
    def cell(f: dict) -> str:
        values = [f["tff"][strip][name] for name in TFF_ACCURACIES]
        return "-" if all(v is None for v in values) else " / ".join(_number(v, ".4f") for v in values)

    return cell


TFF_LEGEND = "(TFF acc 1/2/3: TFF's accuracy / without OOV / without OOV or EOS, next word)"


def _warnings(f: dict) -> str:
    if f["warnings"] is None:
        return "-"
    return "; ".join(w.split(":")[0] for w in f["warnings"]) or "none"  # each opens with its name


ROWS = (
    ("status", _status),
    ("accuracy", _accuracy),
    ("starting model", lambda f: _number(f["initial_accuracy"], ".4f")),
    ("unigram baseline", lambda f: _number(f["unigram_accuracy"], ".4f")),
    ("TFF acc 1/2/3", _tff("model")),  # TFF's three next-word accuracies (TFF_LEGEND)
    ("  unigram", _tff("unigram")),
    ("  frequent word", _tff("most_frequent_word")),
    ("perplexity", lambda f: _number(f["perplexity"], ".1f")),
    ("strip t1/t3/saved", _keyboard("model")),  # top-1 / top-3 recall, keystroke savings
    ("  frequent words", _keyboard("most_frequent_words")),  # the most-frequent-word strip
    ("eps", _epsilon),
    ("  projected eps", _projected),  # a projection run's planned launch (never its guarantee)
    ("rounds done", lambda f: f"{f['rounds_completed']} of {f['rounds_planned']}"),
    ("wall time", lambda f: wall_time(f["wall_seconds"])),
    ("noise", lambda f: f["noise_mechanism"] or "-"),
    ("fully private", _private),
    ("warnings", _warnings),
)


def _value(v: object) -> str:
    if v is _MISSING:
        return "-"  # a key the run's config does not have (an older dpfleet's run)
    return v if isinstance(v, str) else json.dumps(v)


CELL = 56  # the widest a cell is shown; longer text ends in "..." (--json has it whole)


def _fit(text: str) -> str:
    return text if len(text) <= CELL else text[: CELL - 3] + "..."


def _blocks(widths: Sequence[int], room: int) -> list[list[int]]:
    """The runs' column indices cut into consecutive blocks that each fit in `room` characters."""
    blocks: list[list[int]] = [[]]
    used = 0
    for i, w in enumerate(widths):
        if blocks[-1] and used + 2 + w > room:
            blocks.append([])
            used = 0
        blocks[-1].append(i)
        used += 2 + w
    return blocks


def render(result: Mapping, width: int | None = None) -> str:
    """The comparison as a text table: a row per figure, then a row per differing config key, a
    column per run (headed by its folder's name; numbered when two names are alike). Runs that
    would not fit in `width` (default: the terminal's) go on in a second block of columns below,
    the row names repeated."""
    runs = result["runs"]
    names = [Path(f["path"]).name or f["run"] for f in runs]
    heads = names if len(set(names)) == len(names) else [f"{i}:{n}" for i, n in enumerate(names, 1)]
    rows = [("", heads)]
    rows += [(name, [cell(f) for f in runs]) for name, cell in ROWS]
    if result["differing_keys"]:
        rows.append(("config that differs:", [""] * len(runs)))
        rows += [(f"  {k}", [_value(f["config"].get(k, _MISSING)) for f in runs])
                 for k in result["differing_keys"]]
    else:
        rows.append(("config", ["the same in every run"] + [""] * (len(runs) - 1)))
    rows = [(name, [_fit(c) for c in cells]) for name, cells in rows]
    label = max(len(name) for name, _ in rows)
    widths = [max(len(cells[i]) for _, cells in rows) for i in range(len(runs))]
    room = (width or shutil.get_terminal_size((100, 24)).columns) - label
    lines: list[str] = []
    for block in _blocks(widths, room):
        if lines:
            lines.append("")
        lines += ["  ".join([name.ljust(label), *(cells[i].ljust(widths[i]) for i in block)]).rstrip()
                  for name, cells in rows]
    if any(any(v is not None for v in f["tff"]["model"].values()) for f in runs):
        lines.append(TFF_LEGEND)
    if any(f["epsilon_so_far"] for f in runs):
        lines += ["(an unfinished run: accuracy of its last evaluated round,",
                  " eps after its last round, from metrics.jsonl)"]
    return "\n".join(lines)
