"""The coordinator's public status page: what it shows, what it must never show, and that a real
browser (headless Chromium) draws it."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import urllib.request

import pytest
from admin_standin import DEVICE_IDS, StandInCoordinator, sample_history, sample_status
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dpfleet.service.status_page import (
    ACCURACY_COLOR,
    DEVICE_STATES,
    EPSILON_COLOR,
    FAILED_COLOR,
    PHASES,
    render,
)


def test_page_shows_the_numbers_and_refreshes():
    html = render(sample_status(), sample_history())
    text = re.sub(r"<[^>]+>", " ", html)  # the visible text
    assert re.search(r"rounds committed\s+7\s+of 20 planned", text)
    assert re.search(r"rounds failed\s+1\b", text)
    assert re.search(r"eps spent so far\s+2\.718\s+at delta 1e-06", text)
    assert re.search(r"last accuracy\s+0\.1044", text)
    assert re.search(r"devices\s+1000\s+registered", text)
    assert re.search(r"412\s+waiting\s+100\s+training\s+37\s+refused_timer\s+451\s+offline", text)
    assert "phase secagg_shares" in text
    assert re.search(r"0\.12\s+select\s+1\.50\s+keys\s+0\.80\s+shares\s+3\.25\s+masked", text)
    assert '<meta http-equiv="refresh" content="5">' in html
    # each chart is there, and the accuracy line goes through one point per committed round
    for title in ("held-out accuracy per round", "eps spent after each round",
                  "participation: devices by rounds taken part in", "device states (counts)",
                  "mean seconds per phase"):
        assert f'aria-label="{title}"' in html
    assert html.count(f'fill="{ACCURACY_COLOR}"') == 7  # 8 rounds, round 5 failed
    assert html.count(f'fill="{EPSILON_COLOR}"') == 8
    assert html.count(f'stroke="{FAILED_COLOR}"') == 2  # round 5 marked failed on both lines
    # self-contained: no script, no external resource
    assert "<script" not in html.lower()
    assert not re.search(r"""(src|href)\s*=|url\(|@import""", html)


def test_empty_run_renders():
    html = render({}, {})
    assert "no rounds yet" in html and "nothing yet" in html and "unknown" in html


def _planted(status: dict, history: dict, ids: list[str]) -> tuple[dict, dict]:
    """The same status/history with device ids hidden where a careless server might put them:
    extra fields, id lists in rounds, per-device maps."""
    s, h = copy.deepcopy(status), copy.deepcopy(history)
    s["selected"] = ids
    s["last_device"] = ids[0]
    s["devices"]["by_id"] = {i: "training" for i in ids}
    s["devices"][ids[0]] = 1
    for r in h["rounds"]:
        r["devices"] = list(ids)
        r["worst_device"] = ids[0]
    h["participation_histogram"][ids[0]] = 3
    h["per_device"] = {i: {"participations": 2} for i in ids}
    return s, h


LABELS = set(DEVICE_STATES + PHASES) | {"other"}
_ID = st.text(alphabet=st.characters(codec="utf-8", categories=("L", "N", "P")), min_size=6,
              max_size=24).filter(lambda t: not t.isdigit() and t not in LABELS)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(_ID, min_size=1, max_size=4, unique=True))
def test_device_ids_never_reach_the_page(ids):
    """Planting ids anywhere in the input leaves the page byte-for-byte unchanged; where they
    key a count map (device states, phase times) only an "other" bar appears, not the id."""
    status, history = sample_status(), sample_history()
    clean = render(status, history)
    # an "id" that is a piece of the page's own markup ("#2a9d5", of a bar colour) is counted
    # again with every bar an "other" adds: not a leak, and no id looks like that
    assume(all(i not in clean for i in ids))
    assert render(*_planted(status, history, ids)) == clean
    for i in DEVICE_IDS:
        assert render(*_planted(status, history, [i])) == clean and i not in clean
    s, h = copy.deepcopy(status), copy.deepcopy(history)
    s["phase"] = ids[0]
    for n, i in enumerate(ids):
        s["phase_seconds"][i] = 1.0 + n
        h["device_states"][i] = 5 + n
    html = render(s, h)
    assert all(html.count(i) == clean.count(i) for i in ids)
    assert ">other<" in html and "phase other" in html


def test_numeric_ids_are_not_participation_counts():
    """A numeric device id used as a histogram key is not a count of rounds: it is dropped."""
    status, history = sample_status(), sample_history()
    history["participation_histogram"]["418231"] = 1
    history["participation_histogram"]["21"] = 1  # more than the 20 planned rounds
    assert render(status, history) == render(sample_status(), sample_history())


@settings(max_examples=60, deadline=None)
@given(value=st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.integers(),
                       st.text(max_size=30).map(lambda t: "<i>X" + t),
                       st.lists(st.integers(), max_size=3)))
def test_any_field_value_renders_escaped(value):
    """A malformed value (None, NaN, inf, a string with markup) never breaks or injects."""
    status, history = sample_status(), sample_history()
    for key in ("run_state", "phase", "epsilon", "round", "uptime_s", "devices"):
        status[key] = value
    history["rounds"][0]["accuracy"] = value
    history["participation_histogram"]["2"] = value
    html = render(status, history)
    assert html.startswith("<!doctype html>") and html.endswith("</html>")
    assert "<i>X" not in html  # a string never lands unescaped (nor at all)
    assert "nan" not in re.sub(r"<[^>]+>", " ", html).lower().split()


def test_served_without_auth_with_a_strict_policy():
    with StandInCoordinator() as coord, urllib.request.urlopen(coord.url + "/", timeout=10) as resp:
        body = resp.read().decode()
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/html")
        assert "default-src 'none'" in resp.headers["Content-Security-Policy"]
        assert resp.headers["Cache-Control"] == "no-store"
    assert body == render(coord.status, coord.history)
    assert not any(i in body for i in DEVICE_IDS)


def _chromium() -> str | None:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None and os.environ.get("DPFLEET_REQUIRE_CHROMIUM") == "1":
        pytest.fail("chromium is required here (DPFLEET_REQUIRE_CHROMIUM=1) but not installed")
    return path


def _rgb(hex_color: str) -> tuple[int, int, int]:
    return tuple(int(hex_color[i:i + 2], 16) for i in (1, 3, 5))


def test_screenshot_in_headless_chromium(tmp_path):
    chromium = _chromium()
    if chromium is None:
        pytest.skip("chromium not installed (apt-get install chromium); CI requires it")
    from PIL import Image

    shot = tmp_path / "status.png"
    with StandInCoordinator() as coord:
        proc = subprocess.run(
            [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}",
             "--hide-scrollbars", f"--screenshot={shot}", "--window-size=1200,900", coord.url + "/"],
            capture_output=True, text=True, timeout=180)
        html = render(coord.status, coord.history)
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 900)
    pixels = list(image.get_flattened_data())
    assert len(set(pixels)) > 200  # not blank: text, charts, anti-aliasing
    for color in (ACCURACY_COLOR, EPSILON_COLOR):
        assert pixels.count(_rgb(color)) > 100, f"the {color} line is not on screen"
    # what the browser drew is this page, with the run's numbers and no device id
    assert ">7<" in html and ">2.718<" in html
    assert not any(i in html for i in DEVICE_IDS)


def test_phase_bars_have_unique_labels():
    """The service's commit (the DP step) and SecAgg's commit phase are two bars: two labels."""
    status = {**sample_status(), "phase_seconds": {p: 1.0 + i for i, p in enumerate(PHASES)}}
    html = render(status, sample_history())
    chart = html[html.index('aria-label="mean seconds per phase"'):]
    chart = chart[:chart.index("</svg>")]
    texts = re.findall(r'class="xl">([^<]*)</text>', chart)
    labels = texts[1:-1:2]  # each bar: its value, then its label; last, the axis label
    assert len(labels) == len(PHASES)
    assert len(set(labels)) == len(labels), sorted(labels)
    assert "commit" in labels and "SecAgg commit" in labels


TFF = ("accuracy", "accuracy_without_out_of_vocab", "accuracy_without_out_of_vocab_or_end_of_sentence")


def test_the_status_shows_the_last_evaluated_rounds_tff_accuracies(tmp_path):
    """A booted service (no devices, so fast): before any round the model's TFF accuracies are
    dashes and the baselines' are those fitted at boot; then the status follows the last metrics
    record that has them (an engine evaluation of the model, as a round's commit records it),
    skipping a later round that was not evaluated."""
    from service_fleet import tiny_cfg

    from dpfleet.service.admin import public_status
    from dpfleet.service.boot import boot
    from dpfleet.service.rounds import HttpCollector
    from dpfleet.service.servelog import ServiceLog

    booted = boot(tiny_cfg(rounds=2), tmp_path / "state", log=lambda s: None)
    log = ServiceLog(tmp_path / "service.log")
    try:
        driver = HttpCollector(booted, log)
        before = public_status(driver)
        evaluated = {k: v for k, v in booted.engine.evaluate().items() if k.startswith("tff_")}
        booted.engine.metrics += [{"round": 1, **evaluated}, {"round": 2, "accuracy": None}]
        after = public_status(driver)
    finally:
        log.close()
        booted.store.close()
    baselines = {s: {n: booted.baseline["tff"][s][n] for n in TFF} for s in ("unigram", "most_frequent_word")}
    assert before["tff"] == {"model": {n: None for n in TFF}, **baselines}
    assert after["tff"] == {"model": {n: evaluated[f"tff_{n}"] for n in TFF}, **baselines}
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", render(before, {"rounds": []})))
    assert (f"without OOV or EOS (TFF) &ndash; released model; unigram "
            f"{baselines['unigram'][TFF[2]]:.4f}, most frequent word ") in text


@pytest.mark.slow
def test_a_served_run_shows_the_tff_accuracies_next_to_the_baselines(tmp_path):
    """A real served run (one round, real devices over loopback): the public status carries TFF's
    three accuracies of the released model (its metrics record's, the same as summary.json's
    final) and the unigram and most-frequent-word baselines' (summary.json's), and the page
    shows each; before any round the model's are dashes."""
    import asyncio
    import json

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from service_fleet import fleet_data, run_devices, tiny_cfg
    from test_service_security import raw

    from dpfleet.service.server import shutdown, start

    cfg = tiny_cfg(rounds=1, eval_every=1)
    users, examples = fleet_data(cfg, tmp_path / "fleet")
    keys = {u: Ed25519PrivateKey.generate() for u in users}

    async def main():
        running = await start(cfg, tmp_path / "state", log=lambda s: None)
        before = json.loads((await raw(running.url, "GET", "/v1/public/status"))[1])
        devices = asyncio.create_task(run_devices(running.url, keys, examples))
        await asyncio.wait_for(asyncio.shield(running.task), 120)
        public = json.loads((await raw(running.url, "GET", "/v1/public/status"))[1])
        page = (await raw(running.url, "GET", "/"))[1].decode()
        await asyncio.wait_for(devices, 30)
        await shutdown(running)
        return before, public, page

    before, public, page = asyncio.run(main())
    summary = json.loads((tmp_path / "state" / "summary.json").read_text())
    (record,) = [json.loads(line) for line in (tmp_path / "state" / "metrics.jsonl").read_text().splitlines()]
    assert before["tff"]["model"] == {n: None for n in TFF}
    assert public["tff"]["model"] == {n: record[f"tff_{n}"] for n in TFF} == {
        n: summary["final"][f"tff_{n}"] for n in TFF}
    for strip in ("unigram", "most_frequent_word"):
        assert public["tff"][strip] == {n: summary["unigram_baseline"]["tff"][strip][n] for n in TFF}
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page))  # the visible text
    for title, n in zip(("next-word accuracy (TFF)", "without OOV (TFF)", "without OOV or EOS (TFF)"),
                        TFF, strict=True):
        tff = public["tff"]
        assert (f"{title} {tff['model'][n]:.4f} released model; unigram {tff['unigram'][n]:.4f}, "
                f"most frequent word {tff['most_frequent_word'][n]:.4f}") in text
