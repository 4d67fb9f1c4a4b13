"""The coordinator's read-only status page: one self-contained HTML page with inline SVG charts.

It is served without authentication (`GET /`), so it may show only what the run releases anyway:
DP-released aggregates (accuracy of the released model, eps spent) and counts, next to the held-out
accuracy of the starting model (round 0, before any private round) and of the unigram baseline, and
once the run finished, its suggestion strip's top-3 word recall and keystroke savings on held-out
words next to the most-frequent-word strip's, and TFF's three next-word accuracies of the last
evaluated released model next to the unigram and most-frequent-word baselines'. `render` reads a
fixed list of numeric fields and never prints a mapping key it did not expect, so a status or
history that happened to carry a device id (a per-device map, an id list, an extra field) cannot
leak it through the page. The one text it prints is `caveats` (a list of strings the coordinator
builds from its config alone, `coordinator/run_privacy/caveats.py`), escaped, at the top: a run that
is not fully private says so before any figure. No script, no external asset: the page works offline
and its Content-Security-Policy forbids loading anything.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from html import escape

from aiohttp import web

REFRESH_S = 5
ACCURACY_COLOR = "#1f6fd1"
EPSILON_COLOR = "#d1461f"
BAR_COLOR = "#2a9d5c"
PHASE_COLOR = "#8a4fc7"
FAILED_COLOR = "#c0392b"
# The only words the page prints as labels. Anything else a server sends (a new state, a phase
# this page does not know, or a device id by mistake) is counted under "other", never printed.
DEVICE_COUNTS = ("registered", "waiting", "training", "refused_timer")
DEVICE_STATES = DEVICE_COUNTS + ("offline", "idle", "ineligible", "refused", "selected",
                                 "reporting", "secagg", "dropped", "done")
# the service's phases (service/rounds.py) and SecAgg's (secagg/server.py), shown without "secagg_"
SECAGG_PHASES = ("commit", "keys", "shares", "masked", "consistency", "unmask", "done", "aborted")
PHASES = ("selecting", "select", "training", "report", "committing", "commit", "finished",
          "paused", "idle") + tuple(f"secagg_{p}" for p in SECAGG_PHASES)
_STATES = {"starting", "running", "paused", "stopping", "finished"}


def _num(value: object) -> float | None:
    """A finite number, else None (bools, strings, lists, NaN and inf are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _fmt(value: object, spec: str, none: str = "&ndash;") -> str:
    v = _num(value)
    if v is None:
        return none
    return format(int(v), "d") if spec == "d" else format(v, spec)


def _counts(mapping: object, labels: tuple[str, ...]) -> list[tuple[str, float]]:
    """(label, number) of a {name: number} map in `labels` order; numbers under names outside
    `labels` are summed into "other" (their names are not shown)."""
    if not isinstance(mapping, dict):
        return []
    known = {k: _num(v) for k, v in mapping.items() if k in labels}
    other = [_num(v) for k, v in mapping.items() if k not in labels]
    out = [(k, known[k]) for k in labels if known.get(k) is not None]
    if any(v is not None for v in other):
        out.append(("other", sum(v for v in other if v is not None)))
    return out


def _histogram(mapping: object, max_times: int) -> list[tuple[str, float]]:
    """{"<times>": devices} sorted by times; a key that cannot be a participation count (not an
    integer in 0..max_times, where max_times is the number of rounds) is dropped, not shown."""
    if not isinstance(mapping, dict):
        return []
    out = []
    for k, v in mapping.items():
        n = _num(v)
        if isinstance(k, str) and k.isascii() and k.isdigit() and int(k) <= max_times \
                and n is not None:
            out.append((int(k), n))
    return [(str(k), n) for k, n in sorted(out)]


def format_duration(seconds: object) -> str:
    """3725 -> '1h 02m 05s'; 65 -> '1m 05s'; not a number -> '-'."""
    s = _num(seconds)
    if s is None or s < 0:
        return "-"
    s = int(s)
    return f"{s // 3600}h {s % 3600 // 60:02d}m {s % 60:02d}s" if s >= 3600 else \
        f"{s // 60}m {s % 60:02d}s"


def _ticks(lo: float, hi: float) -> list[float]:
    if hi <= lo:
        return [lo]
    return [lo + (hi - lo) * i / 4 for i in range(5)]


def _line_chart(title: str, points: list[tuple[float, float]], color: str, yfmt: str,
                failed: list[float] = (), width: int = 540, height: int = 210) -> str:
    left, right, top, bottom = 56, 14, 30, 34
    w, h = width - left - right, height - top - bottom
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'role="img" aria-label="{escape(title)}"><text x="{left}" y="18" class="t">'
            f'{escape(title)}</text>')
    if not points:
        return head + f'<text x="{left + 10}" y="{top + h / 2}" class="m">no rounds yet</text></svg>'
    xs, ys = [p[0] for p in points] + list(failed), [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(0.0, min(ys)), max(ys)
    if y1 <= y0:
        y1 = y0 + 1.0
    if x1 <= x0:
        x0, x1 = x0 - 1, x1 + 1

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * w

    def sy(y: float) -> float:
        return top + h - (y - y0) / (y1 - y0) * h

    parts = [head, f'<rect x="{left}" y="{top}" width="{w}" height="{h}" class="bg"/>']
    for t in _ticks(y0, y1):
        parts.append(f'<line x1="{left}" x2="{left + w}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" '
                     f'class="g"/><text x="{left - 6}" y="{sy(t) + 4:.1f}" class="yl">'
                     f'{format(t, yfmt)}</text>')
    for t in sorted({round(v) for v in _ticks(x0, x1)}):
        parts.append(f'<text x="{sx(t):.1f}" y="{top + h + 16}" class="xl">{t:d}</text>')
    parts.append(f'<text x="{left + w / 2}" y="{height - 2}" class="xl">round</text>')
    path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
    parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="3" '
                 'stroke-linejoin="round"/>')
    parts += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3.5" fill="{color}"/>'
              for x, y in points]
    parts += [f'<path d="M{sx(x) - 4:.1f},{top + h - 8} l8,8 m0,-8 l-8,8" stroke="{FAILED_COLOR}" '
              'stroke-width="2"/>' for x in failed]
    if failed:
        parts.append(f'<text x="{left + w}" y="18" class="yl" fill="{FAILED_COLOR}">'
                     f'&#215; failed round</text>')
    return "".join(parts) + "</svg>"


