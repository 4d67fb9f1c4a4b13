"""Algorithm 1 of paper 000 end to end, from one TOML file: private FL with public training.

    1. first-stage DP-FTRL for T' rounds                          (the round engine)
    2. score every public record: l_priv (DP checkpoint), l_pub (teacher)      (matching.py)
    3. keep the top q by (1 - beta) l_pub + beta l_priv                        (matching.py)
    4. public mid-training on that selection with L_LM + beta_kd L_KD      (kd_pretrain.py)
    5. second-stage DP-FTRL for T - T' rounds                             (the round engine)

Steps 2-4 run inside one simulation through its `before_round` hook at round T', so the DP-FTRL
server (tree, momentum, round counter) simply continues with the new theta and the privacy
report covers all T rounds: public training is post-processing of a DP release and needs no
restart. The same file also gives every row of paper 000's Table 2: `selection = "none"` (no
public data), `first_stage_rounds = 0` (public *pre*-training, random q, with or without KD),
`selection = "random"` (mid-training on a random q) and `"match"` (distribution matching);
`match_beta = 1` is Table 3's l_priv-only ablation.

The teacher's work (the trimmed tokenizer, top-k labels and log-probs of the pool) is cached in
`$DPFLEET_CACHE/public/` keyed by its inputs, and the top-k shards resume, so variants of one
pool pay for the teacher once.

Precision. `public.precision` ("auto", the default, | "float32" | "bfloat16"; `dpfleet.edge.precision`)
is the teacher body's on CPU (on CUDA the body is bfloat16 anyway) and public training's GEMMs
(bfloat16 autocast; weights and Adam state stay float32). Both resolved choices are stated in
summary.json's `precision`, and the teacher's is part of every key its output is cached under
(l_pub here, the top-k labels in public/topk_cache.py): a bfloat16 body gives other log-probs, so
a float32 entry is never served to a bfloat16 run or the reverse. The student's own l_priv
scoring and the simulation's clients follow `[simulation] client.precision`, not this key.

Config layout (strict, like the simulate config):

    [public]      teacher, vocab_size, first_stage_rounds, selection, fraction, match_beta,
                  kd_beta, temperature, steps, batch_size, lr, k, batch_tokens, vocab_records,
                  targets, student_device, precision
    [pool]        sources, records, seq_len, seed
    [simulation]  a full `dpfleet simulate` config (rounds = T; private data, model, dp, ...)
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dpfleet.coordinator.config import SimulationConfig, build_section, parse_config, read_toml
from dpfleet.coordinator.state.resume import differing_keys
from dpfleet.edge.cohort import model_params
from dpfleet.edge.overlap import check_public_sources, check_public_texts
from dpfleet.edge.precision import PRECISIONS, Precision, resolve_precision
from dpfleet.edge.wheel_cache import cache_dir
from dpfleet.errors import DpfleetError
from dpfleet.export.models import build_model
from dpfleet.export.params import set_flat
from dpfleet.io import atomic_write
from dpfleet.jsonio import SPACED, canonical_sha256, write_json
from dpfleet.public.kd_pretrain import KDTrainConfig, PlainCorpus, kd_train, student_device
from dpfleet.public.matching import (
    Pool,
    build_pool,
    match_scores,
    random_fraction,
    source_report,
    student_logprobs,
    teacher_logprobs,
    top_fraction,
)
from dpfleet.public.public_init import pretrain_on_public
from dpfleet.public.teacher_tokenizer import TeacherVocab
from dpfleet.public.topk import TARGETS

SELECTIONS = ("none", "random", "match", "fred")


@dataclass
class PublicSection:
    teacher: str = "gemma3-270m"  # packaged name or a Hugging Face folder
    vocab_size: int = 4096  # on-device vocabulary trimmed from the teacher's (unless tokenizer.path)
    vocab_records: int = 20_000  # WikiText-2 records that choose the kept pieces
    first_stage_rounds: int = -1  # T'; -1 = rounds // 2; 0 = public pre-training
    selection: str = "match"  # "none" | "random" | "match" | "fred"
    fred_stats: str = ""  # fred_stats.npz (`dpfleet public fred-stats`) for selection = "fred"
    fraction: float = 0.1  # q: share of the pool trained on
    match_beta: float = 0.5  # weight of l_priv in the ranking (1 = l_priv only)
    kd_beta: float = 0.1  # weight of L_KD (0 = plain next-token loss, no teacher labels)
    temperature: float = 1.0
    steps: int = 200  # public training steps
    batch_size: int = 32
    lr: float = 3e-3
    k: int = 10  # teacher logits kept per position
    batch_tokens: int = 0  # teacher batch size in tokens (one host copy); 0: automatic
    targets: str = "teacher"  # top-k taken in the "teacher" or the "student" vocabulary
    student_device: str = "cpu"  # public training's device (the teacher uses cuda when present)
    precision: str = "auto"  # teacher body and public training: "auto" | "float32" | "bfloat16"


@dataclass
class PoolSection:
    # no Shakespeare by default: shakespeare-collab is public only next to a private
    # shakespeare-solo (edge/overlap.py), and the default private dataset is shakespeare
    sources: list[str] = field(default_factory=lambda: ["wikitext2", "kjv"])
    records: list[int] = field(default_factory=lambda: [600, 400])
    seq_len: int = 20
    seed: int = 0


@dataclass
class PipelineConfig:
    public: PublicSection = field(default_factory=PublicSection)
    pool: PoolSection = field(default_factory=PoolSection)
    simulation: SimulationConfig = field(default_factory=SimulationConfig)

    @property
    def switch_round(self) -> int:
        t = self.public.first_stage_rounds
        return self.simulation.rounds // 2 if t == -1 else t

    def resolved(self) -> dict:
        return dataclasses.asdict(self)


def parse_pipeline(values: dict) -> PipelineConfig:
    values = dict(values)
    sim = parse_config(values.pop("simulation", {}))
    parts = build_section(PipelineConfig, values, "")
    cfg = dataclasses.replace(parts, simulation=sim)
    p = cfg.public
    checks = [
        (p.selection in SELECTIONS, f"public.selection must be one of {SELECTIONS}"),
        (-1 <= p.first_stage_rounds < sim.rounds,
         "public.first_stage_rounds must be in [0, simulation.rounds) (or -1: rounds // 2)"),
        (p.selection != "match" or cfg.switch_round >= 1,
         "distribution matching needs a DP checkpoint: public.first_stage_rounds >= 1"),
        (0 < p.fraction <= 1, "public.fraction must be in (0, 1]"),
        (p.selection != "fred" or Path(p.fred_stats).is_file(),
         f'selection = "fred" needs public.fred_stats, an existing fred_stats.npz (got {p.fred_stats!r})'),
        (0 <= p.match_beta <= 1, "public.match_beta must be in [0, 1]"),
        (p.kd_beta >= 0 and p.temperature > 0, "public.kd_beta >= 0 and temperature > 0"),
        (p.steps >= 0 and p.batch_size >= 1 and p.lr > 0, "public.steps/batch_size/lr out of range"),
        (1 <= p.k <= 64, "public.k must be in [1, 64]"),
        (p.targets in TARGETS, f"public.targets must be one of {TARGETS}"),
        (p.batch_tokens >= 0, "public.batch_tokens must be >= 0 (0: automatic)"),
        (p.precision in PRECISIONS, f"public.precision must be one of {PRECISIONS}"),
        (len(cfg.pool.sources) == len(cfg.pool.records) and cfg.pool.sources,
         "pool.sources and pool.records must be non-empty lists of the same length"),
        (all(isinstance(n, int) and n >= 1 for n in cfg.pool.records), "pool.records must be >= 1"),
        (cfg.pool.seq_len >= 4, "pool.seq_len must be >= 4"),
    ]
    for ok, message in checks:
        if not ok:
            raise DpfleetError(message)
    student_device(p.student_device)
    check_public_sources(cfg.pool.sources, sim.data.dataset, "pool source")
    if not sim.tokenizer.path:
        check_public_sources(["wikitext2"], sim.data.dataset, "the teacher vocabulary's corpus")
    return cfg


def public_data(cfg: PipelineConfig) -> list[str]:
    """The public data this pipeline trains on, for the privacy report."""
    p, pool = cfg.public, cfg.pool
    used = [f"the teacher LLM {p.teacher} (public weights; its own training data is outside "
            "this run)"]
    if not cfg.simulation.tokenizer.path:
        used.append(f"{p.vocab_records} WikiText-2 records that trimmed the teacher's vocabulary")
    if p.selection != "none":
        records = ", ".join(f"{s} ({n} records)" for s, n in zip(pool.sources, pool.records,
                                                                  strict=True))
        used.append(f"public pool {records}: {p.selection} selection of q = {p.fraction:g} for "
                    f"public training at round {cfg.switch_round}")
    return used


def check_pool_is_public(cfg: PipelineConfig, pool: Pool) -> None:
    """No pool record's text is also a private record (see `edge.overlap`)."""
    from dpfleet.edge.datasets import load_records

    data = cfg.simulation.data
    private = load_records(data.dataset, "train", Path(data.path) if data.path else None)
    check_public_texts(zip(pool.sources, pool.texts, strict=True), (r.text for r in private),
                       data.dataset)


