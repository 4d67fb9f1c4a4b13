"""The in-process driver of the round engine: a fleet of emulated clients trained with DP-FTRL.

Why a driver: the round's coordinator side (selection with the MinS / MaxP refusal, the budget
check, tree restarts, the DP-FTRL step, the release log, accounting, resume) lives in the
transport-free `round_engine`, shared with the networked coordinator. This module does what
the devices and the aggregation would do elsewhere: it loads the data, builds the tokenizer and
the runtime, and is the in-process `Collector` of the one round driver (`round_driver`, which
`coordinator serve` drives over HTTP): it trains each planned client in-process (one local
epoch, delta, clip; `backends`) and sums the deltas (plain or secure aggregation), with a
progress bar. Selection, batching and init are seeded by `seed`; the DP noise is not: it comes
from a fresh secret 256-bit key per run (`noise_stream`), so the same config gives fresh noise,
unless `dp.noise_seed` (research mode, no privacy against whoever knows it) makes it
reproducible. Each round is written to the release log before it is released (`release_log`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpfleet.coordinator.config import SimulationConfig, public_words
from dpfleet.coordinator.engine.adaptive_clipping import clipped_bit
from dpfleet.coordinator.engine.aggregation import Aggregator, PlainAggregator
from dpfleet.coordinator.engine.backends import make_trainer, trainer_precision
from dpfleet.coordinator.engine.evaluation import split_held_out, unigram_baseline
from dpfleet.coordinator.engine.extensions import check_clipped, custom_trainer, install, noise_mechanism
from dpfleet.coordinator.engine.population import generated_population_notice, open_population
from dpfleet.coordinator.engine.round_driver import Collected, Failed, drive, run_to_end, selection_extra
from dpfleet.coordinator.engine.round_engine import (  # noqa: F401 (DATA_DEPENDENT_AGGREGATION re-exported)
    DATA_DEPENDENT_AGGREGATION,
    DEBUG_NONPRIVATE,
    RoundEngine,
    RoundPlan,
    Stop,
    round_close_line,
    round_discretizer,
    round_totals,
)
from dpfleet.coordinator.engine.vocabulary import build_dp_vocabulary
from dpfleet.coordinator.mechanisms.dp_vocabulary import VocabularyDP
from dpfleet.coordinator.run_privacy.config_plan import RunPlan
from dpfleet.coordinator.run_privacy.result_warnings import plan_warnings
from dpfleet.coordinator.state.resume import (
    check_resumable,
    data_fingerprint,
    discard_resume,
    fingerprint_secret,
)
from dpfleet.coordinator.state.run_dir import RunDir
from dpfleet.edge.client_data import (
    FederatedData,
    build_federated,
    group_by_user,
    split_users,
    stream_federated,
)
from dpfleet.edge.client_store import ClientStore
from dpfleet.edge.data_files import READERS, client_ids, iter_clients
from dpfleet.edge.datasets import TextRecord, load_records
from dpfleet.edge.devices import secagg_drops
from dpfleet.edge.model_output import logits_of
from dpfleet.edge.runtime import EagerRuntime, TrainingRuntime
from dpfleet.edge.tokenizer import CharTokenizer, WordTokenizer, load_tokenizer, oov_ids_of
from dpfleet.errors import DpfleetError
from dpfleet.export.models import build_model
from dpfleet.export.params import get_flat
from dpfleet.export.training import default_program_cache
from dpfleet.io import atomic_write
from dpfleet.jsonio import write_json
from dpfleet.secagg.errors import SecAggError


def make_tokenizer(cfg: SimulationConfig, train_by_user: Iterable[Iterable[str]],
                   folder: Path | None = None):
    """The run's tokenizer. A `word` vocabulary comes from a public word file when one is named
    (TFF's way: no privacy cost), else is chosen with user-level DP (dp_vocabulary.py) unless
    tokenizer.allow_nonprivate_vocabulary; a DP one is saved to `folder` with its privacy
    summary and loaded from there on resume, so it is released (and paid for) once. `char` is
    TFF Shakespeare's fixed character set. `train_by_user` (each training user's texts) is read
    once, one user at a time, and only for a private word vocabulary: a generator over a file
    keeps one user in memory."""
    tok = cfg.tokenizer
    if tok.path:
        return load_tokenizer(Path(tok.path))
    if tok.kind == "char":
        return CharTokenizer()
    if tok.kind == "word" and (public := public_words(tok)):
        if cfg.data.path and Path(public).resolve() == Path(cfg.data.path).resolve():
            raise DpfleetError(f"tokenizer word file {public!r} is the private data.path; a public "
                               "vocabulary must come from other (public) text")
        build = WordTokenizer.from_word_counts if tok.word_counts else WordTokenizer.from_word_list
        return build(Path(public), tok.vocab_size, tok.oov_buckets, tok.split)
    if tok.kind == "word" and tok.allow_nonprivate_vocabulary:  # outside the guarantee
        return WordTokenizer.build((t for texts in train_by_user for t in texts), tok.vocab_size)
    if tok.kind == "word":
        if folder is not None and (folder / DP_VOCABULARY).is_file():
            return load_tokenizer(folder)
        params = VocabularyDP(tok.dp_noise, tok.dp_words_per_user, tok.dp_delta)
        tokenizer, info = build_dp_vocabulary(train_by_user, tok.vocab_size, params,
                                              train_delta=cfg.dp.delta)
        if folder is not None:
            tokenizer.save(folder)
            write_json(folder / DP_VOCABULARY, info, indent=2)
        return tokenizer
    from dpfleet.edge.overlap import check_public_sources
    from dpfleet.edge.spm_public import public_sentencepiece

    check_public_sources([tok.corpus], cfg.data.dataset, "tokenizer.corpus")
    return public_sentencepiece(tok.corpus, tok.vocab_size)


def vocabulary_privacy(folder: Path) -> dict | None:
    """The DP vocabulary's privacy summary written by `make_tokenizer`, if this run has one."""
    path = folder / DP_VOCABULARY
    return json.loads(path.read_text()) if path.is_file() else None


