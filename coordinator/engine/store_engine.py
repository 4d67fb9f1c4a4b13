"""The round engine on the SQLite state store (`state.state_store`): what `dpfleet service
serve` runs. Here, in the engine, not in the store: the store keeps devices, rounds and releases
and knows no engine; this builds one on it and hands the store its state writer.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dpfleet.coordinator.engine.restore import save_server_state
from dpfleet.coordinator.engine.round_engine import RoundEngine
from dpfleet.coordinator.state.release_log import release_hash
from dpfleet.coordinator.state.resume import KEY_FILE, ResumeSource, write_key
from dpfleet.coordinator.state.run_dir import RunDir
from dpfleet.coordinator.state.state_store import SqliteSink, StateStore, StoreReleaseLog
from dpfleet.errors import DpfleetError
from dpfleet.io import fsync_path


def open_engine(store: StateStore, cfg, *, users: Sequence[str], networked: bool = False,
                **engine_kwargs):
    """A RoundEngine on the store: continues after its last committed round (never re-releasing
    one), or starts one with a new noise key file (0600, next to the DB). `engine_kwargs` are the
    engine's (model, model_cfg, tokenizer, fingerprint, test_rows, vocabulary); `networked`:
    rounds were selected among check-ins (`resume.ResumeSource.networked`)."""
    if store.finished:
        raise DpfleetError(f"{store.path} holds a finished run: nothing to continue")
    store.register_devices(users)
    releases = StoreReleaseLog(store)
    done = store.last_committed()
    source = None
    if done:
        source = ResumeSource(point=store.round_folder(done), key_folder=store.path,
                              metrics=store.log("metrics"), networked=networked)
    engine = RoundEngine(cfg, RunDir(store.path, resume=True), users=users, sink=SqliteSink(store),
                         releases=releases, resume=bool(done), resume_source=source, **engine_kwargs)
    store.rebuild_metrics(engine.metrics)  # only a state of an older dpfleet can lack a row
    if not done:  # no round released yet: this (possibly new) key is the run's
        (store.path / KEY_FILE).unlink(missing_ok=True)
        write_key(store.path, engine.server.noise_key)
        fsync_path(store.path)

    def write_state(folder: Path) -> None:
        est = engine.estimator
        save_server_state(folder, engine.server, est.state_dict() if est else None,
                          {"rounds_done": engine.next_round, "guarantee": engine.guarantee,
                           "precision": engine.precision})

    def model_sha256() -> str:
        return release_hash(engine.server.theta)

    releases.write_state, releases.model_sha256 = write_state, model_sha256
    return engine