def load_pipeline(path: Path) -> PipelineConfig:
    return parse_pipeline(read_toml(path, "pipeline config"))


def cache_key(*parts: object) -> str:
    return canonical_sha256(parts, separators=SPACED, default=str).hexdigest()[:16]  # old entries hit


def teacher_vocab(cfg: PipelineConfig, log: Callable[[str], None]) -> TeacherVocab:
    """The on-device tokenizer: simulation.tokenizer.path, or the teacher's trimmed (cached)."""
    if cfg.simulation.tokenizer.path:
        return TeacherVocab.load(Path(cfg.simulation.tokenizer.path))
    from dpfleet.edge.datasets import load_records
    from dpfleet.public.teacher import resolve_teacher
    from dpfleet.public.teacher_tokenizer import build_teacher_vocab, load_teacher_spm

    p = cfg.public
    folder = cache_dir() / "public" / f"vocab-{cache_key(p.teacher, p.vocab_size, p.vocab_records)}"
    if (folder / "teacher.json").is_file():
        return TeacherVocab.load(folder)
    log(f"trimming {p.teacher}'s vocabulary to {p.vocab_size} pieces -> {folder}")
    texts = [r.text for r in load_records("wikitext2")[: p.vocab_records]]
    return build_teacher_vocab(load_teacher_spm(resolve_teacher(p.teacher)), texts, p.vocab_size,
                               folder, p.teacher)