def prepare_data(cfg: SimulationConfig, vocabulary_folder: Path | None = None,
                 records: Sequence[TextRecord] | None = None, tokenizer=None):
    """Records -> tokenizer -> per-client example arrays (train clients and held-out clients).
    `records` / `tokenizer` replace the config's dataset / tokenizer (`dpfleet.simulate`'s users
    and tokenizer): the same per-user split and rows either way."""
    if records is None:
        path = Path(cfg.data.path) if cfg.data.path else None
        records = load_records(cfg.data.dataset, cfg.data.split, path, cfg.data.feature)
    if tokenizer is None:
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
                            graph=cfg.aggregation.graph, signed=cfg.aggregation.signed,
                            corruption=cfg.aggregation.corruption,
                            fleet_keys=cfg.aggregation.fleet_keys or None, ring_clients=ring_clients,
                            report_goal=cfg.dp.report_goal)


DP_VOCABULARY = "dp_vocabulary.json"

# The public pretraining step of `[pretrain]`: (cfg, model_cfg, model, tokenizer, log, progress=)
# -> what the privacy report records (`dpfleet.public.public_init.pretrain_on_public`).
Pretrain = Callable[..., dict]


def derive_seed(*parts: object) -> int:
    """A 32-bit seed from `parts` (the run's seed, a round, a device or "agg"): the simulation, the
    service and the audit derive the same client and aggregation seeds from the same parts."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


def aggregation_seed(seed: int, round_idx: int, attempt: int) -> int:
    """A round's aggregation seed (SecAgg's rounding and rotation) for both drivers: a reopened
    attempt (2, 3, ...) is keyed by its number, the first by the round alone (as before reopens)."""
    return derive_seed(seed, "agg", round_idx, *([attempt] if attempt > 1 else []))


def check_timer_selection(cfg: SimulationConfig) -> None:
    """One over-selection key per round rule, never one silently ignored: `service.overselect`
    adds devices that all stay in the round (serve in every mode, simulate's uniform and disjoint
    rounds), `participation.over_selection` is simulate's timer-mode race, whose first report_goal
    finishers commit (serve refuses it: `serve_plan`). Timer-mode `simulate` has no room for the
    former, so a config with it would select fewer devices than `serve` does."""
    if cfg.participation.mode == "timer" and cfg.service.overselect > 0:
        raise DpfleetError("service.overselect adds devices to serve's rounds; simulate's timer mode "
                           "over-selects with participation.over_selection (its first report_goal "
                           "finishers commit): remove service.overselect to simulate this config")


@dataclass
class SimulationResult:
    run_dir: Path
    metrics: list[dict]
    final: dict
    baseline: dict
    privacy: dict
    stopped_early: str | None = None  # why the run ended before its planned rounds
    model: torch.nn.Module | None = None  # holding the final released weights


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
    records: Sequence[TextRecord] | None = None,
    model: torch.nn.Module | None = None,
    tokenizer=None,
    audit=None,
    extensions: dict | None = None,
    pretrain: Pretrain | None = None,
    other_releases: list[dict] | None = None,
    on_round: Callable[[dict], None] | None = None,
    plan: RunPlan | None = None,
) -> SimulationResult:
    """Run a whole simulation and write its run directory.

    `before_round(r, theta)` runs before each round's clients train; a returned array replaces
    theta (public training between private rounds: post-processing, no privacy cost; the tree,
    momentum, round counter and accounting continue). `resume`: continue the interrupted run in
    `out` from its last resume point (`resume.py`). `public_data` names public data the caller
    trained on (the report). `records`, `model`, `tokenizer` replace the config's dataset, zoo
    model and tokenizer (`dpfleet.simulate`; a custom model is checked on a dummy batch first).
    `audit` (`dpfleet audit` only) adds canary devices. `pretrain` is the public pretraining step
    a `[pretrain]` config needs, handed in because the coordinator does not import
    `dpfleet.public` (the layers). `other_releases`: other DP releases about the same devices
    ({name, zcdp, delta, what}, appended to during the run, e.g. FreD), composed into the run's
    privacy. metrics.jsonl holds DP quantities and held-out evaluation only. `on_round(record)`
    gets a copy of each round's metrics record once the round is committed. `plan`: what the
    config states beside its settings (`config_plan.read_run_config`: the planned keys it states,
    a config.json's mechanism pin); None: nothing.
    """
    plan = plan or RunPlan()
    check_timer_selection(cfg)
    run = _open_run(cfg, out, overwrite, resume)
    planned = cfg.dp.target_epsilon > 0  # config.json once the plan is in it (plan_run)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(max(1, cfg.client.threads))
    t_start = time.perf_counter()
    vocabulary_folder = run.path / "vocabulary"  # a DP word vocabulary, released once
    log(f"loading data: {'the users given' if records is not None else cfg.data.dataset}, tokenized by "
        f"{'the tokenizer given' if tokenizer is not None else cfg.tokenizer.kind} ...")
    tokenizer, data, population = load_clients(cfg, vocabulary_folder, records, tokenizer, model)
    # before planning and pretraining: too few held-out users is one error line, at once
    test_rows, baseline_clients = split_held_out(data.test, cfg.data.eval_examples or None,
                                                 cfg.data.test_fraction)
    if planned:
        cfg, plan = plan_run(cfg, run, len(population), resume, log, plan)
    for warning in plan_warnings(cfg):  # before any training: noise that drowns every update
        log(f"warning: {warning}")
    generated_notice = generated_population_notice(population)
    if generated_notice:
        log(generated_notice["warning"])
    ext = {k: v for k, v in (extensions or {}).items() if v is not None}  # `dpfleet.extensions`
    setup = _setup_training(cfg, model, tokenizer, pretrain, ext, log, progress)
    engine = _make_engine(cfg, run, setup, tokenizer, population, test_rows, baseline_clients,
                          resume=resume, audit=audit, ext=ext, other_releases=other_releases,
                          binding=plan.binding)
    baseline = unigram_baseline((c.examples for c in baseline_clients), test_rows, oov_ids_of(tokenizer))
    baseline["fitted_on_held_out_clients"] = len(baseline_clients)
    _log_setup(engine, setup, data, population, baseline, len(baseline_clients), log)
    _log_resume(cfg, engine, resume, log)
    with engine.resume_point_on_interrupt():  # Ctrl-C / SIGTERM: --resume loses no released round
        stopped_early = _run_rounds(cfg, engine, setup.trainer, population, before_round, audit,
                                    ext.get("clipping"), progress, on_round, log)
    if stopped_early:
        log(stopped_early)
    if closes := round_totals(engine.metrics).get("round_close"):  # timer mode: how rounds closed
        log(round_close_line(closes))
    public_data = [*public_data, *setup.public_data]
    log(f"finishing: final evaluation ({len(test_rows):,} held-out rows), checkpoint, privacy report ...")
    final, privacy = engine.finish(stopped_early=stopped_early, baseline=baseline,
                                   public_data=public_data, started=t_start,
                                   extra=_summary_extra(setup, engine, records is not None, generated_notice))
    return SimulationResult(run.path, engine.metrics, final, baseline, privacy, stopped_early, engine.model)


def _make_engine(cfg: SimulationConfig, run: RunDir, setup: TrainingSetup, tokenizer, population,
                 test_rows, baseline_clients, *, resume: bool, audit, ext: dict,
                 other_releases: list[dict] | None, binding: Mapping[str, str] | None) -> RoundEngine:
    """The run's round engine, a caller's participation policy installed and the audit told."""
    precision = trainer_precision(setup.trainer)
    engine = RoundEngine(
        cfg, run, model=setup.model, model_cfg=setup.model_cfg, tokenizer=tokenizer,
        users=population.user_ids() if audit is None else audit.users(population.user_ids()),
        fingerprint=data_fingerprint((population.examples(i) for i in population.real_clients()),
                                     tokenizer,
                                     fingerprint_secret(run.path, create=not resume)),
        test_rows=test_rows, vocabulary=vocabulary_privacy(run.path / "vocabulary"), resume=resume,
        mechanism=noise_mechanism(cfg, ext.get("noise")), other_releases=other_releases,
        keyboard_rows=np.concatenate([c.examples for c in baseline_clients]),  # the keyboard's baseline
        precision=precision["used"], kernels=precision.get("kernels"), binding=binding,
    )
    install(engine, participation=ext.get("participation"))
    if audit is not None:
        audit.engine_ready(engine)
    return engine


def _log_setup(engine: RoundEngine, setup: TrainingSetup, data: FederatedData, population,
               baseline: dict, baseline_clients: int, log: Callable[[str], None]) -> None:
    """The run log's lines on the data, the model and the starting model's accuracy."""
    tokenizer = engine.tokenizer
    log(
        f"data: {len(population)} train clients, {len(data.test)} held-out clients "
        f"({len(data.test) - baseline_clients} give {len(engine.test_rows)} eval rows, "
        f"{baseline_clients} fit the unigram baseline); model "
        f"{type(setup.model).__name__ if setup.model_cfg is None else setup.model_cfg.arch} with "
        f"{engine.server.theta.size:,} parameters; tokenizer {tokenizer.kind} ({tokenizer.vocab_size})"
    )
    if engine.initial is not None:  # round 0: what the private rounds start from
        log(f"starting model (round 0, before any private round; no privacy cost): held-out accuracy "
            f"{engine.initial['accuracy']:.4f}, unigram baseline {baseline['accuracy']:.4f}")


def load_clients(cfg: SimulationConfig, vocabulary_folder: Path, records=None, tokenizer=None,
                 model=None) -> tuple[Any, FederatedData, ClientStore]:
    """(tokenizer, held-out data, training population), for `simulate` and `service serve`
    alike: a TFF / LEAF / jsonl file streams into the memory-mapped population. A caller's model
    or tokenizer is checked against the token ids before any round (a mismatch is one error, not
    an index error later)."""
    if records is None and tokenizer is None and streams_from_file(cfg):
        return _stream_clients(cfg, vocabulary_folder, model)
    custom_tokenizer = tokenizer is not None
    tokenizer, data = prepare_data(cfg, vocabulary_folder, records, tokenizer)
    if model is not None:
        check_custom_model(model, tokenizer.vocab_size, cfg.data.seq_len, data)
    elif custom_tokenizer and (top := largest_id(data)) >= tokenizer.vocab_size:
        raise DpfleetError(f"vocabulary mismatch: the tokenizer gave token id {top} but its vocab_size "
                           f"is {tokenizer.vocab_size} (the model's embedding size)")
    population = open_population(cfg, data.train, tokenizer.vocab_size)  # memory-mapped rows
    data.train = []  # from here on the clients are read through the store, a cohort at a time
    return tokenizer, data, population


def streams_from_file(cfg: SimulationConfig) -> bool:
    """The population is built from a TFF / LEAF / jsonl file one client at a time: every
    tokenizer allows it (a private `word` vocabulary is counted in a streaming pass of its own,
    `_stream_clients`)."""
    return cfg.data.dataset in READERS


def _stream_clients(cfg: SimulationConfig, vocabulary_folder: Path, model):
    """`load_clients` for a file too large to hold: clients go from the file into the memory-mapped
    store one at a time (`client_data.stream_federated`), never as a list of the population; the
    same users, split and rows as the list path, in the file's client order. A `word` vocabulary
    from the private clients is counted in a first pass over the training clients' text (one
    client and the count table in memory): the same counts, so the same words, as the list path."""
    d = cfg.data

    def clients():
        return iter_clients(Path(d.path), d.dataset, d.split, d.feature)

    users = client_ids(Path(d.path), d.dataset, d.split)
    train_users = set(split_users(users, d.test_fraction, cfg.seed)[0])
    tokenizer = make_tokenizer(cfg, (texts for user, texts in clients() if user in train_users),
                               vocabulary_folder)
    train, held_out = stream_federated(
        clients, tokenizer, (d.seq_len, d.max_examples, d.test_fraction, cfg.seed, d.max_clients or None),
        users)
    population = open_population(cfg, train, tokenizer.vocab_size)  # reads `train` to its end
    data = FederatedData([], held_out, d.seq_len)
    if model is not None:
        check_custom_model(model, tokenizer.vocab_size, d.seq_len, data)
    return tokenizer, data, population


def _summary_extra(setup: TrainingSetup, engine: RoundEngine, records_given: bool,
                   generated_notice: dict | None) -> dict:
    """What summary.json says of how this run trained, beyond the engine's own figures (the
    bfloat16 kernels of all rounds listed when a resume changed them)."""
    precision = trainer_precision(setup.trainer)
    if len(engine.kernels_used) > 1:
        precision["kernels_used"] = engine.kernels_used
    return {"client_trainer": setup.trainer.name,  # cohort / sequential
            "precision": precision,
            **({"client_trainer_note": setup.trainer_note} if setup.trainer_note else {}),
            **({"data": "records given in Python"} if records_given else {}),
            **({"public_pretraining": setup.pretrained} if setup.pretrained else {}),
            **({"generated_population": generated_notice} if generated_notice else {})}


def _open_run(cfg: SimulationConfig, out: Path, overwrite: bool, resume: bool) -> RunDir:
    """The run directory: checked against the config on resume, else cleared of what an
    overwritten run left (its resume point and key, vocabulary, telemetry) and given the config
    (a planned run gets it once the plan is in it, `plan_run`)."""
    run = RunDir(out, overwrite=overwrite, resume=resume)
    if resume:
        check_resumable(run.path, cfg.resolved())
        return run
    discard_resume(run.path)  # an overwritten run's resume point (and key) is not this run's
    if not cfg.dp.target_epsilon > 0:
        run.write_config(cfg.resolved())
    shutil.rmtree(run.path / "vocabulary", ignore_errors=True)
    (run.path / DEBUG_NONPRIVATE).unlink(missing_ok=True)
    if cfg.debug_nonprivate:
        atomic_write(run.path / DEBUG_NONPRIVATE, "")
    return run


@dataclass
class TrainingSetup:
    """The model the run starts from and the trainer of its clients."""

    model: torch.nn.Module
    model_cfg: object  # the zoo config, None for a caller's module (the checkpoint holds it)
    trainer: object
    trainer_note: str | None = None  # said in the log and summary.json
    pretrained: dict | None = None  # public pretraining's summary (or why it was skipped)
    public_data: list[str] = dataclasses.field(default_factory=list)  # for the privacy report


def _setup_training(cfg: SimulationConfig, model, tokenizer, pretrain: Pretrain | None, ext: dict,
                    log: Callable[[str], None], progress: bool = True) -> TrainingSetup:
    """The zoo model (pretrained on public text with `[pretrain]`, with a progress bar unless
    `progress` is off) and its trainer, or a caller's module through the eager trainers; a
    caller's client update / clipping rule put in place."""
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
    if model is None:
        setup = TrainingSetup(build_model(model_cfg), model_cfg, None)
        if cfg.pretrain.corpus:  # public text before the first private round (no privacy cost)
            if pretrain is None:
                raise DpfleetError("[pretrain] needs the public pretraining step: pass pretrain="
                                   "dpfleet.public.public_init.pretrain_on_public (dpfleet.simulate "
                                   "and the dpfleet CLI do)")
            setup.pretrained = pretrain(cfg, model_cfg, setup.model, tokenizer, log, progress=progress)
            setup.public_data = [f"{c} (pretraining, {cfg.pretrain.steps} steps)"
                                 for c in cfg.pretrain.corpus]
        runtime = make_runtime(cfg, model_cfg, default_program_cache())  # shared, keyed by content
        setup.trainer = make_trainer(cfg.client.trainer, runtime, model_cfg, seq_len=cfg.data.seq_len,
                                     batch_size=cfg.client.batch_size, device=cfg.client.device,
                                     memory_mb=cfg.client.cohort_memory_mb, backend=cfg.backend,
                                     precision=cfg.client.precision)
    else:
        setup = _custom_module_setup(cfg, model, model_cfg, log)
    if "client_update" in ext or "clipping" in ext:
        setup.trainer, note = custom_trainer(cfg, setup.trainer, setup.model_cfg, setup.model,
                                             ext.get("client_update"), ext.get("clipping"))
        setup.trainer_note = note or setup.trainer_note
    return setup


