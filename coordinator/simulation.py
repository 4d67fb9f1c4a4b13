"""The in-process round engine: a fleet of emulated clients trained with DP-FTRL.

One round: select the report goal's clients (`participation`: disjoint, uniform, or device
timers on a simulated clock, with the coordinator's MinS refusal), stop first if the round would
pass the privacy budget, run each client's update through the configured runtime (one local
epoch, delta, clip), aggregate (plain sum or secure aggregation), let the DP-FTRL server add
tree noise and step, update the adaptive clip estimate, log metrics, participation and the
privacy so far (`run_accounting`). Selection, batching and init are seeded by `seed`; the DP
noise is not: it comes from a fresh secret 256-bit key per run (`noise_stream`), so the same
config gives fresh noise, unless `dp.noise_seed` (research mode, no privacy against whoever knows
it) makes it reproducible. Each round is written to the release log before it is released
(`release_log`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dpfleet.coordinator.adaptive_clipping import (
    QuantileClipEstimator,
    default_restart_rounds,
    model_noise_multiplier,
)
from dpfleet.coordinator.aggregation import Aggregator, PlainAggregator
from dpfleet.coordinator.backends import make_trainer
from dpfleet.coordinator.config import SimulationConfig, clip_count_stddev
from dpfleet.coordinator.dp_ftrl import DPFTRLConfig, DPFTRLServer
from dpfleet.coordinator.dp_vocabulary import VocabularyDP, build_dp_vocabulary
from dpfleet.coordinator.evaluation import evaluate, split_held_out, unigram_baseline
from dpfleet.coordinator.noise_stream import key_id, new_noise_key, seeded_noise_key
from dpfleet.coordinator.participation import Participation, RoundUnfillable
from dpfleet.coordinator.release_log import RELEASES, ReleaseLog, release_hash
from dpfleet.coordinator.resume import (
    check_resumable,
    data_fingerprint,
    discard_resume,
    fingerprint_secret,
    resume_run,
    save_resume,
    save_server_state,
)
from dpfleet.coordinator.run_accounting import RunAccountant, write_run_privacy
from dpfleet.coordinator.run_dir import RunDir, atomic_write, plot_accuracy
from dpfleet.edge.client_data import build_federated, group_by_user, split_users
from dpfleet.edge.datasets import load_records
from dpfleet.edge.runtime import EagerRuntime, TrainingRuntime
from dpfleet.edge.tokenizer import WordTokenizer, load_tokenizer
from dpfleet.export.checkpoint import save_checkpoint
from dpfleet.export.models import build_model, count_parameters
from dpfleet.export.params import get_flat, set_flat


def make_tokenizer(cfg: SimulationConfig, train_by_user: list[list[str]],
                   folder: Path | None = None):
    """The run's tokenizer. A `word` vocabulary is chosen with user-level DP (dp_vocabulary.py)
    unless tokenizer.allow_nonprivate_vocabulary; a DP one is saved to `folder` with its privacy
    summary and loaded from there on resume, so it is released (and paid for) once."""
    tok = cfg.tokenizer
    if tok.path:
        return load_tokenizer(Path(tok.path))
    if tok.kind == "word" and tok.allow_nonprivate_vocabulary:  # outside the guarantee
        return WordTokenizer.build((t for texts in train_by_user for t in texts), tok.vocab_size)
    if tok.kind == "word":
        if folder is not None and (folder / DP_VOCABULARY).is_file():
            return load_tokenizer(folder)
        params = VocabularyDP(tok.dp_noise, tok.dp_words_per_user, tok.dp_delta)
        tokenizer, info = build_dp_vocabulary(train_by_user, tok.vocab_size, params)
        if folder is not None:
            tokenizer.save(folder)
            atomic_write(folder / DP_VOCABULARY, json.dumps(info, indent=2))
        return tokenizer
    from dpfleet.public.overlap import check_public_sources
    from dpfleet.public.spm_public import public_sentencepiece

    check_public_sources([tok.corpus], cfg.data.dataset, "tokenizer.corpus")
    return public_sentencepiece(tok.corpus, tok.vocab_size)


def vocabulary_privacy(folder: Path) -> dict | None:
    """The DP vocabulary's privacy summary written by `make_tokenizer`, if this run has one."""
    path = folder / DP_VOCABULARY
    return json.loads(path.read_text()) if path.is_file() else None


