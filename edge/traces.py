"""Availability traces: when each device may train, how fast it is, how often it fails.

A trace is a plain-text file (docs/traces.md): JSON Lines, a header line, then one line per device

    {"format": "dpfleet-trace", "version": 1, "duration": 604800, "start_hour": 0}
    {"id": "17", "intervals": [[3600, 9000], [90000, 95400]], "speed": "mid", "failure": 0.1}

Why JSON Lines: one device is one line, so a reader holds one device at a time (a 10^6-device
week does not fit a pickle-style load on a laptop), an error names its line, a device's
intervals stay together (a CSV of intervals would repeat the device's traits on every row), and
any language reads it; a `.gz` name is read and written gzipped.

Two forms in memory:
* `iter_devices`: the stream, one `DeviceRecord` at a time (memory of one device), checked as it
  is read; a malformed line is one `DpfleetError` naming the file, the line and what was expected.
* `Trace`: the compact replay form, numpy columns per device and every interval in two flat
  arrays indexed by `offsets` (CSR), so memory is proportional to devices x intervals per
  device, never to Python objects; `eligible_at(t)` answers for every device at once in
  O(log intervals) per device.

Intervals are half-open [start, end) seconds from the trace's start, sorted and disjoint. A
device with a `period` (FedScale's `finish_time`) repeats its intervals every `period` seconds.

Why here, on the device side: `simulate`'s timer mode (the coordinator) and the emulated fleet
both replay a trace (`TraceReplay`, `devices.trace`, edge/devices.py), and the import layers let both use
the device side, never the fleet.
"""

from __future__ import annotations

import array
import gzip
import io
import json
import math
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from dpfleet.errors import DpfleetError
from dpfleet.io import atomic_write
from dpfleet.progress import progress_bar

FORMAT = "dpfleet-trace"
VERSION = 1
SPEED_CLASSES = ("fast", "mid", "slow")
# the training-time multiplier of each speed class (relative to the reference device), for a replay
SPEED_MULTIPLIER = {"fast": 0.5, "mid": 1.0, "slow": 2.5}
DEVICE_KEYS = {"id", "intervals", "speed", "failure", "period"}
HEADER_KEYS = {"format", "version", "duration", "start_hour", "devices", "source"}
ID_BLOCK = 65_536  # device ids packed into one numpy array at a time while loading


@dataclass(frozen=True)
class Header:
    """The trace's first line: its length and where it sits in the day."""

    duration: float  # seconds the trace covers; every interval lies in [0, duration]
    start_hour: float = 0.0  # UTC hour of day at t = 0 (availability by hour of day)
    devices: int | None = None  # the number of device lines, if the writer knew it (progress bars)
    source: str | None = None  # what made it ("dpfleet trace generate ...", "FedScale ...")

    def line(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": FORMAT, "version": VERSION, "duration": _num(self.duration),
                               "start_hour": _num(self.start_hour)}
        if self.devices is not None:
            out["devices"] = self.devices
        if self.source is not None:
            out["source"] = self.source
        return out


@dataclass(frozen=True)
class DeviceRecord:
    """One device line, as read (or about to be written)."""

    id: str
    intervals: list[tuple[float, float]]
    speed: str = "mid"
    failure: float | None = None  # chance the device drops out of a round it joined
    period: float | None = None  # the intervals repeat every `period` seconds
    line: int = 0  # its line in the file (1-based; 0: not read from a file)

    def line_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "intervals": [[_num(s), _num(e)] for s, e in self.intervals],
                               "speed": self.speed}
        if self.failure is not None:
            out["failure"] = self.failure
        if self.period is not None:
            out["period"] = _num(self.period)
        return out


def _num(x: float) -> int | float:
    """Whole seconds written as integers: shorter lines, the same bytes on every platform."""
    x = float(x)
    return int(x) if x.is_integer() else x