def _custom_module_setup(cfg: SimulationConfig, model, model_cfg,
                         log: Callable[[str], None]) -> TrainingSetup:
    """A caller's module: the cohort trainers' fused / torch.func paths assume a zoo model."""
    setup = TrainingSetup(model, None, None)
    if cfg.pretrain.corpus:  # said in the log and summary.json, not silently skipped
        setup.pretrained = {"skipped": "[pretrain] trains the config's zoo model; a custom model "
                                       "starts from the weights it was passed with"}
        log(setup.pretrained["skipped"])
    if cfg.client.runtime != "eager" or cfg.backend.kind != "local":
        raise DpfleetError("a custom model trains with client.runtime = 'eager' and backend.kind "
                           f"= 'local', not {cfg.client.runtime!r} / {cfg.backend.kind!r}")
    if cfg.client.trainer == "cohort":  # opt-in: torch.func over the module, checked once
        setup.trainer = custom_cohort_trainer(cfg, model_cfg, model)
        return setup
    if cfg.client.trainer == "auto":
        setup.trainer_note = ("client.trainer = 'auto': a custom model trains with the sequential "
                              "eager trainer (set 'cohort' for torch.func over your module)")
        log(setup.trainer_note)
    setup.trainer = make_trainer("sequential", EagerRuntime(model_cfg, threads=cfg.client.threads,
                                                            model=copy.deepcopy(model)),
                                 model_cfg, seq_len=cfg.data.seq_len, batch_size=cfg.client.batch_size)
    return setup


