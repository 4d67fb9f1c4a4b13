"""The release log: what each released round consumed, written before the round is released.

Why: a tree node's noise may be released on top of exactly one sum per position. If a crashed
round were recomputed with the same nodes on other data (a device's text moved on, another
device answered), the difference of the two releases would be noise-free. So every round is
*recorded before it is released*: `releases.jsonl` gets one JSON line per round, appended and
fsynced before anything of that round leaves the engine (metrics, participation log, evaluation,
checkpoint here; the broadcast of the new model in a networked fleet). A record holds

    round         1-based round number (the clock: rounds are never renumbered or redone)
    tree_id, t    the noise tree and the round's position in it (1-based)
    nodes         the (level, index) nodes of prefix t: what this release's noise is made of
    key_id        public name of the noise key (`noise_stream.key_id`; not the key)
    participants  the devices whose clipped updates are in the sum
    restart       the round starts a tree; clip_norm  the clip norm of that tree
    released      sha256 of the released model (and clip estimate): what left the engine
    data_sha256   fingerprint of the training clients' tokenized data
    mechanism     only for noise other than the tree's ("banded" / "blt", a caller's): then
                  tree_id is the noise segment, t the position in it, and nodes is empty
                  (release t's noise is made of the segment's draws 1..t)
    mechanism_sha256  the run's mechanism (`Mechanism.fingerprint`): a resume with another
                  mechanism or strategy is refused (`mechanism_binding`)
    guarantee     {"sha256", "inputs"}: the digest of everything the round's guarantee depends
                  on (z, C, rounds, MinS / MaxP, delta, mechanism, noise kind, population,
                  vocabulary source) and those plain values (`guarantee`): a resume whose config
                  differs in any of them is refused, naming them

Rules (transport-free; a SQLite-backed service applies the same ones):
1. Release only after the record is durable. A torn last line is a round that was not released
   (nothing left the engine) and is dropped.
2. A released round is never recomputed: the engine resumes at the round after the last record.
   When the saved state (resume point) is older than the last record, the rounds in between are
   *lost*: their models are out (maybe on devices) but their state is gone. They stay in the log,
   in the participation log and in the accounting (they were releases), and the run goes on from
   the saved model with a tree restart on a fresh tree id (`next_tree_id`): no node of a tree
   that released anything is ever used again, so the position (key, tree, t) of every release is
   unique, which `check_no_reuse` verifies. The lost updates are simply not in the model (like
   dropped rounds); the accountant pays for them anyway.
3. Resuming with other training data is refused (`data_sha256`), so recorded participants mean
   what they meant.
4. A round is recorded whole. Its per-round logs (metrics.jsonl: DP quantities and held-out
   evaluation; debug_nonprivate.jsonl when on) are built before the release and committed with it:
   here they go first to `round.pending` (fsynced; private, like resume/), then the release line
   (the commit point), then the log lines, then the pending file goes. Reopening finishes a
   pending round that was released (its lines appended once) and drops one that was not. (The
   state store commits the same rows in the release's transaction.) So no released round lacks
   its metrics line.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from dpfleet.coordinator.mechanisms.tree_noise import prefix_nodes
from dpfleet.errors import DpfleetError
from dpfleet.io import append_text
from dpfleet.jsonio import dumps

RELEASES = "releases.jsonl"
PENDING = "round.pending"  # the logs of the round being recorded (rule 4)
LOGS = ("metrics", "debug_nonprivate")  # the per-round logs committed with a release


def release_hash(theta: np.ndarray, clip_estimate: float | None = None) -> str:
    digest = hashlib.sha256(np.ascontiguousarray(theta).tobytes())
    if clip_estimate is not None:
        digest.update(repr(float(clip_estimate)).encode())
    return digest.hexdigest()


def release_record(*, round: int, tree_id: int, t: int, key_id: str, participants: Sequence[str],
                   restart: bool, clip_norm: float, released: str, data_sha256: str,
                   mechanism: str = "tree", mechanism_sha256: str = "",
                   guarantee: dict | None = None) -> dict:
    """One round's release record (the fields of the module docstring), as every log stores it."""
    record = {"round": round, "tree_id": tree_id, "t": t,
              "nodes": prefix_nodes(t) if mechanism == "tree" else [],
              "key_id": key_id, "participants": list(participants), "restart": restart,
              "clip_norm": clip_norm, "released": released, "data_sha256": data_sha256,
              "mechanism_sha256": mechanism_sha256, "guarantee": guarantee}
    if mechanism != "tree":
        record["mechanism"] = mechanism
    return record


def _fsync_append(path: Path, text: str) -> None:
    append_text(path, text, fsync=True)  # 0600, like every file of the run


def _logged_rounds(path: Path) -> set[int]:
    """Rounds of a JSON-lines log; a torn last line (a killed append) is cut off first."""
    if not path.is_file():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        with path.open("r+b") as fh:
            fh.truncate(len(data))
    return {json.loads(line)["round"] for line in data.decode().splitlines() if line.strip()}


