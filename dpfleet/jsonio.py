"""JSON that every reader can parse: non-finite floats become null.

Python's `json` writes `Infinity` / `NaN` by default, which is not JSON (jq, browsers and most
languages refuse the file). eps = inf (no noise), a diverged loss or a 0/0 metric are legitimate
values here, so every JSON the project writes goes through `dumps`, which maps them to `null`
and then refuses any non-finite float that slipped through (`allow_nan=False`).

The module owns the project's JSON, so each rule is written once:

* `dumps`: the text (for the wire, a log line, a CLI's --json).
* `write_json`: a JSON file, through `dpfleet.io.atomic_write` (a crash leaves the old file or the
  new one, never a mix; the file 0600), as `dumps` writes it.
* `canonical_bytes` / `canonical_sha256`: what a hash, a MAC or a signature covers (keys sorted,
  ASCII, compact). Many such hashes are persisted or signed (a mechanism's fingerprint in
  config.json, the guarantee digest, SecAgg round terms, bundle manifests, cache keys), so their
  bytes never change: the sites that hashed `json.dumps`'s default separators pass `SPACED`.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dpfleet.io import atomic_write

if TYPE_CHECKING:
    from hashlib import _Hash

COMPACT = (",", ":")  # canonical JSON's separators
SPACED = (", ", ": ")  # json.dumps's defaults: what some persisted hashes were computed over


def finite(obj: Any) -> Any:
    """`obj` with every non-finite float (also numpy floats, in dicts / lists / tuples) as None."""
    if isinstance(obj, float | np.floating):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.ndarray):
        return finite(obj.tolist())
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """`json.dumps` with non-finite floats written as null (keyword arguments pass through).

    Plain JSON data is written at once (walking it with `finite` first cost the coordinator
    ~0.8 ms per SecAgg assignment); `json` itself refuses what `finite` would change (a
    non-finite float: ValueError, a numpy scalar or array: TypeError), which then goes the
    long way. With `default` or `cls` the long way always (they would see numpy values)."""
    if "default" not in kwargs and "cls" not in kwargs:
        try:
            return json.dumps(obj, allow_nan=False, **kwargs)
        except (ValueError, TypeError):
            pass
    return json.dumps(finite(obj), allow_nan=False, **kwargs)


def write_json(path: Path, obj: Any, *, indent: int | None = None, end: str = "", **kwargs: Any) -> Path:
    """`obj` written to `path` atomically (0600) as `dumps(obj, indent=indent, **kwargs) + end`;
    returns `path`. Nothing is written if `obj` is not JSON (the old file, if any, is kept)."""
    atomic_write(Path(path), dumps(obj, indent=indent, **kwargs) + end)
    return Path(path)


def canonical_bytes(obj: Any, *, separators: tuple[str, str] = COMPACT, default: Any = None) -> bytes:
    """The one byte string a hash of `obj` covers: keys sorted, ASCII, `separators` (COMPACT, or
    SPACED for hashes persisted before this owner). A non-finite float is refused (ValueError),
    not mapped to null: it would collide with None in a key. `default` as in `json.dumps`."""
    return json.dumps(obj, sort_keys=True, separators=separators, ensure_ascii=True, allow_nan=False,
                      default=default).encode()


def canonical_sha256(obj: Any, label: bytes = b"", **kwargs: Any) -> _Hash:
    """SHA-256 of `label + canonical_bytes(obj, **kwargs)`, as a hash object (`.hexdigest()`,
    `.digest()`, or `.update()` with more bytes)."""
    return hashlib.sha256(label + canonical_bytes(obj, **kwargs))
