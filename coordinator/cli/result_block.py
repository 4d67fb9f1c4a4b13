"""The lines a finished run ends with on the console: `dpfleet simulate` and `dpfleet service
serve` print the same block, so a result below the unigram baseline, a run that is not fully
private, or eps above the warning level is said where the user looks, not only in summary.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from dpfleet.coordinator.engine.field_metrics import TFF_ACCURACIES, tff_figures

LABEL = 22  # the label column's width


def result_lines(*, final: dict, baseline: dict, privacy: dict, warnings: list[str] | tuple[str, ...],
                 stopped_early: str | None, run_dir: Path, initial: dict | None = None,
                 keyboard: dict | None = None, tff: dict | None = None) -> list[str]:
    """The result block of a finished run: caveats first (a run that is not fully private says
    so, `caveats.py`), then the warnings of a result that means nothing (`result_warnings.py`),
    accuracy and perplexity next to the starting model's (`initial`, round 0) and the unigram
    baseline's, TFF's three next-word accuracies next to the unigram and most-frequent-word
    baselines' (`tff`: `field_metrics.tff_figures`, by default read off `final` and `baseline`),
    the keyboard's suggestion strip next to the most-frequent-word strip (`keyboard`:
    summary.json's block, `keyboard_eval`), eps and the noise, where the run is."""
    p = privacy
    lines = [_row("WARNING", line) for line in p.get("caveats", [])]
    lines += [_row("WARNING", line) for line in warnings]
    start = initial or {}  # round 0 (an older run has none)
    acc0, ppl0 = (("", "") if start.get("accuracy") is None else
                  (f"starting model {_f(start['accuracy'], '.4f')}   ",
                   f"starting model {_f(start.get('perplexity'), '.1f')}   "))
    lines.append(_row("next-token accuracy", f"model {_f(final['accuracy'], '.4f')}   {acc0}unigram "
                                             f"baseline {_f(baseline['accuracy'], '.4f')}"))
    lines.append(_row("perplexity", f"model {_f(final['perplexity'], '.1f')}   {ppl0}unigram baseline "
                                    f"{_f(baseline['perplexity'], '.1f')}"))
    if acc0:  # where the accuracy comes from: what the private rounds added to it
        lines.append(_row("starting model", "round 0, before any private round (the init, after public "
                                            "pretraining if any): no privacy cost"))
    lines += tff_lines(tff or tff_figures(final, baseline))
    if keyboard and keyboard.get("model"):
        lines.append(_row("word suggestions", keyboard_text(keyboard)))
    mins = "n/a" if p["min_separation"] is None else p["min_separation"]
    own = "this run's own guarantee; " if "projection" in p else ""
    lines.append(_row("privacy", (
        f"eps = {_f(p['epsilon'], '.2f')} at delta = {p['delta']:g} "
        f"({own}{'RDP' if p.get('method') == 'rdp' else 'PLD'}; "
        f"zCDP {_f(p['zcdp'], '.4g')}, noise multiplier {_f(p['noise_multiplier'], 'g')}, "
        f"observed MinS {mins}, MaxP {p['max_participation']}; see privacy_report.md)")))
    if "projection" in p:  # the planned launch's eps, under its label (`run_privacy/projection.py`)
        q = p["projection"]
        lines.append(_row("projected", f"eps = {_f(q['epsilon'], '.2f')} at delta = {q['delta']:g} "
                                       f"({q['label']}: cohort {q['noise_cohort']:,})"))
    lines.append(_row("noise", p["noise_mechanism"]))
    if "total_with_vocabulary" in p:
        t = p["total_with_vocabulary"]
        lines.append(_row("with DP vocabulary", f"eps = {_f(t['epsilon'], '.2f')} at delta = "
                                                f"{t['delta']:.3g} (vocabulary + training; see "
                                                "privacy_report.md)"))
    if p.get("debug_nonprivate_file"):
        lines.append("debug_nonprivate.jsonl holds un-noised client telemetry, outside the guarantee")
    if stopped_early:
        lines.append(_row("stopped early", stopped_early))
    lines.append(_row("run directory", str(run_dir)))
    return lines


def saved_result_lines(run_dir: Path) -> list[str]:
    """`result_lines` of a finished run read back from its summary.json and privacy.json: for
    `fleet run`, whose coordinator ran in another process."""
    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    return result_lines(final=summary["final"], baseline=summary["unigram_baseline"],
                        privacy=json.loads((run_dir / "privacy.json").read_text()),
                        warnings=summary.get("warnings", []),
                        stopped_early=summary.get("stopped_early"), run_dir=run_dir,
                        initial=summary.get("initial"), keyboard=summary.get("keyboard"))


TFF_NAMES = {"model": "model", "unigram": "unigram", "most_frequent_word": "most frequent word"}


def tff_lines(tff: dict) -> list[str]:
    """TFF's three accuracies of the model and of the baselines that have them, and what the
    three are; nothing for a run without them (an older dpfleet)."""
    cells = [f"{TFF_NAMES[strip]} " + " / ".join("-" if v is None else format(v, ".4f")
                                                 for v in (figures[n] for n in TFF_ACCURACIES))
             for strip, figures in tff.items() if any(v is not None for v in figures.values())]
    if not any(v is not None for v in tff["model"].values()):
        return []
    return [_row("TFF next-word acc.", "   ".join(cells)),
            _row("", "(TFF: accuracy / without out of vocab / without out of vocab or end of sentence, "
                     "over non-PAD targets)")]


def keyboard_text(keyboard: dict) -> str:
    """The strip's figures: the model's, then the most-frequent-word strip's, on the same words."""
    def figures(strip: dict) -> str:
        return (f"top-1 {_f(strip.get('top1_recall'), '.3f')} top-3 {_f(strip.get('top3_recall'), '.3f')} "
                f"keys saved {_f(strip.get('keystroke_savings'), '.3f')}")

    text = f"model {figures(keyboard['model'])}"
    if keyboard.get("most_frequent_words"):
        text += f"   most frequent words {figures(keyboard['most_frequent_words'])}"
    return f"{text} ({keyboard.get('words')} held-out words)"


def _f(value: float | None, spec: str) -> str:
    """A figure; None is how the run's JSON writes a non-finite one (eps without noise: inf)."""
    return "inf" if value is None else format(value, spec)


def _row(label: str, text: str) -> str:
    return f"{label:<{LABEL}}{text}"
