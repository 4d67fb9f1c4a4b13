"""The coordinator service's durable state: one SQLite database (WAL, synchronous=FULL) plus files.

Layout of a state directory:
    state.sqlite (+ -wal, -shm)  the tables below
    lock                         flock'ed by the one process that has the state open
    noise_key                    the run's 32-byte noise key, alone, mode 0600 (never in the DB:
                                 a copied or backed-up database must not let anyone remove noise)
    rounds/NNNNNN/               server_state.safetensors + .json after committed round NNNNNN:
                                 theta (the model served), momentum, the live tree nodes (noise
                                 secrets, hence mode 0700) and the clip estimator; the last only
    .fingerprint_key, checkpoint/, privacy.json, ...   as in a run directory (`run_dir`)

Tables and the invariant each one carries (WHY):
    meta(key, value)        schema_version and the resolved config (JSON). A database of another
                            schema or another config is refused: its rounds would be read as
                            this run's releases (wrong accounting, or noise nodes reused).
    devices(id, public_key, registered_at, last_round, participations, state)
                            one row per device; public_key is its identity key (NULL for the
                            in-process devices of a simulation). The counters change only
                            inside `commit_round`, so they always equal the participation rows.
    rounds(round, status, plan_sha256, model_sha256, opened_at, committed_at, failed_reason,
           attempts)        status open -> committed | failed. A round found open on reopening
                            failed (nothing of it was released); it may be opened again under the
                            same number, because round numbers count releases. committed is final.
    releases(round, tree_id, t, nodes, key_id, participants, restart, clip_norm, released,
             data_sha256, mechanism, mechanism_sha256, guarantee)
                            the fields of releases.jsonl (`release_log`), one row per released
                            round. Append-only (triggers refuse UPDATE / DELETE: a released round
                            is never recomputed) and UNIQUE(key_id, tree_id, t): one sum per
                            noise position, enforced by the database itself. `guarantee` (JSON)
                            binds the config the round was released under: meta's config edited
                            between two starts is refused by the restart (`guarantee`).
    participation(round, device)   whose clipped update is in round's sum: what the accountant
                            and the MinS / MaxP guard replay on reopening.
    metrics(round, record), debug_nonprivate(round, record)   the engine's per-round logs (JSON),
                            committed with the release: a released round always has its metrics
                            row (what status, history and metrics.jsonl are read from).

The commit (`commit_round`): the engine first builds the round's metrics record (DP quantities,
held-out evaluation when due) and debug record; the round's server state is written to
rounds/NNNNNN.tmp, every file fsynced, the folder renamed into place and the parent fsynced
(fault points files_written, files_fsynced, files_renamed); THEN one transaction inserts the
release row (release_row) and the participation rows (participation_rows), bumps the device
counters (device_counters), inserts the metrics (and debug_nonprivate) rows (metrics_row) and
marks the round committed (round_status), then COMMIT (committed). Nothing of the round may be
served before `commit_round` returns. A crash before COMMIT leaves none of the round (the
leftover folder is deleted on reopening: that round was never released, so its noise nodes were
never seen); a crash after it leaves all of it, and the committed folder is exactly the state to
continue from, so no round is ever lost, redone or half-recorded. (Before, the metrics row was a
later transaction of its own: a kill between the two left a released round without metrics, and
status then failed on it. A state written so still opens: the missing row is rebuilt from the
release log and the replayed accountant, marked `rebuilt_after_crash`.)
"""

from __future__ import annotations

import fcntl
import json
import shutil
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from dpfleet.coordinator.state.release_log import LOGS, ReleaseLog, check_logs, release_record
from dpfleet.coordinator.state.resume import (
    FINGERPRINT_KEY,
    KEY_FILE,
    differing_keys,
)
from dpfleet.errors import DpfleetError
from dpfleet.io import append_text, atomic_write, fsync_path, private_mkdir
from dpfleet.jsonio import dumps

