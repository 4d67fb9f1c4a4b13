"""The in-process round engine: a fleet of emulated clients trained with DP-FTRL.

One round: select the report goal's clients (`participation`: disjoint, uniform, or device
timers on a simulated clock, with the coordinator's MinS refusal), stop first if the round would
pass the privacy budget, run each client's update through the configured runtime (one local
epoch, delta, clip), aggregate (plain sum or secure aggregation), let the DP-FTRL server add
tree noise and step, update the adaptive clip estimate, log metrics, participation and the
privacy so far (`run_accounting`). Everything is seeded: the same config gives the same metrics
bit for bit (on the same thread count).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable
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
from dpfleet.coordinator.config import SimulationConfig, clip_count_stddev
from dpfleet.coordinator.dp_ftrl import DPFTRLConfig, DPFTRLServer
from dpfleet.coordinator.evaluation import evaluate, unigram_baseline
from dpfleet.coordinator.participation import Participation, RoundUnfillable
from dpfleet.coordinator.resume import (
    check_resumable,
    discard_resume,
    replay,
    restore,
    save_resume,
    save_server_state,
    truncate_log,
)
from dpfleet.coordinator.run_accounting import RunAccountant, write_run_privacy
from dpfleet.coordinator.run_dir import RunDir, plot_accuracy
from dpfleet.edge.client_data import build_federated, group_by_user, split_users
from dpfleet.edge.client_update import client_update
from dpfleet.edge.datasets import load_records
from dpfleet.edge.runtime import EagerRuntime, TrainingRuntime
from dpfleet.edge.tokenizer import WordTokenizer, load_tokenizer
from dpfleet.errors import DpfleetError
from dpfleet.export.checkpoint import save_checkpoint
from dpfleet.export.models import build_model, count_parameters
from dpfleet.export.params import get_flat, set_flat


def make_tokenizer(cfg: SimulationConfig, train_texts: list[str]):
    tok = cfg.tokenizer
    if tok.path:
        return load_tokenizer(Path(tok.path))
    if tok.kind == "word":  # built from the private training clients only
        return WordTokenizer.build(train_texts, tok.vocab_size)
    from dpfleet.public.spm_public import public_sentencepiece

    return public_sentencepiece(tok.corpus, tok.vocab_size)


def prepare_data(cfg: SimulationConfig):
    """Records -> tokenizer -> per-client example arrays (train clients and held-out clients)."""
    path = Path(cfg.data.path) if cfg.data.path else None
    records = load_records(cfg.data.dataset, "train", path)
    by_user = group_by_user(records)
    train_users, _ = split_users(list(by_user), cfg.data.test_fraction, cfg.seed)
    tokenizer = make_tokenizer(cfg, [t for u in train_users for t in by_user[u]])
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
                            ring_clients=ring_clients)


def sensitivity_factor(cfg: SimulationConfig, dim: int) -> float:
    """How much secure aggregation's discretization inflates one client's L2 contribution."""
    if cfg.aggregation.kind == "plain":
        return 1.0
    from dpfleet.secagg.encoding import Discretizer

    disc = Discretizer(dim, cfg.dp.clip_norm, cfg.aggregation.bits, cfg.dp.report_goal, seed=0)
    return disc.norm_inflation


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
) -> SimulationResult:
    """Run a whole simulation and write its run directory.

    `before_round(r, theta)` runs before each round's clients train; a returned array replaces
    the server's theta (public training between private rounds: post-processing, so it costs no
    privacy). The DP-FTRL tree, momentum and round counter continue, and the accounting covers
    all rounds.

    With `resume`, `out` is an interrupted run of this same config: it continues from the last
    resume point (`checkpoint_every`), or from round 0 when none was written yet (`resume.py`).
    """
    run = RunDir(out, overwrite=overwrite, resume=resume)
    if resume:
        check_resumable(run.path, cfg.resolved())
        if cfg.dp.noise == "discrete":  # its noise key is not kept for a resume point (yet)
            raise DpfleetError("--resume of a dp.noise = 'discrete' run is not supported yet")
    run.write_config(cfg.resolved())
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(max(1, cfg.client.threads))
    t_start = time.perf_counter()

    tokenizer, data = prepare_data(cfg)
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
    participation = Participation(cfg.participation, len(data.train), cfg.dp.report_goal, cfg.rounds,
                                  cfg.seed)
    accountant = RunAccountant(cfg.dp.noise_multiplier, cfg.dp.delta, cfg.dp.budget_epsilon,
                               conversion="rdp" if cfg.dp.noise == "discrete" else "pld")
    restarts = restart_rounds(cfg)
    z_model, estimator = cfg.dp.noise_multiplier, None
    if cfg.dp.adaptive_clipping:
        z_model = model_noise_multiplier(cfg.dp.noise_multiplier, clip_count_stddev(cfg))
        estimator = QuantileClipEstimator(
            cfg.dp.clip_norm, cfg.dp.report_goal, target_quantile=cfg.dp.target_quantile,
            learning_rate=cfg.dp.clip_lr, count_stddev=clip_count_stddev(cfg),
            seed=_seed(cfg.seed, "count-tree"),
        )
    model = build_model(model_cfg)
    runtime = make_runtime(cfg, model_cfg, run.path / "programs")
    ring_noise = None  # dp.noise = "discrete": integer tree noise on the ring sum, not in `server`
    if cfg.dp.noise == "discrete":
        from dpfleet.coordinator.ring_noise import discrete_ring_noise

        ring_noise = discrete_ring_noise(cfg, count_parameters(model))
    aggregator = make_aggregator(cfg, ring_noise.plan.ring_clients if ring_noise else None)
    server = DPFTRLServer(
        get_flat(model),
        DPFTRLConfig(
            noise_multiplier=0.0 if ring_noise else z_model, clip_norm=cfg.dp.clip_norm,
            report_goal=cfg.dp.report_goal, server_lr=cfg.dp.server_lr, momentum=cfg.dp.momentum,
            restart_rounds=tuple(restarts), seed=_seed(cfg.seed, "tree"),
            sensitivity_factor=sensitivity_factor(cfg, count_parameters(model)),
        ),
    )
    test_rows = data.test_examples(cfg.data.eval_examples or None)
    if len(test_rows) == 0:
        raise DpfleetError("no held-out clients to evaluate on; raise data.test_fraction")
    baseline = unigram_baseline((c.examples for c in data.train), test_rows)
    log(
        f"data: {len(data.train)} train clients, {len(data.test)} held-out clients, "
        f"{len(test_rows)} eval rows; model {model_cfg.arch} with "
        f"{server.theta.size:,} parameters; tokenizer {tokenizer.kind} ({tokenizer.vocab_size})"
    )

    start, metrics = 0, []
    if resume:  # the rounds after the resume point are redone, bit for bit
        start = restore(run.path, server, estimator)
        metrics = truncate_log(run.path / "metrics.jsonl", start)
        replay(participation, accountant, truncate_log(run.path / "participation.jsonl", start),
               [c.user for c in data.train])
        log(f"resuming after round {start} of {cfg.rounds}" if start else
            "no resume point was written yet: starting from round 1")
    stopped_early = None
    rounds = range(start, cfg.rounds)
    if progress:
        from tqdm import tqdm

        rounds = tqdm(rounds, desc="rounds", unit="round", dynamic_ncols=True, initial=start,
                      total=cfg.rounds)
    for r in rounds:
        restart = r in restarts
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
        if restart and estimator is not None:  # the clip estimate becomes the clip norm
            server.restart(estimator.estimate)
            estimator.restart()
        if restart and ring_noise is not None:
            ring_noise.restart()
        public_update = before_round(r, server.theta) if before_round else None
        if public_update is not None:
            server.theta = np.asarray(public_update, dtype=np.float32).copy()
        updates = [
            client_update(
                runtime, server.theta, data.train[i].examples, lr=cfg.client.lr,
                batch_size=cfg.client.batch_size, clip_norm=server.clip_norm,
                seed=_seed(cfg.seed, r, i),
            )
            for i in chosen
        ]
        agg = aggregator.aggregate([u.delta for u in updates], _seed(cfg.seed, "agg", r))
        server.step(agg.total if ring_noise is None else ring_noise.release(agg.ring))
        in_sum = [chosen[i] for i in agg.survivors]  # dropped clients contributed nothing
        participation.commit(selection, in_sum)
        spent = accountant.record([data.train[i].user for i in in_sum], restart)
        clip = server.clip_norm
        if estimator is not None:
            estimator.update([updates[i].norm for i in agg.survivors])
        noise_std = server.noise_std if ring_noise is None else ring_noise.plan.noise_std
        eps = spent["epsilon"]
        record = {
            "round": r + 1,
            "clients": len(in_sum),
            "train_loss": float(np.mean([u.loss for u in updates])),
            "mean_update_norm": float(np.mean([u.norm for u in updates])),
            "clipped_fraction": float(np.mean([u.clipped for u in updates])),
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
                k: v for k, v in agg.info.items() if isinstance(v, int | float | str | bool)
            }
        if (r + 1) % cfg.eval_every == 0 or r + 1 == cfg.rounds:
            set_flat(model, server.theta)
            ev = evaluate(model, test_rows)
            record.update(accuracy=ev["accuracy"], loss=ev["loss"], perplexity=ev["perplexity"])
            if progress:
                rounds.set_postfix(acc=f"{ev['accuracy']:.4f}", eps=f"{eps:.2f}")
        metrics.append(record)
        run.append("metrics.jsonl", record)
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
    save_server_state(run.path / "checkpoint", server, estimator.state_dict() if estimator else None)
    privacy = write_run_privacy(run.path, cfg, participation, accountant, len(data.train),
                                model_noise_multiplier=z_model, stopped_early=stopped_early)
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
    }
    run.write_json("summary.json", summary)
    discard_resume(run.path)
    return SimulationResult(run.path, metrics, final, baseline, privacy, stopped_early)