class TeacherWork:
    """The teacher's labels for one pool, computed on first use and cached on disk."""

    def __init__(self, cfg: PipelineConfig, vocab: TeacherVocab, pool: Pool, progress: bool):
        from dpfleet.public.teacher import body_precision, default_device

        p = cfg.public
        self.precision: Precision = body_precision(p.precision, default_device().type, "public.precision")
        # what the body ran at, in every key of its output (float32 on CPU: keys as they were)
        self.key_parts: tuple = (() if self.precision.name == "float32"
                                 else (default_device().type, self.precision.name))
        key = cache_key(p.teacher, vocab.meta, pool.fingerprint(), p.k,
                        *(() if p.targets == "teacher" else (p.targets,)), *self.key_parts)
        self.folder = cache_dir() / "public" / f"pool-{key}"
        self.cfg, self.vocab, self.pool, self.progress = cfg, vocab, pool, progress
        self._extractor = None

    def extractor(self):
        if self._extractor is None:
            from dpfleet.public.teacher import load_teacher
            from dpfleet.public.topk import TopKExtractor

            p = self.cfg.public
            teacher = load_teacher(p.teacher, precision=self.precision.name)
            self._extractor = TopKExtractor(teacher, self.vocab, p.k, p.targets)
        return self._extractor

    def corpus(self):
        """The pool's top-k labels from the machine's label cache (public/topk_cache.py), which
        every job with the same teacher, vocabulary, k, targets, head and text shares."""
        from dpfleet.public.topk import TopKCorpus
        from dpfleet.public.topk_cache import cached_topk_corpus

        folder = cached_topk_corpus(self.extractor(), self.pool.sequences,
                                    batch_tokens=self.cfg.public.batch_tokens,
                                    progress=self.progress, log=lambda line: None)
        corpus = TopKCorpus(folder)
        if len(corpus) != len(self.pool.sequences):
            raise DpfleetError(f"{folder} does not match the pool; delete it")
        return corpus

    def logprobs(self) -> np.ndarray:
        # named for the scoring method: an l_pub.npy cached by the old on-device-segmentation
        # scoring (a different quantity) must not be picked up
        path = self.folder / "l_pub_teacher_tokens.npy"
        if not path.is_file():
            scores = teacher_logprobs(self.extractor(), self.vocab.tokenizer, self.pool.sequences,
                                      self.cfg.public.batch_tokens, self.progress)
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write(path, lambda f: np.save(f, scores))
        return np.load(path)