def bar_label(name: str) -> str:
    """A bar's label: a SecAgg phase without its "secagg_" prefix, unless the service has a phase
    of that name (its "commit", the DP step, and SecAgg's commitment phase): "SecAgg commit"."""
    short = name.removeprefix("secagg_")
    if short != name and short in PHASES:
        return f"SecAgg {short}"
    return short


def _bar_chart(title: str, bars: list[tuple[str, float]], color: str, xlabel: str,
               vfmt: str = "d", width: int = 540, height: int = 210) -> str:
    left, right, top, bottom = 56, 14, 30, 40
    w, h = width - left - right, height - top - bottom
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'role="img" aria-label="{escape(title)}"><text x="{left}" y="18" class="t">'
             f'{escape(title)}</text>']
    if not bars:
        parts.append(f'<text x="{left + 10}" y="{top + h / 2}" class="m">nothing yet</text></svg>')
        return "".join(parts)
    top_v = max(max(v for _, v in bars) * 1.15, 1e-12)  # room for the value above the bar
    slot = w / len(bars)
    parts.append(f'<rect x="{left}" y="{top}" width="{w}" height="{h}" class="bg"/>')
    for i, (label, v) in enumerate(bars):
        bh = v / top_v * h
        x = left + i * slot + slot * 0.15
        parts.append(f'<rect x="{x:.1f}" y="{top + h - bh:.1f}" width="{slot * 0.7:.1f}" '
                     f'height="{bh:.1f}" fill="{color}"/>'
                     f'<text x="{x + slot * 0.35:.1f}" y="{top + h - bh - 4:.1f}" class="xl">'
                     f'{_fmt(v, vfmt)}</text>'
                     f'<text x="{x + slot * 0.35:.1f}" y="{top + h + 15}" class="xl">'
                     f'{escape(bar_label(label))}</text>')
    parts.append(f'<text x="{left + w / 2}" y="{height - 4}" class="xl">{escape(xlabel)}</text>')
    return "".join(parts) + "</svg>"


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:18px 24px;color:#1d2330;background:#f6f7f9}
h1{font-size:20px;margin:0 0 4px}.sub{color:#5a6272;margin-bottom:14px}
.caveat{background:#fdecea;border:1px solid #c0392b;border-radius:6px;padding:4px 14px;margin-bottom:14px}
.caveat p:first-child{font-weight:bold}
.kpis{display:flex;flex-wrap:wrap;gap:10px;margin-bottom:14px}
.k{background:#fff;border:1px solid #dde1e8;border-radius:6px;padding:8px 14px;min-width:120px}
.k b{display:block;font-size:22px}.k span{color:#5a6272;font-size:12px}
.charts{display:flex;flex-wrap:wrap;gap:12px}
svg{background:#fff;border:1px solid #dde1e8;border-radius:6px}
.t{font-weight:600;font-size:13px;fill:#1d2330}.m{fill:#8a92a2}
.bg{fill:#fbfcfd}.g{stroke:#e3e6eb}.yl{font-size:11px;fill:#5a6272;text-anchor:end}
.xl{font-size:11px;fill:#5a6272;text-anchor:middle}
.state{display:inline-block;padding:1px 8px;border-radius:10px;background:#e4ecfa;font-weight:600}
.failed{color:""" + FAILED_COLOR + "}"


def render(status: dict, history: dict, refresh_s: int = REFRESH_S) -> str:
    """The status page for a public status and history (protocol.md shapes)."""
    status = status if isinstance(status, dict) else {}
    history = history if isinstance(history, dict) else {}
    state = status.get("run_state")
    state = state if isinstance(state, str) and state in _STATES else "unknown"
    phase = status.get("phase")
    phase = "&ndash;" if phase is None else phase if isinstance(phase, str) and phase in PHASES \
        else "other"
    rounds = [r for r in history.get("rounds", []) if isinstance(r, dict)] \
        if isinstance(history.get("rounds"), list) else []
    acc = [(r, a) for r, a in ((_num(x.get("round")), _num(x.get("accuracy"))) for x in rounds)
           if r is not None and a is not None]
    start = _num(status.get("initial_accuracy"))  # round 0: the starting model
    acc = ([] if start is None else [(0.0, start)]) + acc
    failed = [r for r in (_num(x.get("round")) for x in rounds
                          if x.get("status") == "failed") if r is not None]
    eps = [(r, e) for r, e in ((_num(x.get("round")), _num(x.get("epsilon"))) for x in rounds)
           if r is not None and e is not None]
    devices = [(k, v) for k, v in _counts(status.get("devices"), DEVICE_COUNTS) if k != "other"]
    states = _counts(history.get("device_states"), DEVICE_STATES) \
        or [d for d in devices if d[0] != "registered"]
    phases = _counts(status.get("phase_seconds"), PHASES)
    max_times = max([len(rounds)] + [int(v) for v in (_num(status.get("rounds_planned")),
                                                      _num(status.get("round"))) if v is not None])
    delta = _fmt(status.get("delta"), "g")
    n_failed = _num(status.get("rounds_failed"))
    kpis = [
        ("rounds committed", _fmt(status.get("rounds_committed"), "d"),
         f"of {_fmt(status.get('rounds_planned'), 'd')} planned"),
        ("rounds failed", _fmt(status.get("rounds_failed"), "d"), "accounted, not released"),
        ("eps spent so far", _fmt(status.get("epsilon"), ".3f"), f"at delta {delta}"),
        ("last accuracy", _fmt(status.get("last_accuracy"), ".4f"), "held-out, released model"),
        ("starting model", _fmt(start, ".4f"), "accuracy at round 0: no privacy cost"),
        ("unigram baseline", _fmt(status.get("unigram_accuracy"), ".4f"), "accuracy, word frequencies"),
        ("top-3 word recall", _fmt(status.get("top3_recall"), ".3f"),
         f"suggestion strip; most frequent words {_fmt(status.get('baseline_top3_recall'), '.3f')}"),
        ("keystrokes saved", _fmt(status.get("keystroke_savings"), ".3f"),
         f"suggestion strip; most frequent words {_fmt(status.get('baseline_keystroke_savings'), '.3f')}"),
        *_tff_kpis(status.get("tff")),
        ("round", _fmt(status.get("round"), "d"), f"phase {phase}"),
        ("devices", _fmt(dict(devices).get("registered"), "d"), "registered"),
    ]
    kpi_html = "".join(
        f'<div class="k"><span>{t}</span><b{" class=failed" if t == "rounds failed" and n_failed else ""}>'
        f"{v}</b><span>{sub}</span></div>" for t, v, sub in kpis)
    charts = [
        _line_chart("held-out accuracy per round", acc, ACCURACY_COLOR, ".3f", failed),
        _line_chart("eps spent after each round", eps, EPSILON_COLOR, ".2f", failed),
        _bar_chart("participation: devices by rounds taken part in",
                   _histogram(history.get("participation_histogram"), max_times), BAR_COLOR, "rounds"),
        _bar_chart("device states (counts)", states, BAR_COLOR, "state"),
        _bar_chart("mean seconds per phase", phases, PHASE_COLOR, "phase (SecAgg: keys ... unmask)",
                   vfmt=".2f"),
    ]
    refresh = max(1, int(refresh_s))
    return (
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        f'<meta http-equiv="refresh" content="{refresh}">'
        "<title>dpfleet coordinator</title>"
        f"<style>{_CSS}</style></head><body>{_caveats(status.get('caveats'))}"
        f'<h1>dpfleet coordinator <span class="state">{state}</span></h1>'
        f'<div class="sub">up {format_duration(status.get("uptime_s"))} &middot; refreshes every '
        f"{refresh} s &middot; only DP-released aggregates and counts are shown</div>"
        f'<div class="sub">{escape(str(status.get("release") or ""))}</div>'  # serve --policy's verdict
        f'<div class="kpis">{kpi_html}</div><div class="charts">{"".join(charts)}</div>'
        "</body></html>"
    )


# TFF's three next-word accuracies (`field_metrics.tff_figures`), as the page titles them
TFF_TITLES = (("accuracy", "next-word accuracy (TFF)"),
              ("accuracy_without_out_of_vocab", "without OOV (TFF)"),
              ("accuracy_without_out_of_vocab_or_end_of_sentence", "without OOV or EOS (TFF)"))


def _tff_kpis(tff: object) -> list[tuple[str, str, str]]:
    """One box per TFF accuracy: the released model's, the two baselines' below it; dashes
    for what the status lacks (no round evaluated yet, a field that is not a number)."""
    def figure(strip: str, name: str) -> str:
        figures = tff.get(strip) if isinstance(tff, dict) else None
        return _fmt(figures.get(name) if isinstance(figures, dict) else None, ".4f")

    return [(title, figure("model", name), f"released model; unigram {figure('unigram', name)}, "
                                           f"most frequent word {figure('most_frequent_word', name)}")
            for name, title in TFF_TITLES]


def _caveats(caveats: object) -> str:
    """The run's caveats (`coordinator/run_privacy/caveats.py`), above everything else: a run that
    is not fully private says so first. Only a list of strings is shown, each escaped."""
    if not isinstance(caveats, list):
        return ""
    lines = [f"<p>{escape(c)}</p>" for c in caveats if isinstance(c, str)]
    return f'<div class="caveat" role="alert">{"".join(lines)}</div>' if lines else ""


async def _call(provider: Callable[[], object]) -> dict:
    out = provider()
    if inspect.isawaitable(out):
        out = await out
    return out if isinstance(out, dict) else {}


CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"


def add_status_routes(app: web.Application, public_status: Callable[[], object],
                      public_history: Callable[[], object]) -> None:
    """Serve the page at `GET /`; the providers (plain or async callables) return the public
    status and history dicts each time the page is asked for."""

    async def page(request: web.Request) -> web.Response:
        html = render(await _call(public_status), await _call(public_history))
        return web.Response(text=html, content_type="text/html", charset="utf-8", headers={
            "Cache-Control": "no-store", "Content-Security-Policy": CSP,
            "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"})

    app.router.add_get("/", page)
