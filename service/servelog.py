"""service.log: one JSON line per event (check-in refusals aside, which are counted, not logged),
so what the coordinator did can be read back after a crash without the database."""

from __future__ import annotations

import time
from pathlib import Path

from dpfleet.jsonio import dumps


class ServiceLog:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = self.path.open("a", buffering=1)  # line-buffered: a kill loses no whole line

    def event(self, kind: str, **fields) -> None:
        self._file.write(dumps({"t": round(time.time(), 3), "event": kind, **fields}) + "\n")

    def close(self) -> None:
        self._file.close()
