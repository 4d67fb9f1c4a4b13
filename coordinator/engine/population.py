"""A simulate run's training population, read through a memory-mapped `ClientStore`.

Why a store: the round loop needs only the cohort's rows, so the population lives once in the
user cache (`$DPFLEET_CACHE/populations/`, content-hashed over the tokenized rows and user ids,
so the key changes with the data, its config and the tokenizer) and the run reads O(cohort) of
it per round. A real population is the same clients, rows and order as the lists it was built
from, so its runs are the lists' runs bit for bit (tests/test_population_store.py).

`[data] generated_population = N` cycles the real clients up to N for scale tests (client i is
real client i mod K, labelled `user#copy`). Those "users" repeat, and the accountant counts each
copy as a separate person, so the run's epsilon says nothing about any real person: every output
(`generated_population_notice`) says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from dpfleet.coordinator.config import SimulationConfig
from dpfleet.edge.client_data import ClientData
from dpfleet.edge.client_store import ClientStore, build_store, generated, write_store
from dpfleet.errors import DpfleetError


def population_cache() -> Path:
    from dpfleet.edge.wheel_cache import cache_dir

    return cache_dir() / "populations"


def open_population(cfg: SimulationConfig, train: Iterable[ClientData], vocab_size: int,
                    cache: Path | None = None) -> ClientStore:
    """The store of `train` (built once, reused by every later run with the same rows), cycled
    to `data.generated_population` clients when that is set. `train` is a list, or an iterator
    of clients made one at a time from a file (written as they come: `write_store`)."""
    folder = cache or population_cache()
    store = (build_store(train, vocab_size, folder, cfg.data.dataset) if isinstance(train, Sequence)
             else write_store(train, vocab_size, folder, cfg.data.dataset))
    size = cfg.data.generated_population
    if size and size < len(store):
        raise DpfleetError(f"data.generated_population = {size:,} is below the {len(store):,} real "
                           "training clients; use data.max_clients for a smaller population")
    return generated(store, size) if size else store


def generated_population_notice(store: ClientStore) -> dict | None:
    """What summary.json / privacy.json / the CLI say about a generated population (None: real)."""
    if not store.meta.get("generated"):
        return None
    n, k = len(store), store.meta["cycled_from"]
    return {
        "generated": True, "clients": n, "cycled_from_real_users": k,
        "warning": f"GENERATED POPULATION: {n:,} clients cycled from {k:,} real users, so users "
                   "repeat (each real user's data is in about "
                   f"{-(-n // k):,} clients, each accounted as a different person); the epsilon "
                   "of this run is NOT a guarantee for any real person. For speed and memory "
                   "measurements only.",
    }