def _log_resume(cfg: SimulationConfig, engine: RoundEngine, resume: bool,
                log: Callable[[str], None]) -> None:
    start, lost = engine.start, engine.lost
    if not resume:
        return
    log(f"resuming after round {start} of {cfg.rounds}" if start else
        "no resume point was written yet: starting from round 1")
    if lost:
        log(f"rounds {lost[0]}-{lost[-1]} were released but their state was lost: they stay "
            f"accounted, and the run goes on from round {start - len(lost)}'s model on a "
            "fresh noise tree")
    if engine.kernels_changed:
        log(f"warning: earlier rounds ran the bfloat16 kernels {', '.join(engine.kernels_used[:-1])}; "
            f"this machine runs {engine.kernels} (another compiler, CPU or kernel source): the "
            "rounds from here round differently from an uninterrupted run's (the privacy is the "
            "same; summary.json's precision.kernels_used lists them)")


MAX_ATTEMPTS = 10  # in-process attempts of one round before the run stops with an error


class InProcessCollector:
    """`simulate`'s `Collector` (`round_driver`): each round's devices trained in this process
    (`train_plan`, or the audit's), every clipped delta checked, then summed in the clear or
    through the in-process SecAgg protocol, with a progress bar. Its devices vanish in SecAgg's
    phases as the device model's emulated devices do (`edge.devices.secagg_drops`: the same
    devices, attempts and phases as a served run's). A round the driver abandons opens again;
    its next attempt's SecAgg draws (rounding, dropouts) are keyed by the attempt too, and
    `before_round` runs once per round."""

    def __init__(self, cfg: SimulationConfig, engine: RoundEngine, trainer, population, *,
                 before_round=None, audit=None, clipping=None, bar=None,
                 log: Callable[[str], None] = print):
        self.cfg, self.engine, self.trainer, self.population = cfg, engine, trainer, population
        self.before_round, self.audit, self.clipping, self.bar, self.log = (
            before_round, audit, clipping, bar, log)
        self.ring_clients = engine.ring.ring_clients if engine.ring else None
        self.aggregator = make_aggregator(cfg, self.ring_clients)
        self.dim = engine.server.theta.size  # every device's delta has exactly this shape
        self.attempt = (engine.next_round, 0)  # (round, attempts opened)
        # round 0's (the starting model's) accuracy until the first evaluation; n/a on resume
        initial = engine.initial if not engine.start else None
        self.acc = "n/a" if initial is None else f"{initial['accuracy']:.4f}"

    async def open(self, engine: RoundEngine) -> RoundPlan | Stop:
        r = engine.next_round
        self.attempt = (r, self.attempt[1] + 1 if self.attempt[0] == r else 1)
        first = self.attempt[1] == 1  # public training between rounds happens once a round
        return engine.open_round(self.before_round if first else None, extra=selection_extra(self.cfg))

    async def collect(self, plan: RoundPlan) -> Collected | Failed:
        cfg, audit, attempt = self.cfg, self.audit, self.attempt[1]
        updates = (train_plan(cfg, self.trainer, self.population, plan) if audit is None
                   else audit.train_plan(cfg, self.trainer, self.population, plan))
        bound = plan.clip_norm if audit is None else audit.clip_bound(plan)  # audit: --break clipping
        check_clipped(updates, bound, self.dim, self.clipping, plan.round)  # before any sum
        bits = (None if plan.count_threshold is None else  # adaptive clipping's device bits
                [clipped_bit(u.norm, plan.count_threshold) for u in updates])
        seed = aggregation_seed(cfg.seed, plan.round, attempt)
        secagg = {}
        if cfg.aggregation.kind == "secagg":
            secagg = {"disc": round_discretizer(cfg, self.dim, plan.clip_norm, seed, self.ring_clients),
                      "dropouts": self.secagg_dropouts(plan, attempt)}
        try:
            agg = self.aggregator.aggregate([u.delta for u in updates], seed, bits=bits,
                                            clip_norm=plan.clip_norm, dim=self.dim, **secagg)
        except SecAggError as exc:  # below the threshold: the round fails, as over HTTP
            return Failed(f"secure aggregation aborted: {exc}")
        return Collected(agg, updates)

    def secagg_dropouts(self, plan: RoundPlan, attempt: int) -> dict[str, list[int]]:
        """{SecAgg phase: positions vanishing before its message} of this attempt (said in the
        log, device ids by phase): the service numbers rounds and attempts from 1."""
        from dpfleet.secagg.inprocess import PHASES

        phases = tuple(p for p in PHASES if p != "consistency" or self.cfg.aggregation.signed)
        gone = secagg_drops(self.cfg.devices, self.cfg.seed, plan.devices, plan.round + 1, attempt,
                            phases)
        if gone:
            said = "; ".join(f"{p}: {', '.join(plan.device_ids[u] for u in gone[p])}" for p in phases
                             if p in gone)
            self.log(f"round {plan.round + 1} (attempt {attempt}): SecAgg dropouts ({said})")
        return gone

    def closing(self, plan: RoundPlan) -> None:
        pass

    def committed(self, plan: RoundPlan, record: dict, seconds: float) -> None:
        if self.bar is None:  # eps so far, every round: privacy.json's figure (one conversion, PLD)
            return
        self.acc = self.acc if record["accuracy"] is None else f"{record['accuracy']:.4f}"
        # a projection's bar shows the run's own eps, named so (never the projected one)
        eps_key = "eps_this_run" if self.cfg.projection.noise_cohort else "eps"
        self.bar.set_postfix({"acc": self.acc, eps_key: f"{record['epsilon']:.2f}"})
        self.bar.update(1)

    def failed(self, plan: RoundPlan, reason: str) -> None:
        self.log(f"round {plan.round + 1} (attempt {self.attempt[1]}) abandoned: {reason}")
        if self.attempt[1] >= MAX_ATTEMPTS:  # seeded: a round that aborts this often always will
            raise DpfleetError(f"round {plan.round + 1} was abandoned {MAX_ATTEMPTS} times in a row "
                               f"({reason}); raise service.overselect or lower devices.dropout_secagg")