SCHEMA_VERSION = 3  # 2: releases carry the mechanism and its fingerprint; 3: and the guarantee
DB_FILE = "state.sqlite"
ROUNDS_DIR = "rounds"
LOCK_FILE = "lock"  # flock: one coordinator process per state directory
SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE devices (
    id TEXT PRIMARY KEY,
    public_key BLOB,
    registered_at REAL NOT NULL,
    last_round INTEGER,
    participations INTEGER NOT NULL DEFAULT 0,
    state TEXT NOT NULL DEFAULT 'idle' CHECK (state IN ('idle', 'assigned', 'retired'))
);
CREATE TABLE rounds (
    round INTEGER PRIMARY KEY,
    status TEXT NOT NULL CHECK (status IN ('open', 'committed', 'failed')),
    plan_sha256 TEXT,
    model_sha256 TEXT,
    opened_at REAL,
    committed_at REAL,
    failed_reason TEXT,
    attempts INTEGER NOT NULL DEFAULT 1
);
CREATE TABLE releases (
    round INTEGER PRIMARY KEY,
    tree_id INTEGER NOT NULL,
    t INTEGER NOT NULL,
    nodes TEXT NOT NULL,
    key_id TEXT NOT NULL,
    participants TEXT NOT NULL,
    restart INTEGER NOT NULL,
    clip_norm REAL NOT NULL,
    released TEXT NOT NULL,
    data_sha256 TEXT NOT NULL,
    mechanism TEXT NOT NULL,
    mechanism_sha256 TEXT NOT NULL,
    guarantee TEXT,
    UNIQUE (key_id, tree_id, t)
);
CREATE TRIGGER releases_never_updated BEFORE UPDATE ON releases
    BEGIN SELECT RAISE(ABORT, 'a released round is never rewritten'); END;
CREATE TRIGGER releases_never_deleted BEFORE DELETE ON releases
    BEGIN SELECT RAISE(ABORT, 'a released round is never removed'); END;