# -- reading ----------------------------------------------------------------------------------------
def _open_text(path: Path) -> IO[str]:
    path = Path(path)
    if not path.is_file():
        raise DpfleetError(f"{path}: no such trace file")
    if path.name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        with _open_text(path) as fh:
            yield from enumerate(fh, start=1)
    except (UnicodeDecodeError, gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise DpfleetError(f"{path}: not a text trace ({exc})") from None


def _object(path: Path, number: int, text: str, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DpfleetError(f"{path} line {number}: expected a JSON object ({what}); {exc.msg} "
                           f"at column {exc.colno}") from None
    if not isinstance(obj, dict):
        raise DpfleetError(f"{path} line {number}: expected a JSON object ({what})")
    return obj


def _header(path: Path, number: int, text: str) -> Header:
    obj = _object(path, number, text, "the header")
    if obj.get("format") != FORMAT:
        raise DpfleetError(f'{path} line {number}: expected the header {{"format": "{FORMAT}", '
                           f'"version": {VERSION}, "duration": SECONDS}} (docs/traces.md)')
    if obj.get("version") != VERSION:
        raise DpfleetError(f"{path} line {number}: expected version {VERSION}, not {obj.get('version')!r}")
    extra = sorted(set(obj) - HEADER_KEYS)
    if extra:
        raise DpfleetError(f'{path} line {number}: unexpected header key "{extra[0]}"')
    duration, start = obj.get("duration"), obj.get("start_hour", 0.0)
    if not _is_number(duration) or not 0 < duration < math.inf:
        raise DpfleetError(f'{path} line {number}: expected "duration": seconds > 0')
    if not _is_number(start) or not 0 <= start < 24:
        raise DpfleetError(f'{path} line {number}: expected "start_hour" in [0, 24)')
    devices = obj.get("devices")
    if devices is not None and (not isinstance(devices, int) or devices < 0):
        raise DpfleetError(f'{path} line {number}: expected "devices": a count >= 0')
    return Header(float(duration), float(start), devices, obj.get("source"))


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _device(path: Path, number: int, text: str, header: Header) -> DeviceRecord:
    obj = _object(path, number, text, "one device")
    where = f"{path} line {number}"
    extra = sorted(set(obj) - DEVICE_KEYS)
    if extra:
        known = ", ".join(sorted(DEVICE_KEYS))
        raise DpfleetError(f'{where}: unexpected key "{extra[0]}" (a device has {known})')
    ident = obj.get("id")
    if not isinstance(ident, str | int) or isinstance(ident, bool) or str(ident) == "":
        raise DpfleetError(f'{where}: expected "id": a string or an integer')
    raw = obj.get("intervals")
    if not isinstance(raw, list):
        raise DpfleetError(f'{where}: expected "intervals": a list of [start, end] pairs in seconds')
    speed = obj.get("speed", "mid")
    if speed not in SPEED_CLASSES:
        raise DpfleetError(f'{where}: expected "speed" one of {", ".join(SPEED_CLASSES)}, not {speed!r}')
    failure = obj.get("failure")
    if failure is not None and (not _is_number(failure) or not 0 <= failure <= 1):
        raise DpfleetError(f'{where}: expected "failure" in [0, 1], not {failure!r}')
    period = obj.get("period")
    if period is not None and (not _is_number(period) or period <= 0):
        raise DpfleetError(f'{where}: expected "period": seconds > 0, not {period!r}')
    limit = header.duration if period is None else float(period)
    intervals: list[tuple[float, float]] = []
    previous_end = -math.inf
    for pair in raw:
        if not (isinstance(pair, list) and len(pair) == 2 and all(_is_number(x) for x in pair)):
            raise DpfleetError(f"{where}: expected each interval as [start, end] seconds, not {pair!r}")
        start, end = float(pair[0]), float(pair[1])
        if not start < end:
            raise DpfleetError(f"{where}: expected start < end, not {pair!r}")
        if start < previous_end:
            raise DpfleetError(f"{where}: expected intervals sorted and disjoint; {pair!r} starts "
                               f"before {_num(previous_end)}")
        if start < 0 or end > limit:
            raise DpfleetError(f"{where}: expected intervals within [0, {_num(limit)}] "
                               f"({'the period' if period is not None else 'the duration'}), not {pair!r}")
        intervals.append((start, end))
        previous_end = end
    return DeviceRecord(str(ident), intervals, speed, None if failure is None else float(failure),
                        None if period is None else float(period), number)


def read_header(path: Path) -> Header:
    """The header of the trace at `path` (its first line)."""
    for number, text in _lines(path):
        return _header(Path(path), number, text)
    raise DpfleetError(f"{path}: empty; expected the header line (docs/traces.md)")


def iter_devices(path: Path) -> Iterator[DeviceRecord]:
    """The devices of the trace at `path`, one at a time and checked (memory: one device).
    Blank lines are skipped; ids are not checked for repeats here (that needs every id: `load`)."""
    path = Path(path)
    header = None
    for number, text in _lines(path):
        if header is None:
            header = _header(path, number, text)
        elif text.strip():
            yield _device(path, number, text, header)
    if header is None:
        raise DpfleetError(f"{path}: empty; expected the header line (docs/traces.md)")


# -- the compact form --------------------------------------------------------------------------------
@dataclass
class Trace:
    """A whole trace as numpy columns (the replay form; memory proportional to devices).

    Device d's intervals are `starts[offsets[d]:offsets[d + 1]]` / `ends[...]`, sorted and
    disjoint; `speed` indexes `SPEED_CLASSES`; `failure` is NaN where the trace gives none;
    `period` is 0 for a device whose intervals do not repeat; `ids` None means "0".."n-1"."""

    header: Header
    offsets: np.ndarray  # int64, n + 1
    starts: np.ndarray  # float64
    ends: np.ndarray  # float64
    speed: np.ndarray  # uint8
    failure: np.ndarray  # float32
    period: np.ndarray  # float64
    ids: np.ndarray | None = None  # str, n

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def nbytes(self) -> int:
        arrays = (self.offsets, self.starts, self.ends, self.speed, self.failure, self.period)
        return sum(a.nbytes for a in arrays) + (0 if self.ids is None else self.ids.nbytes)

    def device_id(self, d: int) -> str:
        return str(d) if self.ids is None else str(self.ids[d])

    def record(self, d: int) -> DeviceRecord:
        lo, hi = self.offsets[d], self.offsets[d + 1]
        failure = float(self.failure[d])
        pairs = list(zip(self.starts[lo:hi].tolist(), self.ends[lo:hi].tolist(), strict=True))
        return DeviceRecord(self.device_id(d), pairs,
                            SPEED_CLASSES[self.speed[d]], None if math.isnan(failure) else round(failure, 6),
                            float(self.period[d]) or None)

    def eligible_at(self, t: float) -> np.ndarray:
        """Which devices are inside one of their intervals at time `t` (bool per device).

        A binary search per device, run for all devices at once: about log2(most intervals of
        a device) numpy passes over the devices."""
        local = np.where(self.period > 0, np.mod(t, np.where(self.period > 0, self.period, 1.0)), t)
        lo, hi = self.offsets[:-1].copy(), self.offsets[1:].copy()
        first = lo.copy()
        # invariant: intervals in [first, lo) start at or before `local`, those in [hi, end) after it
        while np.any(lo < hi):
            mid = (lo + hi) // 2
            open_ = lo < hi
            before = np.zeros(len(mid), dtype=bool)
            before[open_] = self.starts[mid[open_]] <= local[open_]
            lo = np.where(open_ & before, mid + 1, lo)
            hi = np.where(open_ & ~before, mid, hi)
        last = lo - 1
        found = last >= first
        inside = np.zeros(len(self), dtype=bool)
        inside[found] = self.ends[last[found]] > local[found]
        return inside


def load(path: Path, progress: bool = False) -> Trace:
    """The trace at `path` in its compact form, read as a stream: every column grows in a typed
    buffer and ids are packed into numpy blocks of `ID_BLOCK`, so no Python object per device
    is kept. A repeated device id is refused, with both its lines."""
    path = Path(path)
    header = read_header(path)
    offsets, starts, ends = array.array("q", [0]), array.array("d"), array.array("d")
    speed, failure, period = array.array("B"), array.array("f"), array.array("d")
    lines = array.array("q")
    blocks: list[np.ndarray] = []
    pending: list[str] = []
    speed_index = {name: i for i, name in enumerate(SPEED_CLASSES)}
    records = progress_bar(iter_devices(path), desc="reading trace", unit="device", total=header.devices,
                           enabled=progress, leave=False)
    for rec in records:
        pending.append(rec.id)
        if len(pending) == ID_BLOCK:
            blocks.append(np.array(pending))
            pending = []
        lines.append(rec.line)
        for s, e in rec.intervals:
            starts.append(s)
            ends.append(e)
        offsets.append(len(starts))
        speed.append(speed_index[rec.speed])
        failure.append(math.nan if rec.failure is None else rec.failure)
        period.append(rec.period or 0.0)
    ids = np.concatenate([*blocks, np.array(pending, dtype=str)])
    _refuse_repeats(path, ids, np.frombuffer(lines, dtype=np.int64))
    plain = np.array_equal(ids, np.arange(len(ids)).astype(str))
    return Trace(header, np.frombuffer(offsets, dtype=np.int64).copy(), np.frombuffer(starts).copy(),
                 np.frombuffer(ends).copy(), np.frombuffer(speed, dtype=np.uint8).copy(),
                 np.frombuffer(failure, dtype=np.float32).copy(), np.frombuffer(period).copy(),
                 None if plain else ids)


def _refuse_repeats(path: Path, ids: np.ndarray, lines: np.ndarray) -> None:
    """The first repeated id (by its second line), named with both lines; one sort of the ids."""
    order = np.argsort(ids, kind="stable")
    same = np.flatnonzero(ids[order][1:] == ids[order][:-1])
    if len(same):
        first, second = order[same], order[same + 1]
        k = int(np.argmin(lines[second]))
        raise DpfleetError(f"{path} line {lines[second[k]]}: device id {str(ids[second[k]])!r} repeats "
                           f"line {lines[first[k]]}")


# -- writing -----------------------------------------------------------------------------------------
def write_records(path: Path, header: Header, records: Iterable[DeviceRecord], progress: bool = False,
                  total: int | None = None) -> None:
    """Write a trace line by line (atomically, 0600; gzipped for a `.gz` name): the records are
    consumed as they come, so a converter never holds the whole output."""
    path = Path(path)

    def fill(raw: IO[bytes]) -> None:
        sink: IO[bytes] = gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) if path.name.endswith(".gz") else raw
        buffered = io.BufferedWriter(sink, buffer_size=1 << 20) if sink is not raw else raw
        buffered.write((json.dumps(header.line()) + "\n").encode())
        bar = progress_bar(records, desc="writing trace", unit="device", total=total,
                           enabled=progress, leave=False)
        for rec in bar:
            buffered.write((json.dumps(rec.line_json(), separators=(",", ":")) + "\n").encode())
        buffered.flush()
        if sink is not raw:
            sink.close()

    atomic_write(path, fill)


def write_trace(path: Path, trace: Trace, progress: bool = False) -> None:
    """Write the compact `trace` in the plain-text schema (same trace, same bytes)."""
    header = Header(trace.header.duration, trace.header.start_hour, len(trace), trace.header.source)
    write_records(path, header, (trace.record(d) for d in range(len(trace))), progress, len(trace))


# -- what a trace holds ---------------------------------------------------------------------------------
def unrolled(trace: Trace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(device, start, end) of every interval within [0, duration], a periodic device's
    intervals repeated over the duration (memory: intervals x repeats)."""
    counts = np.diff(trace.offsets)
    device = np.repeat(np.arange(len(trace)), counts)
    starts, ends = trace.starts, trace.ends
    period = trace.period[device]
    periodic = period > 0
    if not periodic.any():
        return device, starts, ends
    out_d, out_s, out_e = [device[~periodic]], [starts[~periodic]], [ends[~periodic]]
    d, s, e, p = device[periodic], starts[periodic], ends[periodic], period[periodic]
    repeats = int(np.ceil(trace.header.duration / p.min()))
    for k in range(repeats):
        shift = k * p
        keep = s + shift < trace.header.duration
        if not keep.any():
            break
        out_d.append(d[keep])
        out_s.append(s[keep] + shift[keep])
        out_e.append(np.minimum(e[keep] + shift[keep], trace.header.duration))
    order = np.argsort(np.concatenate(out_d), kind="stable")
    return (np.concatenate(out_d)[order], np.concatenate(out_s)[order], np.concatenate(out_e)[order])


def available_seconds(trace: Trace) -> np.ndarray:
    """Seconds each device is eligible within the trace's duration."""
    device, starts, ends = unrolled(trace)
    return np.bincount(device, weights=ends - starts, minlength=len(trace))


def availability_by_hour(trace: Trace, per_day: bool = False) -> np.ndarray:
    """The mean fraction of devices eligible in each UTC hour of day (24 values), or with
    `per_day` one row of 24 per day of the trace (NaN for hours the trace does not cover).
    The bins are the trace's own hours, labelled by the nearest whole UTC hour.

    Exact, from the intervals (no sampling): the device-seconds eligible before time x are
    sum(min(end, x)) - sum(min(start, x)), read off the sorted starts and ends."""
    _, starts, ends = unrolled(trace)
    hours = int(math.ceil(trace.header.duration / 3600.0))
    shift = trace.header.start_hour * 3600.0  # the trace's t = 0 is this far into its first day
    edges = np.minimum(np.arange(hours + 1) * 3600.0, trace.header.duration)

    def covered(points: np.ndarray) -> np.ndarray:  # device-seconds eligible in [0, x) for each x
        return _below(np.sort(ends), points) - _below(np.sort(starts), points)

    seconds = np.diff(covered(edges))
    widths = np.diff(edges) * max(len(trace), 1)
    fraction = np.divide(seconds, widths, out=np.zeros_like(seconds), where=widths > 0)
    hour_of_day = ((np.arange(hours) + int(round(shift / 3600.0))) % 24)
    if per_day:
        days = int(math.ceil((hours + int(round(shift / 3600.0))) / 24))
        grid = np.full((days, 24), np.nan)
        slot = np.arange(hours) + int(round(shift / 3600.0))
        grid[slot // 24, slot % 24] = fraction
        return grid
    return np.array([fraction[hour_of_day == h].mean() if (hour_of_day == h).any() else np.nan
                     for h in range(24)])


def _below(sorted_values: np.ndarray, points: np.ndarray) -> np.ndarray:
    """sum(min(v, x)) over the values, for each x (O(log n) per x after the sort)."""
    prefix = np.concatenate([[0.0], np.cumsum(sorted_values)])
    k = np.searchsorted(sorted_values, points, side="right")
    return prefix[k] + points * (len(sorted_values) - k)


# -- replaying a trace onto a population --------------------------------------------------------------
class TraceReplay:
    """A trace replayed onto `size` clients: what `simulate`'s timer mode and the emulated fleet
    both ask of it (edge/devices.py, `devices.trace`).

    Two stated rules make any trace fit any population and any run length:
    * client i replays trace device i mod T (T: the trace's devices), so a trace of at least
      `size` devices gives every client its own device and a smaller one is reused in turn;
    * the trace repeats after its duration: at simulated second t the trace is read at
      t mod duration (a week-long trace replays week after week)."""

    def __init__(self, trace: Trace, size: int):
        if len(trace) == 0:
            raise DpfleetError("the availability trace has no devices: nothing to replay")
        if size < 1:
            raise DpfleetError("a trace is replayed onto at least one client")
        self.trace, self.size = trace, size
        self.duration = trace.header.duration
        self._device = np.arange(size, dtype=np.int64) % len(trace)
        # a device that gives no failure chance never fails (the trace did not observe any)
        self._failure = np.nan_to_num(trace.failure.astype(np.float64), nan=0.0)

    def device(self, client: int) -> int:
        """The trace device client `client` replays."""
        return int(self._device[client])

    def eligible(self, t: float) -> np.ndarray:
        """Which clients are inside one of their intervals at simulated second `t` (bool per client)."""
        inside = self.trace.eligible_at(math.fmod(t, self.duration))
        return inside[self._device]

    def _intervals(self, client: int) -> tuple[np.ndarray, np.ndarray, float]:
        d = self._device[client]
        lo, hi = self.trace.offsets[d], self.trace.offsets[d + 1]
        return self.trace.starts[lo:hi], self.trace.ends[lo:hi], float(self.trace.period[d])

    def client_eligible(self, client: int, t: float) -> bool:
        """`eligible(t)[client]` for one client, in O(log intervals)."""
        starts, ends, period = self._intervals(client)
        local = math.fmod(t, self.duration)
        local = math.fmod(local, period) if period > 0 else local
        k = int(np.searchsorted(starts, local, side="right")) - 1
        return k >= 0 and bool(ends[k] > local)

    def next_change(self, client: int, t: float) -> float:
        """The first simulated second after `t` at which the client's eligibility can change: the
        end of the interval it is in, else the start of the next one, else the trace's (or its
        period's) wrap-around, where the intervals begin again."""
        starts, ends, period = self._intervals(client)
        base = t - math.fmod(t, self.duration)
        local = t - base
        wrap = base + self.duration
        if period > 0:
            base += local - math.fmod(local, period)
            local = math.fmod(local, period)
            wrap = min(wrap, base + period)
        edges = np.concatenate([starts, ends])
        later = edges[edges > local]
        nxt = base + float(later.min()) if later.size else wrap
        return max(min(nxt, wrap), math.nextafter(t, math.inf))

    def failure(self, clients: np.ndarray | list[int]) -> np.ndarray:
        """Each client's chance of dropping out of a round it joined (0 where the trace gives none)."""
        return self._failure[self._device[np.asarray(clients, dtype=np.int64)]]

    def speed(self, client: int) -> float:
        """The client's training-time multiplier (its speed class, `SPEED_MULTIPLIER`)."""
        return SPEED_MULTIPLIER[SPEED_CLASSES[self.trace.speed[self._device[client]]]]


def load_replay(path: Path | str, size: int, progress: bool = False) -> TraceReplay:
    """The trace at `path` replayed onto `size` clients (`TraceReplay`'s rules)."""
    return TraceReplay(load(Path(path), progress=progress), size)
