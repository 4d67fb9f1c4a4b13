"""Tokenised, per-user example arrays: what each emulated phone holds.

Following the papers (LEAF / StackOverflow protocol): every record is tokenised and cut into
sequences of at most `seq_len` tokens; a row is `[BOS, t1..tk, PAD...]` of length seq_len + 1,
inputs are row[:-1] and targets row[1:]. A client keeps at most `max_examples` rows (a seeded
random subset). Whole users are held out for testing, so test clients never train.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from dpfleet.edge.datasets import TextRecord
from dpfleet.edge.tokenizer import BOS, PAD, Tokenizer
from dpfleet.errors import DpfleetError


@dataclass
class ClientData:
    user: str
    examples: np.ndarray  # int32 [n, seq_len + 1]

    @property
    def num_tokens(self) -> int:
        return int((self.examples[:, 1:] != PAD).sum())


@dataclass
class FederatedData:
    train: list[ClientData]
    test: list[ClientData]
    seq_len: int

    def test_examples(self, limit: int | None = None) -> np.ndarray:
        rows = np.concatenate([c.examples for c in self.test]) if self.test else np.zeros((0, 1))
        return rows[:limit] if limit else rows


def _stable_seed(*parts: object) -> int:
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def to_rows(token_lists: Iterable[Sequence[int]], seq_len: int) -> np.ndarray:
    """Cut token lists into BOS-prefixed, PAD-padded rows of length seq_len + 1."""
    rows = []
    for tokens in token_lists:
        for start in range(0, len(tokens), seq_len):
            chunk = tokens[start : start + seq_len]
            row = np.full(seq_len + 1, PAD, dtype=np.int32)
            row[0] = BOS
            row[1 : 1 + len(chunk)] = chunk
            rows.append(row)
    return np.stack(rows) if rows else np.zeros((0, seq_len + 1), dtype=np.int32)


def group_by_user(records: Iterable[TextRecord]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = collections.defaultdict(list)
    for r in records:
        grouped[r.user].append(r.text)
    return dict(grouped)


def held_out_count(users: int, test_fraction: float) -> int:
    """How many of `users` users `split_users` holds out (whole users, rounded)."""
    return round(users * test_fraction)


def split_users(users: Sequence[str], test_fraction: float, seed: int) -> tuple[list, list]:
    """Seeded split of whole users into (train, test)."""
    if not 0.0 <= test_fraction < 1.0:
        raise DpfleetError("data.test_fraction must be in [0, 1)")
    ordered = sorted(users, key=lambda u: _stable_seed(seed, "split", u))
    n_test = held_out_count(len(ordered), test_fraction)
    return sorted(ordered[n_test:]), sorted(ordered[:n_test])


def build_federated(
    records: Iterable[TextRecord],
    tokenizer: Tokenizer,
    *,
    seq_len: int = 20,
    max_examples: int = 256,
    test_fraction: float = 0.1,
    seed: int = 0,
    max_clients: int | None = None,
) -> FederatedData:
    """Per-user example arrays with whole users held out for test (users in sorted order)."""
    by_user = group_by_user(records)
    train, test = stream_federated(lambda: ((u, by_user[u]) for u in sorted(by_user)), tokenizer,
                                   (seq_len, max_examples, test_fraction, seed, max_clients))
    train = list(train)  # held-out clients are complete once it is read
    if not train:
        raise DpfleetError("no training clients with any text")
    return FederatedData(train, test, seq_len)


def make_client(user: str, texts: Iterable[str], tokenizer: Tokenizer, seq_len: int,
                max_examples: int, seed: int) -> ClientData | None:
    """One user's rows, capped at `max_examples` by a seeded choice (None: no text)."""
    rows = to_rows((tokenizer.encode(t) for t in texts), seq_len)
    if len(rows) == 0:
        return None
    if len(rows) > max_examples:
        keep = np.random.default_rng(_stable_seed(seed, "cap", user)).choice(
            len(rows), max_examples, replace=False
        )
        rows = rows[np.sort(keep)]
    return ClientData(user, rows)


def stream_federated(clients: Callable[[], Iterable[tuple[str, list[str]]]], tokenizer: Tokenizer,
                     cut: tuple[int, int, float, int, int | None], users: Sequence[str] | None = None
                     ) -> tuple[Iterator[ClientData], list[ClientData]]:
    """`build_federated` for a file too large to hold: (the training clients, made one at a time
    as the returned iterator is read, e.g. by `client_store.write_store`; the held-out clients).

    `clients()` opens a fresh pass over (user, texts) one user at a time (`data_files.iter_clients`).
    The seeded split needs every user id first: `users` (the file's index of them,
    `data_files.client_ids`), else a first pass of `clients()`; a client the index does not list
    is an error. The same
    users, rows and split as `build_federated` on the same records, in the file's client order
    (sorted by id for TFF's files, as `build_federated`'s). Held-out clients are kept in memory:
    `test_fraction` of the users, and evaluation reads their rows anyway; the list fills as the
    iterator is read and is complete once it is exhausted. `cut` is (seq_len, max_examples,
    test_fraction, seed, max_clients or None), as `build_federated` takes them."""
    seq_len, max_examples, test_fraction, seed, max_clients = cut
    if seq_len < 1 or max_examples < 1:
        raise DpfleetError("data.seq_len and data.max_examples must be positive")
    listed = users is not None
    users = list(users) if listed else [u for u, _ in clients()]
    train_users, test_users = split_users(users, test_fraction, seed)
    if len(set(train_users + test_users)) != len(train_users) + len(test_users):
        raise DpfleetError("a user's records are not together in the file; streaming needs each "
                           "user's records in one run (sort the file by user)")
    train, test = set(train_users[:max_clients] if max_clients else train_users), set(test_users)
    known = set(users) if listed else set()
    held_out: list[ClientData] = []

    def trained() -> Iterator[ClientData]:
        for user, texts in clients():
            if listed and user not in known:
                raise DpfleetError(f"client {user!r} has examples but is not in the file's list of "
                                   "clients (TFF's client_metadata, LEAF's users)")
            if user in train or user in test:
                client = make_client(user, texts, tokenizer, seq_len, max_examples, seed)
                if client is not None and user in test:
                    held_out.append(client)
                elif client is not None:
                    yield client

    return trained(), held_out


def describe(data: FederatedData) -> dict:
    """Clients, examples, tokens and the distribution of examples per client."""

    def part(clients: list[ClientData]) -> dict:
        counts = np.array([len(c.examples) for c in clients]) if clients else np.zeros(1)
        q = np.percentile(counts, [0, 10, 25, 50, 75, 90, 100])
        return {
            "clients": len(clients),
            "examples": int(counts.sum()),
            "tokens": int(sum(c.num_tokens for c in clients)),
            "examples_per_client": dict(
                zip(["min", "p10", "p25", "median", "p75", "p90", "max"], map(float, q), strict=True)
            ),
            "mean_examples_per_client": float(counts.mean()),
        }

    return {"seq_len": data.seq_len, "train": part(data.train), "test": part(data.test)}
