"""Crash injection for the kill -9 tests: `DPFLEET_SERVICE_FAULT=point:n` kills this process
with SIGKILL (no cleanup, no rollback) the n-th time it passes `point`. Points: the service's
own ("opened", "secagg_<phase>", "before_commit", "after_commit") and the state store's commit
steps (`state_store.StateStore.fault`). Unset: a no-op."""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Callable

ENV = "DPFLEET_SERVICE_FAULT"


def fault_from_env() -> Callable[[str], None]:
    spec = os.environ.get(ENV, "")
    if not spec:
        return lambda point: None
    point_wanted, _, n = spec.rpartition(":")
    target, seen = int(n), Counter()

    def fault(point: str) -> None:
        seen[point] += 1
        if point == point_wanted and seen[point] == target:
            os.kill(os.getpid(), signal.SIGKILL)

    return fault
