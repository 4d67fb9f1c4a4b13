"""TFF's SQLite `ClientData` files, streamed one client at a time.

The layout is TFF's (`simulation/datasets/sql_client_data.py`, `sql_client_data_utils.py`): an
`examples` table (`split_name`, `client_id`, `serialized_example_proto`: a serialized
`tf.train.Example`) and a `client_metadata` table (`client_id`, `split_name`, `num_examples`).
StackOverflow's examples carry `tokens` (the post, words joined by spaces), `title`, `tags`,
`creation_date`, `score` and `type`; Shakespeare's carry `snippets`.

Why one ordered cursor: a many-GB file must never be read whole. One `ORDER BY client_id, rowid`
query walks the table once (SQLite sorts on disk when it must), so the reader holds one client's
rows at a time, in the order TFF wrote them. The file is opened read-only.
"""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from dpfleet.edge.data_formats import example_text
from dpfleet.edge.tf_example import ExampleError, parse_example
from dpfleet.errors import DpfleetError

REQUIRED_TABLES = ("examples", "client_metadata")
# Where TFF's own loaders (tff.simulation.datasets.<name>.load_data) download its SQLite files,
# LZMA-compressed: a missing file's error names it, since dpfleet never downloads them itself.
TFF_DOWNLOADS = "https://storage.googleapis.com/tff-datasets-public/"
EXAMPLES_COLUMNS = ("split_name", "client_id", "serialized_example_proto")


def _connect(path: Path) -> sqlite3.Connection:
    if not path.is_file():
        raise DpfleetError(f"TFF SQLite file not found: {path} (TFF's files: {TFF_DOWNLOADS}NAME.sqlite"
                           ".lzma, e.g. stackoverflow.sqlite.lzma or shakespeare.sqlite.lzma; download "
                           "it and unxz it)")
    con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        missing = [t for t in REQUIRED_TABLES if t not in tables]
        if missing:
            raise DpfleetError(f"{path}: no table {', '.join(missing)}; expected TFF's SqlClientData "
                               "tables examples(split_name, client_id, serialized_example_proto) "
                               "and client_metadata(client_id, split_name, num_examples)")
        columns = {r[1] for r in con.execute("PRAGMA table_info(examples)")}
        missing = [c for c in EXAMPLES_COLUMNS if c not in columns]
        if missing:
            raise DpfleetError(f"{path}: table examples has no column {', '.join(missing)}; expected "
                               f"columns {', '.join(EXAMPLES_COLUMNS)}")
    except sqlite3.DatabaseError as exc:
        con.close()
        raise DpfleetError(f"{path}: not a readable SQLite database ({exc}); expected TFF's "
                           "SqlClientData file") from exc
    except DpfleetError:
        con.close()
        raise
    return con


def splits(path: Path) -> list[str]:
    """The split names of the file (TFF's StackOverflow: train, heldout, test), from the small
    `client_metadata` table TFF writes beside every client, not a scan of the examples."""
    con = _connect(Path(path))
    try:
        return sorted(r[0] for r in con.execute("SELECT DISTINCT split_name FROM client_metadata"))
    except sqlite3.DatabaseError as exc:
        raise DpfleetError(f"{path}: not a readable SQLite database ({exc})") from exc
    finally:
        con.close()


def client_ids(path: Path, split: str = "train") -> list[str]:
    """The split's client ids from `client_metadata` (as TFF's `SqlClientData` lists them), so a
    pass that needs only the ids does not read every example."""
    con = _connect(Path(path))
    query = "SELECT DISTINCT client_id FROM client_metadata" + (" WHERE split_name = ?" if split else "")
    try:
        return sorted(r[0] for r in con.execute(query, (split,) if split else ()))
    except sqlite3.DatabaseError as exc:
        raise DpfleetError(f"{path}: not a readable SQLite database ({exc})") from exc
    finally:
        con.close()


def iter_clients(path: Path, split: str = "train",
                 feature: str = "") -> Iterator[tuple[str, list[str]]]:
    """(client_id, its texts) per client, sorted by client id, one client in memory at a time.

    `split` "" reads every split; `feature` "" picks `tokens`, `snippets` or `text`."""
    path = Path(path)
    con = _connect(path)
    if split and split not in (names := splits(path)):
        con.close()
        raise DpfleetError(f"{path}: no split {split!r}; the file has {', '.join(names) or 'no examples'} "
                           "(data.split, or --split)")
    query = "SELECT rowid, client_id, serialized_example_proto FROM examples"
    query += " WHERE split_name = ?" if split else ""
    query += " ORDER BY client_id, rowid"
    rowid = "-"
    try:
        cursor = con.execute(query, (split,) if split else ())
        for client, rows in itertools.groupby(cursor, key=lambda r: r[1]):
            texts = []
            for rowid, client_id, blob in rows:
                where = f"examples row {rowid} (client {client_id!r})"
                if not isinstance(client_id, str) or not isinstance(blob, bytes):
                    raise DpfleetError(f"{path}: {where}: expected a TEXT client_id and a BLOB "
                                       "serialized_example_proto")
                try:
                    features = parse_example(blob)
                except ExampleError as exc:
                    raise DpfleetError(f"{path}: {where}: expected a serialized tf.train.Example "
                                       f"({exc})") from exc
                texts.append(example_text(features, feature, f"{path}: {where}"))
            yield client, texts
    except sqlite3.DatabaseError as exc:
        raise DpfleetError(f"{path}: reading after examples row {rowid} failed ({exc}); the file is "
                           "truncated or corrupt") from exc
    finally:
        con.close()
