"""Users' text from the field's file formats, streamed: TFF SQLite and HDF5, LEAF JSON, jsonl.

Every reader is a generator of (client id, that client's texts), one client at a time, so a file
of many GB is never loaded whole (edge/data_tff_sql.py, data_tff_h5.py, data_leaf.py; jsonl here,
in sorted user order: an unsorted file goes through a private temporary SQLite table first).
`[data] dataset` names the format (`tff_sqlite`, `tff_h5`, `leaf`, `jsonl`) with `path`, `split`
and `feature`; `dpfleet data inspect FILE` infers it from the file's first bytes and summarises
the file in one pass (users, examples, tokens per user at percentiles) holding two counts per user.
"""

from __future__ import annotations

import itertools
import json
import sqlite3
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from dpfleet.edge import data_leaf, data_tff_h5, data_tff_sql
from dpfleet.errors import DpfleetError
from dpfleet.progress import progress_bar

ClientTexts = Iterator[tuple[str, list[str]]]

FILE_FORMATS = {
    "tff_sqlite": "TFF's SQLite ClientData (examples of tf.train.Example protos; needs path, split)",
    "tff_h5": "TFF's older HDF5 ClientData (examples/<client_id>/<feature>; needs path, h5py)",
    "leaf": "LEAF's JSON (users, num_samples, user_data{x, y}); a file or a split folder",
}
_MAGIC = {b"SQLite format 3\x00": "tff_sqlite", b"\x89HDF\r\n\x1a\n": "tff_h5"}
_SUFFIX = {".json": "leaf", ".jsonl": "jsonl", ".sqlite": "tff_sqlite", ".db": "tff_sqlite",
           ".h5": "tff_h5", ".hdf5": "tff_h5"}
PERCENTILES = (50, 90, 99, 100)


def iter_jsonl(path: Path) -> Iterator[tuple[str, str]]:
    """(user, text) of each line of a `{"user": ..., "text": ...}` file, read line by line."""
    path = Path(path)
    if not path.is_file():
        raise DpfleetError(f"jsonl file not found: {path}")
    with path.open(encoding="utf-8") as fh:
        try:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DpfleetError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
                if not isinstance(obj, dict) or not isinstance(obj.get("text"), str) or "user" not in obj:
                    raise DpfleetError(f'{path}:{lineno}: expected {{"user": ..., "text": "..."}}')
                yield str(obj["user"]), obj["text"]
        except UnicodeDecodeError as exc:
            raise DpfleetError(f"{path}: after line {lineno}: not UTF-8 text ({exc.reason})") from exc


def _jsonl_clients(path: Path, split: str = "", feature: str = "") -> ClientTexts:
    """A jsonl file's users in sorted order, each with its lines in file order: the users and
    texts `group_by_user` gives, in `build_federated`'s order, holding one user at a time.

    A file already sorted by user is read once more, line by line. Any other (users interleaved
    or unsorted) is first copied into a private temporary SQLite table and read back ordered by
    user (SQLite sorts on disk; its page cache is bounded), never held in memory whole."""
    if _sorted_by_user(path):
        for user, lines in itertools.groupby(iter_jsonl(path), key=lambda r: r[0]):
            yield user, [text for _, text in lines]
        return
    with tempfile.TemporaryDirectory(prefix="dpfleet-jsonl-") as tmp:  # 0700: the text is private
        con = sqlite3.connect(Path(tmp) / "lines.sqlite")
        try:
            con.execute("PRAGMA journal_mode = OFF")
            con.execute("CREATE TABLE lines (user TEXT NOT NULL, text TEXT NOT NULL)")
            con.executemany("INSERT INTO lines VALUES (?, ?)", iter_jsonl(path))
            con.execute("CREATE INDEX by_user ON lines (user)")  # BINARY: code point order, as str's
            rows = con.execute("SELECT user, text FROM lines ORDER BY user, rowid")
            for user, lines in itertools.groupby(rows, key=lambda r: r[0]):
                yield user, [text for _, text in lines]
        finally:
            con.close()


