"""Client populations as one memory-mapped row array plus offsets, not Python lists.

`FederatedData.train` keeps one `ClientData` (a Python object and its own array) per client,
which is fine for Shakespeare's 1,277 clients and hopeless for a million. A `ClientStore` holds
every client's rows back to back in one `[rows, seq_len + 1]` array (int16 when the vocabulary
fits) and a `[clients + 1]` offsets array, both `.npy` files memory-mapped from the user cache, so
the resident cost is the pages a round touches and `clients(ids)` is O(cohort).

Scale tests need populations larger than any real dataset here: `generated(store, n)` cycles the
real clients (client i reads real client i mod n_real) and says so in `meta["generated"]` and
`meta["cycled_from"]`; such a population is for measuring speed and memory, never for accuracy or
privacy claims (its "users" repeat).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpfleet.edge.client_data import ClientData
from dpfleet.errors import DpfleetError
from dpfleet.jsonio import write_json


def _dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.int16 if vocab_size <= np.iinfo(np.int16).max else np.int32)


@dataclass
class ClientStore:
    """rows[offsets[i]:offsets[i+1]] are client i's example rows; ids map clients to stored rows."""

    rows: np.ndarray  # [R, seq_len + 1], memory-mapped
    offsets: np.ndarray  # [n_stored + 1] int64, memory-mapped
    meta: dict
    users: list[str]  # the real (stored) clients' user ids
    cycle: int = 0  # generated population: client i reads stored client i % cycle (0: not generated)
    size: int = 0

    def __len__(self) -> int:
        return self.size or len(self.offsets) - 1

    def _stored(self, i: int) -> int:
        if not 0 <= i < len(self):
            raise IndexError(f"client {i} outside a population of {len(self)}")
        return i % self.cycle if self.cycle else i

    def examples(self, i: int) -> np.ndarray:
        """Client i's rows as int32 (a copy of only its pages)."""
        j = self._stored(i)
        return np.asarray(self.rows[self.offsets[j] : self.offsets[j + 1]], dtype=np.int32)

    def clients(self, ids: Sequence[int]) -> list[ClientData]:
        """A cohort's data: O(len(ids)) reads, whatever the population size."""
        return [ClientData(self.user(i), self.examples(i)) for i in ids]

    def user(self, i: int) -> str:
        j = self._stored(i)
        return self.users[j] + (f"#{i // self.cycle}" if self.cycle else "")  # copies are labelled

    def user_ids(self) -> UserIds:
        """Every client's user id as a lazy sequence (no million-string list)."""
        return UserIds(self)

    def real_clients(self) -> range:
        """The stored (real) clients' indices: all of them, or the ones a generated population cycles."""
        return range(len(self.offsets) - 1)


class UserIds(Sequence[str]):
    """`store.user(i)` for i in range(len(store)), computed when read."""

    def __init__(self, store: ClientStore):
        self.store = store

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self.store.user(j) for j in range(*i.indices(len(self)))]
        return self.store.user(i + len(self) if i < 0 else i)


def _hash_client(digest, c: ClientData) -> None:
    digest.update(c.user.encode() + b"\0" + np.ascontiguousarray(c.examples).tobytes())


def build_store(clients: Sequence[ClientData], vocab_size: int, cache: Path, source: str) -> ClientStore:
    """Write `clients` once as rows.npy + offsets.npy + meta.json under `cache` (content-hashed)."""
    if not clients:
        raise DpfleetError("no clients to store")
    digest = hashlib.sha256()
    for c in clients:
        _hash_client(digest, c)
    folder = Path(cache) / f"population-{digest.hexdigest()[:16]}"
    if (folder / "meta.json").is_file():
        return open_store(folder)
    return write_store(clients, vocab_size, cache, source)


def write_store(clients: Iterable[ClientData], vocab_size: int, cache: Path, source: str,
                chunk_rows: int = 1 << 16) -> ClientStore:
    """`build_store` for clients made one at a time (`client_data.stream_federated`): each one's
    rows are appended to a scratch file as it arrives, so memory holds one client, never the
    population; the rows are then copied into rows.npy a chunk at a time. The folder has the same
    content hash as `build_store`'s for the same clients (an existing one is reused)."""
    dtype = _dtype(vocab_size)
    Path(cache).mkdir(parents=True, exist_ok=True)  # built beside it, then renamed in: two runs
    tmp = Path(tempfile.mkdtemp(prefix="population-build.", dir=cache))  # building at once never mix
    try:
        digest, counts, users, width = hashlib.sha256(), [], [], None
        with (tmp / "rows.raw").open("wb") as raw:
            for c in clients:
                if c.examples.ndim != 2 or c.examples.shape[1] != (width or c.examples.shape[1]):
                    raise DpfleetError("every client's rows must have the same width (seq_len + 1)")
                width = c.examples.shape[1]
                _hash_client(digest, c)
                raw.write(np.ascontiguousarray(c.examples, dtype=dtype).tobytes())
                counts.append(len(c.examples))
                users.append(c.user)
        if not users:
            raise DpfleetError("no clients to store")
        folder = Path(cache) / f"population-{digest.hexdigest()[:16]}"
        if not (folder / "meta.json").is_file():
            offsets = np.concatenate([[0], np.cumsum(np.array(counts, dtype=np.int64))])
            total = int(offsets[-1])
            scratch = np.memmap(tmp / "rows.raw", dtype=dtype, mode="r", shape=(total, width))
            rows = np.lib.format.open_memmap(tmp / "rows.npy", mode="w+", dtype=dtype, shape=(total, width))
            for start in range(0, total, chunk_rows):
                rows[start : start + chunk_rows] = scratch[start : start + chunk_rows]
            rows.flush()
            del rows, scratch
            (tmp / "rows.raw").unlink()
            np.save(tmp / "offsets.npy", offsets)
            write_json(tmp / "users.json", users)
            meta = {"clients": len(users), "rows": total, "width": width,
                    "source": source, "vocab_size": vocab_size, "generated": False}
            write_json(tmp / "meta.json", meta, indent=2)  # written last: complete
            with contextlib.suppress(OSError):  # another run renamed its identical copy first
                tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return open_store(folder)


def open_store(folder: Path) -> ClientStore:
    folder = Path(folder)
    try:
        meta = json.loads((folder / "meta.json").read_text())
        rows = np.load(folder / "rows.npy", mmap_mode="r")
        offsets = np.load(folder / "offsets.npy", mmap_mode="r")
        users = json.loads((folder / "users.json").read_text())
    except (OSError, ValueError) as exc:
        raise DpfleetError(f"{folder} is not a complete client store ({exc}); delete it to rebuild") from exc
    if (offsets.ndim != 1 or offsets[-1] != len(rows) or len(offsets) != meta["clients"] + 1
            or len(users) != meta["clients"]):
        raise DpfleetError(f"{folder}: rows and offsets disagree; delete it to rebuild")
    return ClientStore(rows, offsets, meta, users)


def generated(store: ClientStore, size: int) -> ClientStore:
    """A population of `size` clients cycled from the real ones, labelled as generated."""
    if size < 1:
        raise DpfleetError("a generated population needs at least one client")
    real = len(store.offsets) - 1
    meta = dict(store.meta, generated=True, cycled_from=real, clients=size)
    return ClientStore(store.rows, store.offsets, meta, store.users, cycle=real, size=size)
