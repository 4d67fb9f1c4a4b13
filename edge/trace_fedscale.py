"""FedScale's published device traces, converted to the plain-text schema (docs/traces.md).

FedScale ships two pickles (benchmark/dataset/data/device_info):
* `client_behave_trace`: {client: {"active": [s...], "inactive": [e...], "finish_time": T}}, the
  client available in [active[i], inactive[i]] seconds, repeating every T (its `is_active`
  reads `cur_time % finish_time`);
* `client_device_capacity`: {client: {"computation": ms per sample, "communication": kbit/s}}.
FedScale pairs its i-th client with the i-th key of each file (modulo the file's length); so does
the converter. Speed classes are the terciles of `computation` (the fastest third "fast").

Unpickling runs whatever code the file names, so these files are read by `plain_unpickle`, an
unpickler that refuses every global: only dicts, lists, tuples, numbers, strings and bytes load.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dpfleet.edge.traces import SPEED_CLASSES, DeviceRecord, Header, write_records
from dpfleet.errors import DpfleetError


class _PlainUnpickler(pickle.Unpickler):
    """Loads plain data only: any class or function the pickle names is refused before it is
    imported, so a payload's `__reduce__` (os.system, eval, ...) never runs."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names the Python global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it refers to a persistent object")


def plain_unpickle(path: Path) -> Any:
    """The plain data in the pickle at `path`; a pickle that names any code is refused."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DpfleetError(f"{path}: no such file") from None
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        if "Python global" in str(exc) or "persistent" in str(exc):
            raise DpfleetError(f"{path}: not plain data ({exc}); only dicts, lists, numbers and "
                               "strings are read from a pickle") from None
        raise DpfleetError(f"{path}: not a pickle ({exc})") from None
    except (EOFError, ValueError, IndexError, KeyError, TypeError, AttributeError) as exc:
        raise DpfleetError(f"{path}: not a pickle ({type(exc).__name__}: {exc})") from None


def _number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _intervals(path: Path, client: object, entry: object) -> tuple[list[tuple[float, float]], float]:
    """One client's availability: sorted, merged intervals clipped to [0, finish_time]."""
    where = f"{path}: client {client}"
    if not isinstance(entry, dict):
        raise DpfleetError(f'{where}: expected a dict with "active", "inactive" and "finish_time"')
    active, inactive, finish = entry.get("active"), entry.get("inactive"), entry.get("finish_time")
    lists = isinstance(active, list | tuple) and isinstance(inactive, list | tuple)
    if not (lists and len(active) == len(inactive) and all(_number(x) for x in (*active, *inactive))):
        raise DpfleetError(f'{where}: expected "active" and "inactive" lists of the same length, of seconds')
    if not _number(finish) or finish <= 0:
        raise DpfleetError(f'{where}: expected "finish_time": seconds > 0, not {finish!r}')
    pairs = sorted((max(float(s), 0.0), min(float(e), float(finish)))
                   for s, e in zip(active, inactive, strict=True))
    merged: list[tuple[float, float]] = []
    for s, e in pairs:
        if e <= s:
            continue
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged, float(finish)


def _speed_classes(path: Path, capacity: dict) -> list[str]:
    """The speed class of each capacity entry, in the file's order (terciles of computation)."""
    values = []
    for client, entry in capacity.items():
        value = entry.get("computation") if isinstance(entry, dict) else None
        if not _number(value) or value <= 0:
            raise DpfleetError(f'{path}: client {client}: expected "computation": ms per sample > 0')
        values.append(float(value))
    cuts = np.quantile(values, [1 / 3, 2 / 3])
    return [SPEED_CLASSES[int(np.searchsorted(cuts, v, side="left"))] for v in values]


def convert_fedscale(behave: Path, out: Path, capacity: Path | None = None, duration: float | None = None,
                     progress: bool = False) -> Header:
    """Write FedScale's availability trace `behave` (and its device capacity trace, for speed
    classes; without it every device is "mid") as a plain-text trace at `out`. `duration`:
    the trace's length in seconds (default: the longest finish_time)."""
    behave = Path(behave)
    trace = plain_unpickle(behave)
    if not isinstance(trace, dict) or not trace:
        raise DpfleetError(f"{behave}: expected a dict of clients, each with active / inactive / finish_time")
    speeds = ["mid"]
    if capacity is not None:
        table = plain_unpickle(capacity)
        if not isinstance(table, dict) or not table:
            raise DpfleetError(f"{capacity}: expected a dict of clients, each with computation and "
                               "communication")
        speeds = _speed_classes(Path(capacity), table)
    parsed = {client: _intervals(behave, client, entry) for client, entry in trace.items()}
    longest = max(finish for _, finish in parsed.values())
    if duration is not None and not 0 < duration < math.inf:
        raise DpfleetError(f"duration must be > 0 seconds, not {duration}")
    header = Header(float(duration or longest), 0.0, len(parsed),
                    f"FedScale {behave.name}" + (f" + {Path(capacity).name}" if capacity is not None else ""))

    def records() -> Iterator[DeviceRecord]:
        for i, (client, (intervals, finish)) in enumerate(parsed.items()):
            yield DeviceRecord(str(client), intervals, speeds[i % len(speeds)], None, finish)

    write_records(Path(out), header, records(), progress, len(parsed))
    return header