def _sorted_by_user(path: Path) -> bool:
    """Whether every line's user is >= the one before (so each user's lines are together)."""
    last = None
    for user, _ in iter_jsonl(path):
        if last is not None and user < last:
            return False
        last = user
    return True


def _jsonl_ids(path: Path, split: str = "") -> list[str]:
    """A jsonl file's users, sorted (the order `_jsonl_clients` gives them), from one pass."""
    return sorted({user for user, _ in iter_jsonl(path)})


READERS: dict[str, Callable[..., ClientTexts]] = {
    "tff_sqlite": data_tff_sql.iter_clients,
    "tff_h5": data_tff_h5.iter_clients,
    "leaf": data_leaf.iter_clients,
    "jsonl": _jsonl_clients,
}


def client_ids(path: Path, fmt: str = "", split: str = "train") -> list[str]:
    """The file's client ids, from its index when the format has one (TFF's `client_metadata`,
    HDF5 group names, LEAF's `users`), else from a pass over its lines (jsonl, sorted)."""
    fmt = fmt or infer_format(path)
    listed = {"tff_sqlite": data_tff_sql.client_ids, "tff_h5": data_tff_h5.client_ids,
              "leaf": data_leaf.client_ids, "jsonl": _jsonl_ids}
    return listed[_known(fmt)](Path(path), split)


def infer_format(path: Path) -> str:
    """The format of `path` from its first bytes (SQLite, HDF5), else its suffix; a folder is LEAF."""
    path = Path(path)
    if path.is_dir():
        return "leaf"
    if not path.is_file():
        raise DpfleetError(f"file not found: {path}")
    with path.open("rb") as fh:
        head = fh.read(16)
    for magic, name in _MAGIC.items():
        if head.startswith(magic):
            return name
    if path.suffix.lower() in _SUFFIX:
        return _SUFFIX[path.suffix.lower()]
    raise DpfleetError(f"{path}: cannot tell its format; expected a TFF SQLite or HDF5 file, LEAF "
                       f"JSON or jsonl (name it with --format: {', '.join(READERS)})")


def iter_clients(path: Path, fmt: str = "", split: str = "train", feature: str = "") -> ClientTexts:
    """(client id, texts) per client of a file in `fmt` (inferred when ""), streamed."""
    return READERS[_known(fmt or infer_format(path))](Path(path), split, feature)


def _known(fmt: str) -> str:
    if fmt not in READERS:
        raise DpfleetError(f"unknown file format {fmt!r}; choose from {', '.join(READERS)}")
    return fmt


def summarize(path: Path, fmt: str = "", split: str = "train", feature: str = "",
              progress: bool = False) -> dict:
    """Users, examples and whitespace tokens of a file, with per-user percentiles, in one pass.

    A user's tokens here are whitespace-separated words (TFF's StackOverflow `tokens` are words
    joined by spaces), so the numbers are the file's, before any tokenizer."""
    fmt = fmt or infer_format(path)
    per_user: dict[str, list[int]] = {}
    clients = iter_clients(path, fmt, split, feature)
    bar = progress_bar(clients, desc="reading", unit="user", enabled=progress, leave=False)
    for user, texts in bar:
        counts = per_user.setdefault(user, [0, 0])
        counts[0] += len(texts)
        counts[1] += sum(len(t.split()) for t in texts)
    if not per_user:
        raise DpfleetError(f"{path}: no examples" + (f" in split {split!r}" if split else ""))
    table = np.array(list(per_user.values()), dtype=np.int64)

    def spread(column: np.ndarray) -> dict:
        values = np.percentile(column, PERCENTILES, method="lower")
        return {("max" if p == 100 else f"p{p}"): int(v) for p, v in zip(PERCENTILES, values, strict=True)}

    return {"path": str(path), "format": fmt, "split": split if fmt == "tff_sqlite" else "",
            "users": len(per_user), "examples": int(table[:, 0].sum()), "tokens": int(table[:, 1].sum()),
            "examples_per_user": spread(table[:, 0]), "tokens_per_user": spread(table[:, 1])}