def prepare_data(cfg: SimulationConfig, vocabulary_folder: Path | None = None):
    """Records -> tokenizer -> per-client example arrays (train clients and held-out clients)."""
    path = Path(cfg.data.path) if cfg.data.path else None
    records = load_records(cfg.data.dataset, "train", path)
    by_user = group_by_user(records)
    train_users, _ = split_users(list(by_user), cfg.data.test_fraction, cfg.seed)
    tokenizer = make_tokenizer(cfg, [by_user[u] for u in train_users], vocabulary_folder)
    data = build_federated(
        records, tokenizer, seq_len=cfg.data.seq_len, max_examples=cfg.data.max_examples,
        test_fraction=cfg.data.test_fraction, seed=cfg.seed, max_clients=cfg.data.max_clients or None,
    )
    return tokenizer, data


def make_runtime(cfg: SimulationConfig, model_cfg, cache: Path) -> TrainingRuntime:
    if cfg.client.runtime == "eager":
        return EagerRuntime(model_cfg, threads=cfg.client.threads)
    from dpfleet.edge.runtimes import make_runtime as make_exported

    return make_exported(cfg.client.runtime, model_cfg, cfg.data.seq_len, cfg.client.threads, cache)


def make_aggregator(cfg: SimulationConfig, ring_clients: int | None = None) -> Aggregator:
    if cfg.aggregation.kind == "plain":
        return PlainAggregator()
    from dpfleet.secagg.aggregator import SecAggAggregator

    return SecAggAggregator(clip_norm=cfg.dp.clip_norm, bits=cfg.aggregation.bits,
                            graph=cfg.aggregation.graph, dropout=cfg.aggregation.dropout,
                            signed=cfg.aggregation.signed, corruption=cfg.aggregation.corruption,
                            fleet_keys=cfg.aggregation.fleet_keys or None, ring_clients=ring_clients)


def sensitivity_factor(cfg: SimulationConfig, dim: int) -> float:
    """How much secure aggregation's discretization inflates one client's L2 contribution."""
    if cfg.aggregation.kind == "plain":
        return 1.0
    from dpfleet.secagg.encoding import Discretizer

    disc = Discretizer(dim, cfg.dp.clip_norm, cfg.aggregation.bits, cfg.dp.report_goal, seed=0)
    return disc.norm_inflation


DP_VOCABULARY = "dp_vocabulary.json"
DEBUG_NONPRIVATE = "debug_nonprivate.jsonl"
# secure aggregation's per-round counts that depend on the clients' data (not noised)
DATA_DEPENDENT_AGGREGATION = ("clipped_coordinates", "inputs_scaled_down")


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


@dataclass
class SimulationResult:
    run_dir: Path
    metrics: list[dict]
    final: dict
    baseline: dict
    privacy: dict
    stopped_early: str | None = None  # why the run ended before its planned rounds


def restart_rounds(cfg: SimulationConfig) -> list[int]:
    """Tree restart rounds of this run: the configured ones, or 128 + 1024 i with adaptive clipping."""
    rounds = cfg.dp.restart_rounds
    if not rounds and cfg.dp.adaptive_clipping:
        rounds = default_restart_rounds(cfg.rounds)
    return sorted(r for r in set(rounds) if 0 < r < cfg.rounds)