def _stated(precision: Precision) -> dict:
    return {"used": precision.name, "reason": precision.reason}


def _check_resumable(cfg: PipelineConfig, out: Path) -> None:
    if not (out / "pipeline.json").is_file():
        raise DpfleetError(f"{out} holds no started pipeline (no pipeline.json): nothing to resume")
    changed = differing_keys(json.loads((out / "pipeline.json").read_text()), cfg.resolved(),
                             ("public", "pool"))
    if changed:
        raise DpfleetError(f"{out} was started with another pipeline config (it differs in "
                           f"[{'], ['.join(changed)}]); resume it with the config it was started with")


def run_pipeline(cfg: PipelineConfig, out: Path, *, overwrite: bool = False, resume: bool = False,
                 progress: bool = True, log: Callable[[str], None] = print,
                 teacher_work: Callable[..., TeacherWork] = TeacherWork) -> dict:
    """Run Algorithm 1 (or the Table 2 variant `cfg.public` describes) into run folder `out`.

    With `resume`, `out` is an interrupted pipeline of this config: its DP-FTRL run continues
    from its last resume point, and a public stage already done is not redone. `teacher_work`
    builds the teacher's labels from (cfg, vocab, pool, progress); a benchmark can restrict it
    to part of the pool (benchmarks/quality/lpub_kd.py).
    """
    from dpfleet.coordinator.engine.simulation import run_simulation
    from dpfleet.public.fred_privacy import fred_releases

    out = Path(out)
    p = cfg.public
    # checked before the run folder exists: "bfloat16" on a CPU without it is one line, no folder
    resolve_precision(p.precision, student_device(p.student_device).type, "public.precision")
    if (out / "summary.json").is_file() and not overwrite:
        raise DpfleetError(f"{out} holds a finished pipeline; pass --overwrite or choose another --out")
    if resume:
        _check_resumable(cfg, out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    vocab = teacher_vocab(cfg, log)
    sim = _simulation_with_teacher_tokenizer(cfg, vocab)
    write_json(out / "pipeline.json", dataclasses.replace(cfg, simulation=sim).resolved(), indent=2)
    pool = build_pool(cfg.pool.sources, cfg.pool.records, vocab.tokenizer, cfg.pool.seq_len,
                      cfg.pool.seed)
    check_pool_is_public(cfg, pool)
    pool.save(out / "pool.npz")
    teacher = teacher_work(cfg, vocab, pool, progress)
    model_cfg = dataclasses.replace(sim.model, vocab_size=vocab.tokenizer.vocab_size)
    # once the student's size is known, "auto" reads it (a small student ran slower in bfloat16)
    training_precision = resolve_precision(p.precision, student_device(p.student_device).type,
                                           "public.precision", params=model_params(model_cfg))
    switch = cfg.switch_round
    report: dict = {"switch_round": switch, "selection": p.selection, "pool_size": len(pool.sequences)}
    stage_file = out / "public_stage.json"  # the public stage's report, once it is done
    if resume and stage_file.is_file():
        report.update(json.loads(stage_file.read_text()))

    # the FreD statistics of the same users (a resumed stage's, or the stage's once it ran): the
    # run composes them with its training (`run_accountant.run_privacy`)
    other_releases: list[dict] = fred_releases(report.get("fred_privacy"))

    def public_training(r: int, theta: np.ndarray) -> np.ndarray | None:
        if r != switch or p.selection == "none":
            return None
        t0 = time.perf_counter()
        np.save(out / "first_stage_theta.npy", theta)  # the DP checkpoint at round T'
        chosen = _select_public(cfg, pool, teacher, model_cfg, theta, out, report, other_releases)
        corpus = teacher.corpus() if p.kd_beta > 0 else PlainCorpus(pool.sequences)
        used_teacher = p.kd_beta > 0 or (p.selection == "match" and p.match_beta < 1)
        kd_cfg = KDTrainConfig(steps=p.steps, batch_size=p.batch_size, lr=p.lr, beta=p.kd_beta,
                               temperature=p.temperature, seed=sim.seed,
                               device=p.student_device, precision=training_precision.name)
        stage = "pre-training" if r == 0 else f"mid-training at round {r}"
        new_theta, history = kd_train(model_cfg, theta, corpus, chosen, kd_cfg, progress=progress,
                                      desc=f"public {stage}")
        report.update(selected=len(chosen), sources=source_report(pool.sources, chosen),
                      public_training=history, public_seconds=time.perf_counter() - t0,
                      selected_indices=[int(i) for i in chosen],
                      precision={"teacher": _stated(teacher.precision) if used_teacher else None,
                                 "public_training": _stated(training_precision)})
        write_json(stage_file, report, default=float)
        shares = ", ".join(f"{s} {v['selected']}/{v['pool']}" for s, v in report["sources"].items())
        log(f"public {stage}: {len(chosen)} of {len(pool.sequences)} records ({shares})")
        return new_theta

    started = (out / "simulation" / "config.json").is_file()
    result = run_simulation(sim, out / "simulation", overwrite=True, resume=resume and started,
                            progress=progress, log=log, before_round=public_training,
                            public_data=public_data(cfg), pretrain=pretrain_on_public,
                            other_releases=other_releases)
    summary = _summary(report, result, switch, time.perf_counter() - start)
    write_json(out / "summary.json", summary, indent=2, default=float)
    return summary


def _simulation_with_teacher_tokenizer(cfg: PipelineConfig, vocab: TeacherVocab) -> SimulationConfig:
    """`[simulation]` with the teacher's trimmed SentencePiece tokenizer (unless it names its
    own): the student is trained and scored in the vocabulary the teacher's labels are in."""
    tok_path = cfg.simulation.tokenizer.path or str(vocab.tokenizer.model_file.parent)
    return dataclasses.replace(cfg.simulation, tokenizer=dataclasses.replace(
        cfg.simulation.tokenizer, kind="sentencepiece", path=tok_path))


def _select_public(cfg: PipelineConfig, pool: Pool, teacher: TeacherWork, model_cfg, theta: np.ndarray,
                   out: Path, report: dict, other_releases: list[dict]) -> np.ndarray:
    """The indices of the pool records public training uses, by `public.selection`: distribution
    matching scores them with the DP checkpoint `theta` (and the teacher), FreD by the DP
    statistics, whose release then joins `other_releases` (the run composes it), else at random."""
    from dpfleet.public.fred_privacy import fred_releases

    p = cfg.public
    if p.selection == "match":
        model = build_model(model_cfg)
        set_flat(model, theta)
        l_priv = student_logprobs(model, pool.sequences)
        l_pub = teacher.logprobs() if p.match_beta < 1 else None
        chosen = top_fraction(match_scores(l_pub, l_priv, p.match_beta), p.fraction)
        np.savez(out / "scores.npz", l_priv=l_priv,
                 l_pub=l_pub if l_pub is not None else np.full_like(l_priv, np.nan))
    elif p.selection == "fred":  # FreD (paper 003): rank by likelihood under the DP statistics
        from dpfleet.public.fred_job import fred_select

        chosen, fred_report = fred_select(Path(p.fred_stats), pool.texts, pool.sources, p.fraction)
        report.update(fred_report)
        other_releases[:] = fred_releases(report.get("fred_privacy"))  # once, also on a resume
    else:
        chosen = random_fraction(len(pool.sequences), p.fraction, cfg.pool.seed)
    return chosen


def _summary(report: dict, result, switch: int, wall_seconds: float) -> dict:
    """summary.json: the public stage's report with the finished run's accuracy and privacy (its
    eps with the FreD statistics of the same users, when they were released)."""
    at_switch = [m for m in result.metrics if m["round"] == switch and m.get("accuracy") is not None]
    summary = {
        **report,
        "final": result.final,
        "accuracy_before_public_training": at_switch[0]["accuracy"] if at_switch else None,
        "epsilon": result.privacy.get("epsilon"),
        "privacy": result.privacy,
        "rounds_completed": len(result.metrics),
        "stopped_early": result.stopped_early,
        "wall_seconds": wall_seconds,
    }
    if "total_with_releases" in result.privacy:  # DP-FTRL and the same users' FreD statistics
        summary["epsilon_with_fred"] = result.privacy["total_with_releases"]["epsilon"]
    return summary
