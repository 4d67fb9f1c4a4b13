"""A seeded generator of realistic availability traces, vectorised up to 10^6 devices.

What it reproduces (and why each part):
* Diurnal: a phone trains only while charging, idle and on unmetered Wi-Fi (Bonawitz et al.
  2019), which mostly happens at night in its own time zone; most sessions open around
  `night_start` local time and last hours, a minority are short daytime top-ups.
* Bursty: availability comes in sessions (a charge on Wi-Fi), not as independent coin flips per
  slot; overlapping sessions of one device merge.
* Heterogeneous: each device has an availability propensity drawn heavy-tailed (LogNormal,
  mean 1), scaling both how often and how long it is available, so a minority does most of the
  work (FLASH: the top 30% of clients did 86% of it); a speed class; a failure chance around
  1 in 10 (FLASH: more than 10% of clients fail).

Memory: devices are drawn in fixed chunks of `CHUNK`, each from its own seeded stream
([seed, chunk]), so the temporaries are bounded by one chunk and the result (a `Trace`) is
proportional to the devices; the same seed gives the same trace (and the same file bytes).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from dpfleet.edge.traces import SPEED_CLASSES, Header, Trace
from dpfleet.errors import DpfleetError
from dpfleet.progress import progress_bar

CHUNK = 16_384  # devices per draw; part of the seed's meaning (do not change lightly)


@dataclass(frozen=True)
class GeneratorSettings:
    """The generator's knobs; the defaults give a FLASH-like population."""

    sessions_per_day: float = 1.2  # mean sessions per device per day (before merging)
    propensity_sigma: float = 1.4  # LogNormal sigma of the per-device propensity (the heavy tail)
    night_share: float = 0.75  # share of sessions that are the nightly charge
    night_start: float = 22.5  # local hour the nightly session opens, on average
    night_start_sd: float = 1.5  # hours
    night_hours: float = 4.0  # median length of a nightly session
    day_hours: float = 0.4  # median length of a daytime session
    length_sigma: float = 0.6  # LogNormal sigma of session lengths
    timezone_spread: float = 6.0  # devices' UTC offsets, uniform over this many hours
    speed_shares: tuple[float, float, float] = (0.25, 0.5, 0.25)  # fast, mid, slow
    failure_mean: float = 0.1  # mean of the per-device failure chance (Beta(1, 9) by default)

    def check(self) -> None:
        for name, value in asdict(self).items():
            if name == "speed_shares":
                continue
            if not math.isfinite(value) or value < 0:
                raise DpfleetError(f"trace generator: {name} must be a finite number >= 0, not {value}")
        if not 0 <= self.night_share <= 1:
            raise DpfleetError(f"trace generator: night_share must be in [0, 1], not {self.night_share}")
        if not 0 < self.failure_mean < 1:
            raise DpfleetError(f"trace generator: failure_mean must be in (0, 1), not {self.failure_mean}")
        shares = self.speed_shares
        if len(shares) != len(SPEED_CLASSES) or min(shares) < 0 or not math.isclose(sum(shares), 1.0):
            raise DpfleetError(f"trace generator: speed_shares must be {len(SPEED_CLASSES)} shares "
                               f"summing to 1, not {shares}")


def generate(devices: int, days: float, seed: int, settings: GeneratorSettings | None = None,
             start_hour: float = 0.0, progress: bool = False) -> Trace:
    """A trace of `devices` devices over `days` days (t = 0 at UTC hour `start_hour`)."""
    s = settings or GeneratorSettings()
    s.check()
    if devices < 1:
        raise DpfleetError(f"trace generator: devices must be >= 1, not {devices}")
    if not 0 < days < math.inf:
        raise DpfleetError(f"trace generator: days must be > 0, not {days}")
    if not math.isfinite(start_hour):
        raise DpfleetError(f"trace generator: start_hour must be an hour of day, not {start_hour}")
    start_hour %= 24.0
    duration = float(round(days * 86400.0))
    parts = []
    chunks = range(0, devices, CHUNK)
    bar = progress_bar(chunks, desc="generating", unit="chunk", enabled=progress, leave=False)
    for index, first in enumerate(bar):
        n = min(CHUNK, devices - first)
        parts.append(_chunk(np.random.default_rng([seed, index]), n, duration, start_hour, s))
    counts = np.concatenate([p[0] for p in parts])
    offsets = np.zeros(devices + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    cat = lambda i, dtype: np.concatenate([p[i] for p in parts]).astype(dtype, copy=False)  # noqa: E731
    source = f"dpfleet trace generate --devices {devices} --days {days:g} --seed {seed}"
    return Trace(Header(duration, start_hour, devices, source), offsets, cat(1, np.float64),
                 cat(2, np.float64), cat(3, np.uint8), cat(4, np.float32), np.zeros(devices))


def _chunk(rng: np.random.Generator, n: int, duration: float, start_hour: float,
           s: GeneratorSettings) -> tuple[np.ndarray, ...]:
    """(interval count, starts, ends, speed, failure) of `n` devices from `rng`."""
    days = duration / 86400.0
    propensity = rng.lognormal(-s.propensity_sigma ** 2 / 2, s.propensity_sigma, n)  # mean 1
    tz = rng.uniform(-s.timezone_spread / 2, s.timezone_spread / 2, n)
    speed = rng.choice(len(SPEED_CLASSES), size=n, p=s.speed_shares).astype(np.uint8)
    failure = np.round(rng.beta(1.0, (1 - s.failure_mean) / s.failure_mean, n), 3).astype(np.float32)
    # a day more than the trace on each side: sessions that open before t = 0 or late run into it
    span = math.ceil(days) + 2
    sessions = rng.poisson(s.sessions_per_day * span * propensity)
    device = np.repeat(np.arange(n), sessions)
    m = len(device)
    day = rng.integers(-1, span - 1, m)
    night = rng.random(m) < s.night_share
    local = np.where(night, rng.normal(s.night_start, s.night_start_sd, m), rng.uniform(7.0, 21.0, m))
    hours = np.where(night, s.night_hours, s.day_hours) * rng.lognormal(0.0, s.length_sigma, m)
    hours *= propensity[device] ** 0.25  # the keen devices also stay longer
    start = np.round((day * 24.0 + local - tz[device] - start_hour) * 3600.0)
    end = np.minimum(start + np.round(hours * 3600.0), duration)
    start = np.maximum(start, 0.0)
    keep = end > start
    device, start, end = device[keep], start[keep], end[keep]
    device, start, end = _merge(device, start, end)
    return np.bincount(device, minlength=n), start, end, speed, failure


def _merge(device: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, ...]:
    """Sort each device's intervals and merge those that overlap or touch (vectorised: a running
    maximum of the ends, reset per device by an offset larger than any time)."""
    order = np.lexsort((start, device))
    device, start, end = device[order], start[order], end[order]
    if not len(device):
        return device, start, end
    big = float(end.max()) + 1.0
    reach = np.maximum.accumulate(end + device * big) - device * big  # furthest end so far, per device
    opens = np.ones(len(device), dtype=bool)
    opens[1:] = (device[1:] != device[:-1]) | (start[1:] > reach[:-1])
    first = np.flatnonzero(opens)
    last = np.append(first[1:], len(device)) - 1
    return device[first], start[first], reach[last]