CREATE TABLE participation (
    round INTEGER NOT NULL REFERENCES releases(round),
    device TEXT NOT NULL REFERENCES devices(id),
    PRIMARY KEY (round, device)
);
CREATE TABLE metrics (round INTEGER PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE debug_nonprivate (round INTEGER PRIMARY KEY, record TEXT NOT NULL);
"""
RELEASE_FIELDS = ("round", "tree_id", "t", "nodes", "key_id", "participants", "restart",
                  "clip_norm", "released", "data_sha256", "mechanism", "mechanism_sha256", "guarantee")
JSON_FIELDS = ("nodes", "participants", "guarantee")  # stored as JSON text


def _no_fault(point: str) -> None:
    return None


class StateStore:
    """One coordinator's durable state (module docstring). Open it with `StateStore(dir, cfg)`:
    a new directory is created, an existing one must hold this schema and this config."""

    def __init__(self, path: Path, resolved: dict):
        self.path = Path(path)
        self.db_path = self.path / DB_FILE
        # a test's crash injection: called with the name of each step of commit_round
        self.fault: Callable[[str], None] = _no_fault
        if self.path.exists() and not self.path.is_dir():
            raise DpfleetError(f"state {self.path} is a file, not a state directory")
        if self.path.is_dir() and any(self.path.iterdir()) and not self.db_path.is_file():
            raise DpfleetError(f"{self.path} is not empty and has no {DB_FILE}: not a coordinator "
                               "state directory; choose an empty or new --state")
        fresh = not self.db_path.is_file()
        private_mkdir(self.path)
        append_text(self.path / LOCK_FILE, "")  # 0600, like the database created next to it
        self._lock = (self.path / LOCK_FILE).open("a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise DpfleetError(f"{self.path} is in use by another coordinator process") from None
        self.db = None
        try:
            self._open(resolved, fresh)
        except BaseException:
            self.close()
            raise

    def _open(self, resolved: dict, fresh: bool) -> None:
        private_mkdir(self.path / ROUNDS_DIR)
        try:
            append_text(self.db_path, "")  # 0600 before SQLite opens it: its -wal / -shm copy the mode
            self.db = sqlite3.connect(self.db_path, isolation_level=None)  # explicit transactions
            self.db.execute("PRAGMA foreign_keys = ON")
            if self.db.execute("PRAGMA journal_mode = WAL").fetchone()[0] != "wal":
                raise DpfleetError(f"{self.db_path}: SQLite refused WAL mode (a network file system?)")
            self.db.execute("PRAGMA synchronous = FULL")
            # a crash while creating leaves a database without tables: still a fresh state
            if fresh or not self.db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0]:
                self._create(resolved)
            else:
                self._check(resolved)
        except sqlite3.DatabaseError as exc:
            raise DpfleetError(f"{self.db_path} is not a readable SQLite database: {exc}") from None
        self._recover()

    def _create(self, resolved: dict) -> None:
        with self._transaction():
            for statement in SCHEMA.split(";\n"):
                if statement.strip():
                    self.db.execute(statement)
            self.db.executemany("INSERT INTO meta VALUES (?, ?)", [
                ("schema_version", str(SCHEMA_VERSION)), ("config", dumps(resolved)),
                ("created_at", repr(time.time())), ("finished", "0")])

    def bind_plan(self, sha256: str) -> None:
        """The sha256 of the plan (plan.json) this state runs, kept with its rounds: a restart
        whose plan differs is refused (`bound_plan`), as an edit would change the noise and the
        participation limits under rounds already released."""
        with self._transaction():
            self.db.execute("INSERT OR REPLACE INTO meta VALUES ('plan_sha256', ?)", (sha256,))

    def bound_plan(self) -> str | None:
        return self._meta().get("plan_sha256")

    def _meta(self) -> dict[str, str]:
        return dict(self.db.execute("SELECT key, value FROM meta").fetchall())

    def _check(self, resolved: dict) -> None:
        try:
            meta = self._meta()
        except sqlite3.OperationalError:
            raise DpfleetError(f"{self.db_path} is not a dpfleet coordinator state (no meta table)") from None
        version = meta.get("schema_version")
        if version != str(SCHEMA_VERSION):
            raise DpfleetError(f"{self.db_path} has state schema version {version}, this dpfleet "
                               f"reads version {SCHEMA_VERSION}: use the dpfleet that wrote it")
        changed = differing_keys(json.loads(meta["config"]), json.loads(dumps(resolved)))
        if changed:
            raise DpfleetError(f"{self.path} was started with another config (it differs in "
                               f"{', '.join(changed)}); continue it with the config it was started "
                               "with, or choose a new --state")

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def _recover(self) -> None:
        """After a crash: open rounds failed, state folders of uncommitted or old rounds gone."""
        with self._transaction():
            self.db.execute("UPDATE rounds SET status = 'failed', failed_reason = 'the coordinator "
                            "stopped while the round was open' WHERE status = 'open'")
        last = self.last_committed()
        for folder in (self.path / ROUNDS_DIR).iterdir():
            if folder.name != f"{last:06d}":
                shutil.rmtree(folder)

    @property
    def finished(self) -> bool:
        return self._meta()["finished"] == "1"

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
        self._lock.close()  # releases the flock

    # devices -----------------------------------------------------------------------------------
    def register_device(self, device: str, public_key: bytes | None = None) -> None:
        """A new device; registering an id again with another key is refused (no takeover)."""
        row = self.db.execute("SELECT public_key FROM devices WHERE id = ?", (device,)).fetchone()
        if row is not None:
            if row[0] != public_key:
                raise DpfleetError(f"device {device!r} is registered with another identity key")
            return
        with self._transaction():
            self.db.execute("INSERT INTO devices (id, public_key, registered_at) VALUES (?, ?, ?)",
                            (device, public_key, time.time()))

    def bind_key(self, device: str, public_key: bytes) -> bool:
        """A known device's identity key, bound once (the service's registration): True when
        newly bound, False when it already holds this key; another key is refused."""
        row = self.db.execute("SELECT public_key FROM devices WHERE id = ?", (device,)).fetchone()
        if row is None:
            raise DpfleetError(f"device {device!r} is not part of this run's fleet")
        if row[0] is not None:
            if row[0] != public_key:
                raise DpfleetError(f"device {device!r} is registered with another identity key")
            return False
        with self._transaction():
            self.db.execute("UPDATE devices SET public_key = ? WHERE id = ? AND public_key IS NULL",
                            (public_key, device))
        return True

    def register_devices(self, devices: Sequence[str]) -> None:
        """Keyless devices (a simulation's in-process fleet), in one transaction."""
        with self._transaction():
            self.db.executemany("INSERT OR IGNORE INTO devices (id, registered_at) VALUES (?, ?)",
                                [(d, time.time()) for d in devices])

    def device(self, device: str) -> dict | None:
        cur = self.db.execute("SELECT * FROM devices WHERE id = ?", (device,))
        row = cur.fetchone()
        return None if row is None else dict(zip([c[0] for c in cur.description], row, strict=True))

    # rounds ------------------------------------------------------------------------------------
    def last_committed(self) -> int:
        return self.db.execute("SELECT COALESCE(MAX(round), 0) FROM releases").fetchone()[0]

    def open_round(self, round: int, plan_sha256: str) -> None:
        """Mark 1-based `round` open (again, after a failure); a committed round is refused."""
        if round != self.last_committed() + 1:
            raise DpfleetError(f"round {round} cannot open: round {self.last_committed()} is the "
                               "last committed one")
        with self._transaction():
            self.db.execute(
                "INSERT INTO rounds (round, status, plan_sha256, opened_at) VALUES (?, 'open', ?, ?) "
                "ON CONFLICT(round) DO UPDATE SET status = 'open', plan_sha256 = excluded.plan_sha256, "
                "opened_at = excluded.opened_at, failed_reason = NULL, attempts = attempts + 1",
                (round, plan_sha256, time.time()))

    def fail_round(self, round: int, reason: str) -> None:
        """An open round that will not commit (report goal missed): nothing of it was released."""
        with self._transaction():
            cur = self.db.execute("UPDATE rounds SET status = 'failed', failed_reason = ? "
                                  "WHERE round = ? AND status = 'open'", (reason, round))
            if cur.rowcount != 1:
                raise DpfleetError(f"round {round} is not open: only an open round can fail")

    def round(self, round: int) -> dict | None:
        cur = self.db.execute("SELECT * FROM rounds WHERE round = ?", (round,))
        row = cur.fetchone()
        return None if row is None else dict(zip([c[0] for c in cur.description], row, strict=True))

    def round_folder(self, round: int) -> Path:
        return self.path / ROUNDS_DIR / f"{round:06d}"

    def _write_files(self, round: int, write_state: Callable[[Path], None]) -> None:
        tmp, final = self.round_folder(round).with_suffix(".tmp"), self.round_folder(round)
        shutil.rmtree(tmp, ignore_errors=True)
        private_mkdir(tmp)
        write_state(tmp)
        self.fault("files_written")
        for f in tmp.iterdir():
            fsync_path(f)
        fsync_path(tmp)
        self.fault("files_fsynced")
        shutil.rmtree(final, ignore_errors=True)  # a leftover of an uncommitted attempt
        tmp.rename(final)
        fsync_path(final.parent)
        self.fault("files_renamed")

    def commit_round(self, release: dict, model_sha256: str,
                     write_state: Callable[[Path], None], logs: Mapping[str, dict]) -> None:
        """Files first (written into a folder, fsynced, renamed), then ONE transaction: release
        row, participation rows, device counters, the round's `logs` rows ("metrics", required,
        and "debug_nonprivate"), round status. Serve nothing before it returns."""
        r = release["round"]
        if r != self.last_committed() + 1:
            raise DpfleetError(f"round {r} cannot commit after round {self.last_committed()}: "
                               "rounds commit once, in order")
        check_logs(r, logs)
        self._write_files(r, write_state)
        now = time.time()
        try:
            with self._transaction():
                self.db.execute(f"INSERT INTO releases VALUES ({', '.join('?' * len(RELEASE_FIELDS))})",
                                [json.dumps(release.get(k)) if k in JSON_FIELDS
                                 else release.get(k, "tree") if k == "mechanism"
                                 else release[k] for k in RELEASE_FIELDS])
                self.fault("release_row")
                self.db.executemany("INSERT INTO participation VALUES (?, ?)",
                                    [(r, d) for d in release["participants"]])
                self.fault("participation_rows")
                self.db.executemany("UPDATE devices SET participations = participations + 1, "
                                    "last_round = ? WHERE id = ?",
                                    [(r, d) for d in release["participants"]])
                self.fault("device_counters")
                self._insert_logs(logs.items())
                self.fault("metrics_row")
                self.db.execute(
                    "INSERT INTO rounds (round, status, model_sha256, opened_at, committed_at) "
                    "VALUES (?, 'committed', ?, ?, ?) ON CONFLICT(round) DO UPDATE SET "
                    "status = 'committed', model_sha256 = excluded.model_sha256, "
                    "committed_at = excluded.committed_at, failed_reason = NULL",
                    (r, model_sha256, now, now))
                self.fault("round_status")
        except sqlite3.IntegrityError as exc:
            shutil.rmtree(self.round_folder(r))  # refused: the round never happened
            raise DpfleetError(f"round {r} was not committed: {exc} (an unregistered device, or "
                               "a noise position released before)") from None
        self.fault("committed")
        shutil.rmtree(self.round_folder(r - 1), ignore_errors=True)

    # reads ------------------------------------------------------------------------------------
    def releases(self) -> list[dict]:
        """The release rows as releases.jsonl's records (same fields, same JSON types)."""
        rows = self.db.execute(f"SELECT {', '.join(RELEASE_FIELDS)} FROM releases ORDER BY round")
        out = []
        for row in rows:
            record = dict(zip(RELEASE_FIELDS, row, strict=True))
            record.update({k: json.loads(record[k]) for k in JSON_FIELDS}, restart=bool(record["restart"]))
            if record["mechanism"] == "tree":  # as releases.jsonl writes it (`release_record`)
                del record["mechanism"]
            out.append(record)
        return out

    def participation(self) -> dict[int, set[str]]:
        out: dict[int, set[str]] = {}
        for r, d in self.db.execute("SELECT round, device FROM participation"):
            out.setdefault(r, set()).add(d)
        return out

    def log(self, table: str) -> list[dict]:
        """metrics or debug_nonprivate records, by round."""
        if table not in ("metrics", "debug_nonprivate"):
            raise ValueError(table)
        return [json.loads(x) for (x,) in self.db.execute(f"SELECT record FROM {table} ORDER BY round")]

    def _insert_logs(self, records: Iterable[tuple[str, dict]]) -> None:
        for table, record in records:
            if table not in LOGS:
                raise ValueError(table)
            self.db.execute(f"INSERT INTO {table} VALUES (?, ?)", (record["round"], dumps(record)))

    def rebuild_metrics(self, records: Sequence[dict]) -> list[int]:
        """Metrics rows for released rounds that have none (a state written before the rows
        were committed with the release), in one transaction; returns the rounds filled."""
        have = {r for (r,) in self.db.execute("SELECT round FROM metrics")}
        released = {r for (r,) in self.db.execute("SELECT round FROM releases")}
        missing = [m for m in records if m["round"] in released - have]
        if missing:
            with self._transaction():
                self._insert_logs(("metrics", m) for m in missing)
        return [m["round"] for m in missing]

    def export_participation(self) -> Path:
        """participation.jsonl from the committed rows (release order), for the privacy report:
        the report accounts exactly what the store committed."""
        entries = [{"round": r["round"] - 1, "devices": r["participants"], "restart": r["restart"]}
                   for r in self.releases()]
        atomic_write(self.path / "participation.jsonl", "".join(dumps(e) + "\n" for e in entries))
        return self.path / "participation.jsonl"

    def mark_finished(self) -> None:
        """The run is over: the noise key and the node vectors go (a finished tree never grows)."""
        with self._transaction():
            self.db.execute("UPDATE meta SET value = '1' WHERE key = 'finished'")
        (self.path / KEY_FILE).unlink(missing_ok=True)
        (self.path / FINGERPRINT_KEY).unlink(missing_ok=True)
        shutil.rmtree(self.path / ROUNDS_DIR, ignore_errors=True)


class StoreReleaseLog(ReleaseLog):
    """`ReleaseLog` over the store's releases table: recording a release commits the round."""

    def __init__(self, store: StateStore):
        self.store, self.path = store, store.db_path
        self._records = store.releases()
        self.write_state: Callable[[Path], None] | None = None  # set by `store_engine.open_engine`
        self.model_sha256: Callable[[], str] | None = None

    def record_release(self, *, logs: Mapping[str, dict] | None = None, **fields) -> dict:
        if self.write_state is None or self.model_sha256 is None:
            raise DpfleetError("the store's release log is not bound to an engine (use open_engine)")
        record = release_record(**fields)
        self.store.commit_round(record, self.model_sha256(), self.write_state, logs or {})
        self._records.append(json.loads(json.dumps(record)))
        return record


class SqliteSink:
    """The engine's RunSink on the store: participation (like metrics and debug rows) is
    committed with the release, so the engine's participation entry is only checked against it."""

    def __init__(self, store: StateStore):
        self.store = store

    def participation(self, entry: dict) -> None:
        committed = self.store.participation().get(entry["round"] + 1, set())
        if committed != set(entry["devices"]):
            raise DpfleetError(f"round {entry['round'] + 1}: the engine's participation differs "
                               "from the committed rows")


def finish_run(store: StateStore, engine, **finish_kwargs) -> tuple[dict, dict]:
    """`engine.finish` (final evaluation, checkpoint without node vectors, privacy report from the
    committed participation) and the store marked finished: key and node vectors removed."""
    store.export_participation()
    out = engine.finish(**finish_kwargs)
    store.mark_finished()
    return out
