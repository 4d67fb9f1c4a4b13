"""Everything a coordinator process needs before it answers a device: config, state, data, engine.

Why the coordinator prepares the data: this is an emulation, so it needs the tokenizer, the
held-out split (evaluation) and the training data's fingerprint (`resume.data_fingerprint`,
checked on every restart), exactly as `simulate` does (`simulation.prepare_data`). It never
sends a device anything of another device's data.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dpfleet.coordinator.config import SimulationConfig
from dpfleet.coordinator.engine.evaluation import split_held_out, unigram_baseline
from dpfleet.coordinator.engine.round_engine import RoundEngine
from dpfleet.coordinator.engine.simulation import prepare_data, vocabulary_privacy
from dpfleet.coordinator.state.resume import data_fingerprint, fingerprint_secret
from dpfleet.coordinator.state.run_dir import RunDir
from dpfleet.coordinator.state.state_store import StateStore, open_engine
from dpfleet.errors import DpfleetError
from dpfleet.export.models import build_model
from dpfleet.service.blobs import BlobStore, folder_tar
from dpfleet.service.run_bundle import RunBundle, run_bundle


def check_service_config(cfg: SimulationConfig) -> None:
    """What the service refuses up front (clear errors, never a silent weaker guarantee)."""
    if cfg.aggregation.kind == "secagg" and cfg.aggregation.dropout:
        raise DpfleetError("aggregation.dropout simulates dropouts in-process; over the network "
                           "devices drop by themselves: set it to 0 for the service")
    if cfg.data.generated_population:
        raise DpfleetError("data.generated_population cycles real users for scale tests; its epsilon "
                           "protects nobody, so the service refuses it: use `dpfleet simulate`")
    if cfg.dp.target_epsilon:
        raise DpfleetError("dp.target_epsilon is planned by `dpfleet simulate` only; for the service, "
                           "run `dpfleet plan` and set dp.report_goal, dp.noise_multiplier and the "
                           "participation limits it prints")
    if cfg.backend.kind != "local":
        raise DpfleetError("the service trains nothing itself: backend.kind must be 'local'")


@dataclass
class Booted:
    cfg: SimulationConfig
    store: StateStore
    engine: RoundEngine
    users: list[str]
    baseline: dict
    blobs: BlobStore
    tokenizer_sha256: str
    model_config: dict
    started: float
    bundle: RunBundle | None = None  # [fleet] client = "bundle": the run's signed phone bundle


def boot(cfg: SimulationConfig, state: Path, log=print) -> Booted:
    """Open (or create) the state at `state` and the engine on it, continuing after its last
    committed round."""
    check_service_config(cfg)
    started = time.perf_counter()
    store = StateStore(state, cfg.resolved())
    try:
        if store.finished:
            raise DpfleetError(f"{state} holds a finished run: nothing to continue (its results "
                               "are in that folder)")
        RunDir(Path(state), resume=True).write_config(cfg.resolved())  # as `simulate` writes it
        torch.manual_seed(cfg.seed)
        torch.set_num_threads(max(1, cfg.client.threads))
        fresh = store.last_committed() == 0
        tokenizer, data = prepare_data(cfg, Path(state) / "vocabulary")
        model_cfg = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
        model = build_model(model_cfg)
        test_rows, baseline_clients = split_held_out(data.test, cfg.data.eval_examples or None)
        users = [c.user for c in data.train]
        fingerprint = data_fingerprint([c.examples for c in data.train], tokenizer,
                                       fingerprint_secret(Path(state), create=fresh))
        engine = open_engine(store, cfg, users=users, networked=True, model=model, model_cfg=model_cfg,
                             tokenizer=tokenizer, fingerprint=fingerprint, test_rows=test_rows,
                             vocabulary=vocabulary_privacy(Path(state) / "vocabulary"))
        baseline = unigram_baseline((c.examples for c in baseline_clients), test_rows)
        baseline["fitted_on_held_out_clients"] = len(baseline_clients)
        blobs = BlobStore()
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save(Path(tmp))
            tokenizer_sha = blobs.put(folder_tar(Path(tmp)), pinned=True)
        bundle = None
        if cfg.fleet.client == "bundle":
            bundle = run_bundle(cfg, Path(state), model, model_cfg, tokenizer, blobs, log)
        log(f"data: {len(users)} train clients; model {model_cfg.arch} with "
            f"{engine.server.theta.size:,} parameters; continuing after round "
            f"{store.last_committed()} of {cfg.rounds}")
        return Booted(cfg, store, engine, users, baseline, blobs, tokenizer_sha,
                      json.loads(json.dumps(dataclasses.asdict(model_cfg))), started, bundle)
    except BaseException:
        store.close()
        raise