def check_logs(round: int, logs: Mapping[str, dict]) -> None:
    """The logs a release commits: known names, each a record of that round, metrics always."""
    if "metrics" not in logs or set(logs) - set(LOGS):
        raise DpfleetError(f"round {round}: a release commits its metrics (and optionally "
                           f"debug_nonprivate) record, got {sorted(logs)}")
    for name, record in logs.items():
        if record.get("round") != round:
            raise DpfleetError(f"round {round}: its {name} record is for round {record.get('round')}")


class ReleaseLog:
    """Append-only, fsynced log of released rounds (`releases.jsonl` of a run directory), with
    each round's metrics / debug lines committed with it (rule 4) in the same folder."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.pending = self.path.with_name(PENDING)
        # a test's crash injection: called with the name of each step of record_release
        self.fault: Callable[[str], None] = lambda point: None
        self._records = self._read()
        self._finish_pending()

    def _read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        lines = self.path.read_text().splitlines(keepends=True)
        records = []
        for i, line in enumerate(lines):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if i == len(lines) - 1 and not line.endswith("\n"):  # torn append: never released
                    with self.path.open("r+") as fh:
                        fh.truncate(sum(len(x.encode()) for x in lines[:-1]))
                    break
                raise DpfleetError(f"{self.path} line {i + 1} is not valid JSON: the release log "
                                   "was edited; it cannot be trusted") from None
        return records

    def _finish_pending(self) -> None:
        """Rule 4 after a crash: a released round's logs are appended (once), an unreleased
        round's are dropped (a torn pending file was never followed by its release)."""
        if not self.pending.is_file():
            return
        try:
            pending = json.loads(self.pending.read_text())
        except json.JSONDecodeError:
            pending = None
        if pending is not None and pending["round"] in {r["round"] for r in self._records}:
            for name, record in pending["logs"].items():
                path = self.path.with_name(f"{name}.jsonl")
                if pending["round"] not in _logged_rounds(path):
                    _fsync_append(path, dumps(record) + "\n")
        self.pending.unlink()

    def record_release(self, *, round: int, tree_id: int, t: int, key_id: str,
                       participants: Sequence[str], restart: bool, clip_norm: float, released: str,
                       data_sha256: str, logs: Mapping[str, dict] | None = None,
                       mechanism: str = "tree", mechanism_sha256: str = "",
                       guarantee: dict | None = None) -> dict:
        """Append one round and fsync: call it before anything of the round is released.
        `logs` (name -> the round's record: "metrics", "debug_nonprivate") are committed with it
        (rule 4); the engine always passes its metrics."""
        record = release_record(round=round, tree_id=tree_id, t=t, key_id=key_id,
                                participants=participants, restart=restart, clip_norm=clip_norm,
                                released=released, data_sha256=data_sha256, mechanism=mechanism,
                                mechanism_sha256=mechanism_sha256, guarantee=guarantee)
        if logs:
            check_logs(round, logs)
            self.pending.unlink(missing_ok=True)
            _fsync_append(self.pending, dumps({"round": round, "logs": dict(logs)}))
            fd = os.open(self.pending.parent, os.O_RDONLY)  # its name, too, before the release
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self.fault("pending_written")
        _fsync_append(self.path, json.dumps(record) + "\n")  # the commit point
        self.fault("release_line")
        self._records.append(json.loads(json.dumps(record)))  # as it reads back
        if logs:
            for name, entry in logs.items():
                _fsync_append(self.path.with_name(f"{name}.jsonl"), dumps(entry) + "\n")
                self.fault(f"{name}_line")
            self.pending.unlink()
        return record

    def released_rounds(self) -> list[dict]:
        return list(self._records)

    def nodes_used(self) -> set[tuple[str, int, int, int]]:
        """(key_id, tree_id, level, index) of every node some release's noise contains."""
        return {(r["key_id"], r["tree_id"], lv, ix) for r in self._records for lv, ix in r["nodes"]}

    def next_tree_id(self) -> int:
        """A tree id no release has used (under any key)."""
        return 1 + max((r["tree_id"] for r in self._records), default=-1)


def check_no_reuse(records: Sequence[dict]) -> None:
    """Each (key, tree, position) is released once, and a tree's positions run 1, 2, 3, ...

    Two releases at one position share all their nodes; only one sum may ever carry them.
    """
    seen: dict[tuple, int] = {}
    last: dict[tuple, int] = {}
    for r in records:
        pos = (r["key_id"], r["tree_id"], r["t"])
        if pos in seen:
            raise DpfleetError(f"rounds {seen[pos]} and {r['round']} both released position "
                               f"{r['t']} of tree {r['tree_id']}: noise reused")
        tree = (r["key_id"], r["tree_id"])
        if r["t"] != last.get(tree, 0) + 1:
            raise DpfleetError(f"round {r['round']} releases position {r['t']} of tree "
                               f"{r['tree_id']} after position {last.get(tree, 0)}")
        seen[pos], last[tree] = r["round"], r["t"]
