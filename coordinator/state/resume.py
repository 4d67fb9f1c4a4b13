"""A run's resume point on disk: its folder (`resume/`), the secret noise key and fingerprint
key files, the server state files' reader, and the config check of a resume.

Why apart from the engine's resume (`engine.restore`, whose docstring has the design): these are
files and keys, read and written by the run directory, the SQLite state store and the service
without any of the engine's objects; the engine saves its DP-FTRL server and clip estimator into
them and replays the released rounds through its participation and accountant.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file as load_numpy

from dpfleet.coordinator.mechanisms.noise_stream import KEY_BYTES
from dpfleet.coordinator.state.mechanism_binding import saved_config
from dpfleet.coordinator.state.run_dir import write_secret
from dpfleet.coordinator.state.trackers import WRITERS
from dpfleet.errors import DpfleetError

RESUME = "resume"  # folder in the run directory; gone once the run has finished
KEY_FILE = "noise_key"
FINGERPRINT_KEY = ".fingerprint_key"  # in the run directory while the run is unfinished


def fingerprint_secret(run_path: Path, create: bool) -> bytes:
    """The run's secret for `data_fingerprint`: `.fingerprint_key` (0600), made when a run
    starts and removed with the resume point when it finishes (`discard_resume`).

    Why secret: the fingerprint goes into every line of `releases.jsonl`, which a user may
    publish. A plain hash of the data is a deterministic, non-private release: whoever knows
    every other client's text could test two guesses of one client's text against it."""
    path = run_path / FINGERPRINT_KEY
    if create:
        path.unlink(missing_ok=True)
        write_secret(path, secrets.token_bytes(KEY_BYTES))
    if not path.is_file():
        raise DpfleetError(f"{run_path} has no {FINGERPRINT_KEY}: its training data cannot be checked "
                           "against the release log, so it cannot be resumed")
    return path.read_bytes()


def data_fingerprint(train_examples: Sequence[np.ndarray], tokenizer, secret: bytes) -> str:
    """HMAC-SHA256 under the run's secret over the training clients' token arrays (in order) and
    the saved tokenizer (`fingerprint_secret` says why it is keyed)."""
    digest = hmac.new(secret, digestmod=hashlib.sha256)
    for rows in train_examples:
        rows = np.ascontiguousarray(rows, dtype=np.int32)
        digest.update(repr(rows.shape).encode())
        digest.update(rows.tobytes())
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(Path(tmp))
        for f in sorted(p for p in Path(tmp).rglob("*") if p.is_file()):
            digest.update(f.relative_to(tmp).as_posix().encode())
            digest.update(f.read_bytes())
    return digest.hexdigest()


def write_key(folder: Path, key: bytes) -> None:
    """The noise key alone in `folder/noise_key`, created with mode 0600."""
    write_secret(folder / KEY_FILE, key)


def read_key(folder: Path) -> bytes:
    path = folder / KEY_FILE
    if not path.is_file():
        raise DpfleetError(f"{folder} has no {KEY_FILE}: the resume point is incomplete")
    key = path.read_bytes()
    if len(key) != KEY_BYTES:
        raise DpfleetError(f"{path} holds {len(key)} bytes, not a {KEY_BYTES}-byte noise key")
    return key


def load_server_state(folder: Path) -> tuple[dict, dict]:
    """(the server's state_dict, the rest of server_state.json) saved by `save_server_state`.
    The noise streams are rebuilt from the key by `Mechanism.resume`; a resume point of an older
    dpfleet also held the live tree nodes (tree_node_i arrays, clip_estimator.tree.noise): they
    are never read."""
    meta = json.loads((folder / "server_state.json").read_text())
    arrays = load_numpy(str(folder / "server_state.safetensors"))
    state = {"theta": arrays["theta"], "momentum": arrays["momentum"], "round": meta["round"],
             "clip_norm": meta["clip_norm"], "tree": meta["tree"]}
    return state, meta


# [service] settings an operator may change between restarts of a coordinator: deadlines, rate
# limits, the time scale. Not `overselect`: it changes the round size, hence the sensitivity.
OPERATIONAL = {"service": {"overselect"}}


def _accounted(config: dict) -> dict:
    """The config without its operational settings (those do not touch noise or accounting)."""
    out = dict(config)
    for section, kept in OPERATIONAL.items():
        if isinstance(out.get(section), dict):
            out[section] = {k: v for k, v in out[section].items() if k in kept}
    if isinstance(out.get("dp"), dict):  # a run saved before dp.mechanism existed used the tree
        out["dp"] = {"mechanism": "tree", **out["dp"]}
        out["dp"].pop("warn_epsilon", None)  # when the summary warns, not what the run computes
    out.pop("mechanism", None)  # the run's binding, checked on its own (`mechanism_binding`)
    if isinstance(out.get("client"), dict):  # "auto" resolves per CPU: checked as resolved (`restore`)
        out["client"] = {k: v for k, v in out["client"].items() if k != "precision"}
    for tracker in WRITERS:  # how the run is watched, not what it computes (a restart may switch it)
        out.pop(tracker, None)
    return out


def differing_keys(saved: dict, resolved: dict, keys: Sequence[str] | None = None) -> list[str]:
    """Top-level keys (all, or `keys`) where a config saved as JSON and a resolved one differ,
    operational service settings aside."""
    saved = _accounted(saved)
    current = _accounted(json.loads(json.dumps(resolved)))  # like with like: tuples become lists
    keys = sorted(set(saved) | set(current)) if keys is None else list(keys)
    return [k for k in keys if saved.get(k) != current.get(k)]


def check_resumable(path: Path, resolved: dict) -> None:
    """`path` is an unfinished run of exactly this config (else resuming would mix two runs)."""
    if not (path / "config.json").is_file():
        raise DpfleetError(f"{path} is not a run directory (no config.json): nothing to resume")
    if (path / "summary.json").is_file():
        raise DpfleetError(f"{path} is a finished run: nothing to resume")
    changed = differing_keys(saved_config(path), resolved)
    if changed:
        raise DpfleetError(f"{path} was started with another config (it differs in "
                           f"{', '.join(changed)}); resume it with the config it was started with")


@dataclass(frozen=True)
class Frozen:
    """A server's (or clip estimator's) state as it was at one moment, saved by `save_resume` in
    place of the live object: Ctrl-C during a round saves the state the last release left, which
    the open round has moved on from (`RoundEngine.save_interrupted`)."""

    state: dict
    mechanism: object = None  # the server's, for its binding
    noise_key: bytes = b""  # the server's

    def state_dict(self) -> dict:
        return self.state


def resume_point(run_path: Path) -> Path | None:
    for name in (RESUME, f"{RESUME}.old"):
        if (run_path / name / "server_state.json").is_file():
            return run_path / name
    return None


def discard_resume(run_path: Path) -> None:
    for suffix in ("", ".tmp", ".old"):
        shutil.rmtree(run_path / f"{RESUME}{suffix}", ignore_errors=True)
    (run_path / FINGERPRINT_KEY).unlink(missing_ok=True)


@dataclass(frozen=True)
class ResumeSource:
    """Where a resume reads its state when it is not a run directory's resume/ folder and
    metrics.jsonl (the SQLite state store, `state_store`): nothing is rewritten there."""

    point: Path | None  # the saved server state (save_server_state with `rounds_done`)
    key_folder: Path  # holds the noise key file
    metrics: list[dict]  # the logged per-round metrics
    # selection among the devices that checked in (the networked coordinator): check-ins are
    # not logged, so the replay takes each round's logged devices as the ones available
    networked: bool = False
