"""JSON that every reader can parse: non-finite floats become null.

Python's `json` writes `Infinity` / `NaN` by default, which is not JSON (jq, browsers and most
languages refuse the file). eps = inf (no noise), a diverged loss or a 0/0 metric are legitimate
values here, so every JSON the project writes goes through `dumps`, which maps them to `null`
and then refuses any non-finite float that slipped through (`allow_nan=False`).
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np


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