def _run_rounds(cfg: SimulationConfig, engine: RoundEngine, trainer, population, before_round, audit,
                clipping, progress: bool, on_round: Callable[[dict], None] | None = None,
                log: Callable[[str], None] = print) -> str | None:
    """The rounds through the one round driver (`round_driver.drive`) with the in-process
    collector; returns why the run stopped early (None: all its rounds were done)."""
    bar = None
    if progress:
        from dpfleet.progress import progress_bar

        bar = progress_bar(desc="rounds", unit="round", dynamic_ncols=True, initial=engine.start,
                           total=cfg.rounds, terminal_only=False)
    collector = InProcessCollector(cfg, engine, trainer, population, before_round=before_round,
                                   audit=audit, clipping=clipping, bar=bar, log=log)
    try:
        stop = run_to_end(drive(engine, collector, on_round))
    finally:
        if bar is not None:
            bar.close()
    return None if stop is None or stop.reason == "done" else stop.message


def plan_run(cfg: SimulationConfig, run: RunDir, population: int, resume: bool,
             log: Callable[[str], None], plan: RunPlan | None = None) -> tuple[SimulationConfig, RunPlan]:
    """dp.target_epsilon: the config with the planner's choice for this population, and `plan`
    (what the config states of the planned keys, which must agree) holding it; then config.json
    and plan.json (a resumed run re-plans and must agree with its own config.json)."""
    from dpfleet.coordinator.run_privacy.config_plan import apply_run_plan, make_run_plan, plan_line

    record = make_run_plan(cfg, population)
    cfg, plan = apply_run_plan(cfg, plan or RunPlan(), record)
    if not resume:
        run.write_config(cfg.resolved())
        run.write_json("plan.json", record)
    log(plan_line(record))
    return cfg, plan


