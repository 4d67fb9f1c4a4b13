"""Everything a coordinator process needs before it answers a device: config, state, data, engine.

Why the coordinator prepares the data: this is an emulation, so it needs the tokenizer, the
held-out split (evaluation), the training data's fingerprint (`resume.data_fingerprint`,
checked on every restart) and the unigram baseline (its OOV buckets masked), exactly as
`simulate` does (`simulation.load_clients`: a TFF / LEAF / jsonl file streams into the
memory-mapped population, never read whole). It never sends a device anything of another
device's data.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dpfleet.coordinator.config import SimulationConfig
from dpfleet.coordinator.engine.evaluation import split_held_out, unigram_baseline
from dpfleet.coordinator.engine.round_engine import RoundEngine
from dpfleet.coordinator.engine.simulation import load_clients, plan_run, vocabulary_privacy
from dpfleet.coordinator.engine.store_engine import open_engine
from dpfleet.coordinator.run_privacy.config_plan import RunPlan, plan_line
from dpfleet.coordinator.run_privacy.result_warnings import plan_warnings
from dpfleet.coordinator.serve_plan import check_kept_plan, check_service_config, follow_plan
from dpfleet.coordinator.state.resume import data_fingerprint, fingerprint_secret
from dpfleet.coordinator.state.run_dir import RunDir
from dpfleet.coordinator.state.state_store import StateStore
from dpfleet.edge.tokenizer import oov_ids_of
from dpfleet.edge.wire.protocol import PLAN_FILE
from dpfleet.errors import DpfleetError
from dpfleet.export.models import build_model
from dpfleet.io import sha256_file
from dpfleet.service.blobs import BlobStore, folder_tar
from dpfleet.service.run_bundle import RunBundle, run_bundle


def planning_population(cfg: SimulationConfig, population: int) -> int:
    """The population the service plans for: N / (1 + overselect). The planner sizes MinS / MaxP
    for report_goal devices a round out of N; the service assigns report_goal (1 + overselect) a
    round (`round_size`), so it plans as if for the fleet shrunk by the same factor, which keeps
    devices per round over the population as planned (planned for all 200 phones at overselect
    0.3, a fleet stopped at round 3 of 10: 43 eligible devices for a report goal of 46)."""
    return math.floor(population / (1.0 + cfg.service.overselect) + 1e-9)


def plan_service(cfg: SimulationConfig, store: StateStore, population: int, log,
                 plan: RunPlan | None = None) -> SimulationConfig:
    """dp.target_epsilon: the config the service runs. The first start plans for the service's
    training population exactly as `simulate` does (`plan_run`: a config with the planner's keys,
    config.json and plan.json), for `planning_population` devices; every restart applies that
    plan.json again, never a new plan. `plan`: the planned keys the config states
    (`config_plan.read_run_config`), which the plan must agree with."""
    if cfg.service.overselect > 0:
        planned = planning_population(cfg, population)
        log(f"plan: {population} train devices, over-selection {cfg.service.overselect:g}: "
            f"planned for N = {planned} so that every round's {1 + cfg.service.overselect:g}x "
            "assignment fits MinS / MaxP")
        population = planned
    path = store.path / PLAN_FILE
    if not path.is_file():
        if store.last_committed():
            raise DpfleetError(f"{store.path} has committed rounds but no {PLAN_FILE}: its plan is "
                               "lost; choose a new --state")
        cfg, _ = plan_run(cfg, RunDir(store.path, resume=True), population, resume=False, log=log,
                          plan=plan)
        store.bind_plan(sha256_file(path))
        return cfg
    bound = store.bound_plan()
    if bound is None and store.last_committed():
        raise DpfleetError(f"{store.path} has committed rounds but no bound plan: its {PLAN_FILE} "
                           "cannot be checked; choose a new --state")
    if bound is not None and sha256_file(path) != bound:
        raise DpfleetError(f"{path} is not the plan this state was started with (its sha256 "
                           "differs): a restart runs the first plan only, since an edit would change "
                           "the noise and the participation limits under rounds already released; "
                           "restore it or choose a new --state")
    record = json.loads(path.read_text())
    if record["population"] != population:
        raise DpfleetError(f"{store.path} was planned for {record['population']} train clients, the "
                           f"data now gives {population}: continue with the data it was started "
                           "with, or choose a new --state")
    cfg, _ = follow_plan(cfg, record, plan)
    log(plan_line(record))
    return cfg


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


def boot(cfg: SimulationConfig, state: Path, log=print, plan: RunPlan | None = None) -> Booted:
    """Open (or create) the state at `state` and the engine on it, continuing after its last
    committed round. With dp.target_epsilon the store keeps the config as given (its target) and
    the plan makes the config the service runs (`Booted.cfg`), config.json and plan.json
    (`plan_service`; `plan`: the planned keys the config states)."""
    check_service_config(cfg)
    check_kept_plan(cfg, Path(state))
    started = time.perf_counter()
    store = StateStore(state, cfg.resolved())
    try:
        if store.finished:
            raise DpfleetError(f"{state} holds a finished run: nothing to continue (its results "
                               "are in that folder)")
        torch.manual_seed(cfg.seed)
        torch.set_num_threads(max(1, cfg.client.threads))
        fresh = store.last_committed() == 0
        # as `simulate` loads them: a TFF / LEAF / jsonl file streams into the memory-mapped
        # population (one client in memory), never read whole
        tokenizer, data, population = load_clients(cfg, Path(state) / "vocabulary")
        model_cfg = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
        model = build_model(model_cfg)
        test_rows, baseline_clients = split_held_out(data.test, cfg.data.eval_examples or None,
                                                     cfg.data.test_fraction)
        users = list(population.user_ids())  # the service refuses a generated population: all real
        if cfg.dp.target_epsilon > 0:
            cfg = plan_service(cfg, store, len(users), log, plan)
        for warning in plan_warnings(cfg):  # noise that drowns every update, before any round
            log(f"warning: {warning}")
        RunDir(Path(state), resume=True).write_config(cfg.resolved())  # as `simulate` writes it
        fingerprint = data_fingerprint((population.examples(i) for i in population.real_clients()),
                                       tokenizer, fingerprint_secret(Path(state), create=fresh))
        engine = open_engine(store, cfg, users=users, networked=True, model=model, model_cfg=model_cfg,
                             tokenizer=tokenizer, fingerprint=fingerprint, test_rows=test_rows,
                             vocabulary=vocabulary_privacy(Path(state) / "vocabulary"),
                             keyboard_rows=np.concatenate([c.examples for c in baseline_clients]))
        baseline = unigram_baseline((c.examples for c in baseline_clients), test_rows, oov_ids_of(tokenizer))
        baseline["fitted_on_held_out_clients"] = len(baseline_clients)
        blobs = BlobStore()
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save(Path(tmp))
            tokenizer_sha = blobs.put(folder_tar(Path(tmp)), pinned=True)
        bundle = None
        if cfg.fleet.client == "bundle":
            bundle = run_bundle(cfg, Path(state), model, model_cfg, tokenizer, blobs, log)
        where = (f"starting: round 1 of {cfg.rounds}" if fresh else
                 f"continuing after round {store.last_committed()} of {cfg.rounds}")
        log(f"data: {len(users)} train clients; model {model_cfg.arch} with "
            f"{engine.server.theta.size:,} parameters; {where}")
        return Booted(cfg, store, engine, users, baseline, blobs, tokenizer_sha,
                      json.loads(json.dumps(dataclasses.asdict(model_cfg))), started, bundle)
    except BaseException:
        store.close()
        raise