def run_simulation(
    cfg: SimulationConfig,
    out: Path,
    *,
    overwrite: bool = False,
    resume: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
    before_round: Callable[[int, np.ndarray], np.ndarray | None] | None = None,
    public_data: Sequence[str] = (),
) -> SimulationResult:
    """Run a whole simulation and write its run directory.

    `before_round(r, theta)` runs before each round's clients train; a returned array replaces
    the server's theta (public training between private rounds: post-processing, so it costs no
    privacy). The DP-FTRL tree, momentum and round counter continue, and the accounting covers
    all rounds.

    With `resume`, `out` is an interrupted run of this same config: it continues from the last
    resume point (`checkpoint_every`), or from round 0 when none was written yet (`resume.py`).

    `public_data` names public data the caller trained on, for the privacy report.
    metrics.jsonl holds DP quantities and held-out evaluation only; un-noised client telemetry
    goes to debug_nonprivate.jsonl, and only with `cfg.debug_nonprivate`.
    """
    run = RunDir(out, overwrite=overwrite, resume=resume)
    if resume:
        check_resumable(run.path, cfg.resolved())
    else:
        discard_resume(run.path)  # an overwritten run's resume point (and key) is not this run's
    run.write_config(cfg.resolved())
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(max(1, cfg.client.threads))
    t_start = time.perf_counter()

    vocabulary_folder = run.path / "vocabulary"  # a DP word vocabulary, released once
    if not resume:  # nothing left over from an overwritten run
        shutil.rmtree(vocabulary_folder, ignore_errors=True)
        (run.path / DEBUG_NONPRIVATE).unlink(missing_ok=True)
        if cfg.debug_nonprivate:
            (run.path / DEBUG_NONPRIVATE).write_text("")
    tokenizer, data = prepare_data(cfg, vocabulary_folder)
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
    participation = Participation(cfg.participation, len(data.train), cfg.dp.report_goal, cfg.rounds,
                                  cfg.seed)
    accountant = RunAccountant(cfg.dp.noise_multiplier, cfg.dp.delta, cfg.dp.budget_epsilon,
                               spent_zcdp=(vocabulary_privacy(vocabulary_folder) or {}).get("zcdp", 0),
                               conversion="rdp" if cfg.dp.noise == "discrete" else "pld")
    restarts = restart_rounds(cfg)
    z_model, estimator = cfg.dp.noise_multiplier, None
    noise_key = seeded_noise_key(cfg.dp.noise_seed) if cfg.dp.noise_seed >= 0 else new_noise_key()
    if cfg.dp.adaptive_clipping:
        z_model = model_noise_multiplier(cfg.dp.noise_multiplier, clip_count_stddev(cfg))
        estimator = QuantileClipEstimator(
            cfg.dp.clip_norm, cfg.dp.report_goal, target_quantile=cfg.dp.target_quantile,
            learning_rate=cfg.dp.clip_lr, count_stddev=clip_count_stddev(cfg),
            noise_key=noise_key,
        )
    model = build_model(model_cfg)
    runtime = make_runtime(cfg, model_cfg, run.path / "programs")
    trainer = make_trainer(cfg.client.trainer, runtime, model_cfg, seq_len=cfg.data.seq_len,
                           batch_size=cfg.client.batch_size, device=cfg.client.device,
                           memory_mb=cfg.client.cohort_memory_mb, backend=cfg.backend)
    ring = None  # dp.noise = "discrete": integer tree noise on the SecAgg ring sum (ring_noise.py)
    if cfg.dp.noise == "discrete":
        from dpfleet.coordinator.ring_noise import discrete_plan

        ring = discrete_plan(cfg, count_parameters(model))
    aggregator = make_aggregator(cfg, ring.ring_clients if ring else None)
    server = DPFTRLServer(
        get_flat(model),
        DPFTRLConfig(
            noise_multiplier=z_model, clip_norm=cfg.dp.clip_norm,
            report_goal=cfg.dp.report_goal, server_lr=cfg.dp.server_lr, momentum=cfg.dp.momentum,
            restart_rounds=tuple(restarts),
            sensitivity_factor=sensitivity_factor(cfg, count_parameters(model)),
        ),
        noise_key=noise_key, ring=ring,
    )
    releases = ReleaseLog(run.path / RELEASES)
    users = [c.user for c in data.train]
    fingerprint = data_fingerprint([c.examples for c in data.train], tokenizer,
                                   fingerprint_secret(run.path, create=not resume))
    test_rows, baseline_clients = split_held_out(data.test, cfg.data.eval_examples or None)
    baseline = unigram_baseline((c.examples for c in baseline_clients), test_rows)
    baseline["fitted_on_held_out_clients"] = len(baseline_clients)
    log(
        f"data: {len(data.train)} train clients, {len(data.test)} held-out clients "
        f"({len(data.test) - len(baseline_clients)} give {len(test_rows)} eval rows, "
        f"{len(baseline_clients)} fit the unigram baseline); model {model_cfg.arch} with "
        f"{server.theta.size:,} parameters; tokenizer {tokenizer.kind} ({tokenizer.vocab_size})"
    )

    start, metrics, fresh_tree_at, lost = 0, [], None, []
    if resume:  # released rounds are never redone (`release_log`)
        resumed = resume_run(run.path, server, estimator, releases, participation, accountant,
                             users, fingerprint)
        start, metrics, fresh_tree_at, lost = (resumed.start, resumed.metrics,
                                               resumed.fresh_tree_at, resumed.lost)
        log(f"resuming after round {start} of {cfg.rounds}" if start else
            "no resume point was written yet: starting from round 1")
        if lost:
            log(f"rounds {lost[0]}-{lost[-1]} were released but their state was lost: they stay "
                f"accounted, and the run goes on from round {resumed.rounds_done}'s model on a "
                "fresh noise tree")
    stopped_early = None
    rounds = range(start, cfg.rounds)
    if progress:
        from tqdm import tqdm

        rounds = tqdm(rounds, desc="rounds", unit="round", dynamic_ncols=True, initial=start,
                      total=cfg.rounds)
    for r in rounds:
        restart = r in restarts or r == fresh_tree_at
        try:
            selection = participation.propose(r)
        except RoundUnfillable as exc:
            stopped_early = f"stopped before round {r + 1}: {exc}"
            break
        chosen = selection.devices
        if accountant.would_exceed([data.train[i].user for i in chosen], restart):
            stopped_early = (
                f"stopped before round {r + 1}: it would pass the privacy budget eps = "
                f"{cfg.dp.budget_epsilon:g} at delta = {cfg.dp.delta:g}"
            )
            break
        if restart and estimator is not None and server.tree.t > 0:  # estimate -> clip norm
            server.restart(estimator.estimate)
            estimator.restart()
        public_update = before_round(r, server.theta) if before_round else None
        if public_update is not None:
            server.theta = np.asarray(public_update, dtype=np.float32).copy()
        updates = trainer.train_round(
            server.theta, [data.train[i].examples for i in chosen],
            [_seed(cfg.seed, r, i) for i in chosen], lr=cfg.client.lr,
            batch_size=cfg.client.batch_size, clip_norm=server.clip_norm,
        )
        agg = aggregator.aggregate([u.delta for u in updates], _seed(cfg.seed, "agg", r))
        server.step(agg.total if ring is None else agg.ring)
        in_sum = [chosen[i] for i in agg.survivors]  # dropped clients contributed nothing
        participation.commit(selection, in_sum)
        spent = accountant.record([data.train[i].user for i in in_sum], restart)
        clip = server.clip_norm
        if estimator is not None:
            estimator.update([updates[i].norm for i in agg.survivors])
        releases.record_release(  # durable before anything of round r + 1 leaves the engine
            round=r + 1, tree_id=server.tree.tree_id, t=server.tree.t, key_id=key_id(server.noise_key),
            participants=[users[i] for i in in_sum], restart=restart, clip_norm=clip,
            released=release_hash(server.theta, estimator.estimate if estimator else None),
            data_sha256=fingerprint,
        )
        noise_std = server.noise_std
        eps = spent["epsilon"]
        record = {
            "round": r + 1,
            "clients": len(in_sum),
            "clip": clip,
            "noise_std": noise_std,
            "epsilon": eps,  # RDP, worst case over the observed MinS / MaxP so far
            "zcdp": spent["zcdp"],
            "min_separation": spent["min_separation"],
            "max_participation": spent["max_participation"],
            "restart": restart,
            "clock_hours": participation.hours(selection.slot),
            "waited_hours": participation.hours(selection.waited_slots),
            "refused": selection.refused,
            "accuracy": None,
            "loss": None,
        }
        if estimator is not None:
            record["clip_estimate"] = estimator.estimate
        if agg.info:  # secure aggregation's costs and guarantees, scalars only
            record["aggregation"] = {
                k: v for k, v in agg.info.items()
                if isinstance(v, int | float | str | bool) and k not in DATA_DEPENDENT_AGGREGATION
            }
        if (r + 1) % cfg.eval_every == 0 or r + 1 == cfg.rounds:
            set_flat(model, server.theta)
            ev = evaluate(model, test_rows)
            record.update(accuracy=ev["accuracy"], loss=ev["loss"], perplexity=ev["perplexity"])
            if progress:
                rounds.set_postfix(acc=f"{ev['accuracy']:.4f}", eps=f"{eps:.2f}")
        metrics.append(record)
        run.append("metrics.jsonl", record)
        if cfg.debug_nonprivate:  # un-noised, over this round's few clients: not DP
            run.append(DEBUG_NONPRIVATE, {
                "round": r + 1,
                "train_loss": float(np.mean([u.loss for u in updates])),
                "mean_update_norm": float(np.mean([u.norm for u in updates])),
                "clipped_fraction": float(np.mean([u.clipped for u in updates])),
                **{k: agg.info[k] for k in DATA_DEPENDENT_AGGREGATION if k in agg.info},
            })
        run.append(
            "participation.jsonl",
            {"round": r, "devices": [data.train[i].user for i in in_sum], "restart": restart},
        )
        if cfg.checkpoint_every and (r + 1) % cfg.checkpoint_every == 0 and r + 1 < cfg.rounds:
            save_resume(run.path, r + 1, server, estimator)

    if stopped_early:
        log(stopped_early)
    set_flat(model, server.theta)
    final = evaluate(model, test_rows)
    save_checkpoint(run.path / "checkpoint", model, model_cfg, tokenizer)  # what `dpfleet export` reads
    save_server_state(run.path / "checkpoint", server,  # no node vectors, no key (resume.py)
                      estimator.state_dict(with_noise=False) if estimator else None, with_noise=False)
    privacy = write_run_privacy(run.path, cfg, participation, accountant, len(data.train),
                                model_noise_multiplier=z_model, stopped_early=stopped_early,
                                vocabulary=vocabulary_privacy(vocabulary_folder),
                                public_data=list(public_data))
    title = (f"held-out accuracy, eps = {privacy['epsilon']:.2f} at delta = {cfg.dp.delta:g}"
             if np.isfinite(privacy["epsilon"]) else "held-out accuracy, no DP noise")
    plot_accuracy(metrics, baseline["accuracy"], run.path / "accuracy.png", title)
    run.write_json("privacy.json", privacy)
    summary = {
        "final": final, "unigram_baseline": baseline,
        "wall_seconds": time.perf_counter() - t_start, "parameters": int(server.theta.size),
        "rounds_completed": len(metrics), "stopped_early": stopped_early,
        "simulated_hours": participation.hours(participation.slot),
        "resumed_after_round": start or None,
        "rounds_lost_in_crash": lost,
        "client_trainer": trainer.name,  # "cohort" or "sequential" (coordinator/backends.py)
    }
    run.write_json("summary.json", summary)
    discard_resume(run.path)
    return SimulationResult(run.path, metrics, final, baseline, privacy, stopped_early)