def custom_cohort_trainer(cfg: SimulationConfig, model_cfg, model: torch.nn.Module):
    """The cohort trainer's torch.func path over a caller's module, tried on one dummy client
    first: a module torch.func cannot batch (random dropout, in-place state) is one clear error."""
    from dpfleet.edge.cohort import CohortTrainer

    trainer = CohortTrainer(model_cfg, seq_len=cfg.data.seq_len, batch_size=cfg.client.batch_size,
                            device=cfg.client.device, memory_mb=cfg.client.cohort_memory_mb, model=model,
                            precision=cfg.client.precision)
    rows = np.full((2, cfg.data.seq_len + 1), 4, dtype=np.int32)
    try:
        trainer.train_round(get_flat(model), [rows], [0], lr=0.0, batch_size=cfg.client.batch_size,
                            clip_norm=1.0)
    except Exception as exc:  # the user's module under vmap
        raise DpfleetError(f"client.trainer = 'cohort' cannot batch this model with torch.func "
                           f"({type(exc).__name__}: {str(exc)[:200]}); use 'sequential' or 'auto'") from None
    return trainer


def largest_id(data) -> int:
    """The largest token id in the federated data's rows (train and held-out clients)."""
    return max((int(c.examples.max()) for c in (*data.train, *data.test) if c.examples.size), default=0)


