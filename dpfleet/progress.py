"""Progress bars: every bar dpfleet shows is made here, so turning them off is one rule.

A bar is hidden when

* its caller says `enabled=False` (a command's `--quiet`, a function's `progress=False`), or
* the environment says `DPFLEET_PROGRESS=0`: no bar at all, whatever the callers say (CI logs, a
  service's journal, a notebook), or
* it is `terminal_only` (the default: tqdm's `disable=None`) and its stream is not a terminal, so a
  log file or a pipe gets no bar. The bars a command shows because it was asked to (the rounds of
  `simulate`, public pretraining, the fleet's rounds) pass `terminal_only=False`: they are written
  to a redirected stderr too, until `--quiet` or the variable turns them off.

Bars write to stderr (tqdm's default) or to the `file` given: during an export that is the export
capture's `terminal()`, the real stderr, so a bar is not swallowed into the exporter's log.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from tqdm import tqdm

ENV = "DPFLEET_PROGRESS"  # "0": no progress bar at all


def progress_bar(iterable: Iterable | None = None, *, desc: str | None = None, unit: str = "it",
                 total: float | None = None, enabled: bool = True, terminal_only: bool = True,
                 **kwargs: Any) -> tqdm:
    """A tqdm bar over `iterable` (or one to `update()` by hand, with `total`), shown under the
    module docstring's rule; other keyword arguments (`leave`, `initial`, `file`, ...) pass
    through to tqdm. A hidden bar is still a tqdm: `update`, `set_postfix` and `close` do nothing,
    and iterating it iterates `iterable`."""
    if not enabled or os.environ.get(ENV, "").strip() == "0":
        disable: bool | None = True
    else:
        disable = None if terminal_only else False
    return tqdm(iterable, desc=desc, unit=unit, total=total, disable=disable, **kwargs)