class _ShortEmbedding(Exception):
    """Raised by `_token_embedding_guard` before a too-small embedding looks the ids up."""

    def __init__(self, module: torch.nn.Embedding):
        self.module = module


@contextmanager
def _token_embedding_guard(model: torch.nn.Module, ids: torch.Tensor, rows_needed: int):
    """While active, an `nn.Embedding` that is handed the token ids themselves (not positions or
    segment ids, which a transformer embeds too) with fewer than `rows_needed` rows raises
    `_ShortEmbedding`: the vocabulary check looks at what the ids index."""

    def check(module: torch.nn.Embedding, inputs: tuple) -> None:
        seen = inputs[0] if inputs else None
        if (isinstance(seen, torch.Tensor) and seen.shape == ids.shape and torch.equal(seen, ids)
                and module.num_embeddings < rows_needed):
            raise _ShortEmbedding(module)

    hooks = [m.register_forward_pre_hook(check) for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def check_custom_model(model: torch.nn.Module, vocab_size: int, seq_len: int, data) -> None:
    """One forward on a dummy batch before any training: a custom model must map int64 token ids
    [batch, time] to logits [batch, time, vocab_size] (a tensor, or `.logits` as Hugging Face
    models return), and the embedding the ids index must hold every token id in the data, so a
    mismatch is one clear error instead of a traceback rounds later."""
    top = largest_id(data)
    need = max(vocab_size, top + 1)
    # not 0..n-1: a positional embedding's input must not look like the token ids
    dummy = (torch.arange(2 * seq_len, dtype=torch.int64).reshape(2, seq_len) * 7 + 5) % vocab_size
    training = model.training
    model.eval()  # no dropout: the check draws nothing from torch's seeded generator
    try:
        with torch.no_grad(), _token_embedding_guard(model, dummy, need):
            out = logits_of(model(dummy))
    except _ShortEmbedding as short:
        raise DpfleetError(f"vocabulary mismatch: the model's token embedding has "
                           f"{short.module.num_embeddings} rows but token ids reach {need - 1} "
                           f"(tokenizer vocab_size {vocab_size}, largest id in the data {top})") from None
    except DpfleetError:
        raise
    except Exception as exc:  # the user's module: any failure is their input's
        raise DpfleetError(f"the model failed on a dummy batch of token ids [2, {seq_len}] (int64, "
                           f"ids < {vocab_size}): {type(exc).__name__}: {exc}") from None
    finally:
        model.train(training)
    expected = (2, seq_len, vocab_size)
    got = tuple(out.shape)
    if got != expected:
        what = ("vocabulary mismatch: the model's output vocabulary differs from the tokenizer's "
                "vocab_size" if got[:2] == expected[:2] else "the model's output has the wrong shape")
        raise DpfleetError(f"{what}: token ids [2, {seq_len}] must give logits [batch, time, vocab] "
                           f"= {list(expected)}, got {list(got)}")
    if not out.is_floating_point():
        raise DpfleetError(f"the model's output must be float logits, got {out.dtype}")


def train_plan(cfg: SimulationConfig, trainer, clients, plan: RoundPlan) -> list:
    """The plan's devices trained in-process on the plan's model (seeds keyed by round, client).
    `clients`: the run's `ClientStore`, or a list of `ClientData` (the same rows)."""
    rows = clients.examples if isinstance(clients, ClientStore) else lambda i: clients[i].examples
    return trainer.train_round(
        plan.theta, [rows(i) for i in plan.devices],
        [derive_seed(cfg.seed, plan.round, i) for i in plan.devices], lr=cfg.client.lr,
        batch_size=cfg.client.batch_size, clip_norm=plan.clip_norm,
    )
