"""Simulation config: a TOML file mapped onto typed sections, validated strictly.

Every key is checked against the dataclass fields, so a typo (`noise_multiplyer`) is an error
with a suggestion instead of a silently ignored setting. `resolved()` gives the full config with
defaults filled in; each run directory stores it, so a run can be reproduced from its folder.

Every section is a frozen dataclass: a config is checked once, when it is parsed (`validate`),
and the checked config is the one that runs. Code that needs other values makes a new config
(`config_overrides.with_values`, `dataclasses.replace`) and checks that one; what a config states
beside its settings (the planned keys it gives, a run's mechanism pin) is kept in
`run_privacy.config_plan.RunPlan`, never attached to it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dpfleet.coordinator.accounting.planner import capped_max_participation
from dpfleet.coordinator.accounting.zcdp import default_count_stddev, model_noise_multiplier
from dpfleet.coordinator.config_overrides import apply_overrides, with_values
from dpfleet.edge.devices import DevicesSection
from dpfleet.edge.traces import read_header
from dpfleet.errors import DpfleetError
from dpfleet.export.models import PRESETS, ModelConfig, with_preset


@dataclass(frozen=True)
class DataSection:
    """The private users' text: which dataset, and how it is cut into clients' training rows."""

    dataset: str = "shakespeare"
    """A built-in dataset (`dpfleet data list`), or your own file at `path`: "jsonl", "tff_sqlite"
    (TFF's SQLite ClientData), "tff_h5" (TFF's HDF5 files) or "leaf" (LEAF's JSON)."""
    path: str = ""
    """Your file: for "jsonl" one `{"user": ..., "text": ...}` object per line; for "leaf" a JSON
    file or a folder of them."""
    split: str = "train"
    """dataset = "tff_sqlite": the `split_name` read (StackOverflow: train, heldout, test); "" for
    every split."""
    feature: str = ""
    """dataset = "tff_sqlite" / "tff_h5": the example feature holding the text; "" takes
    `tokens` (StackOverflow), `snippets` (Shakespeare) or `text`, the first present."""
    seq_len: int = 20
    """Tokens per training example (paper 000 App. C)."""
    max_examples: int = 256
    """Examples per client, at most (paper 000 App. C)."""
    test_fraction: float = 0.1
    """Share of the users held out, whole, for evaluation."""
    max_clients: int = 0
    """Train on the first this many training clients only; 0: every one."""
    eval_examples: int = 3000
    """Held-out rows scored at each evaluation; 0: all."""
    keyboard_words: int = 30
    """Held-out words (from a seeded sample of held-out rows) the finished model's suggestion strip
    is scored on: top-1 / top-3 word recall and keystroke savings, summary.json's `keyboard`; 0:
    none. Each word costs a few dozen model calls at the run's end."""
    generated_population: int = 0
    """> 0: a GENERATED population of this many clients cycled from the real ones, for speed and
    memory tests only (users repeat: the run's epsilon is no guarantee for real people)."""


@dataclass(frozen=True)
class TokenizerSection:
    """The vocabulary: a public SentencePiece model, public words (TFF's way), TFF's characters, or
    the private clients' words chosen with DP."""

    kind: str = "sentencepiece"
    """"sentencepiece" (trained on the public `corpus`), "word" (the words of `word_counts` or
    `words` when one is set, else the private clients' words, chosen with user-level DP:
    coordinator/mechanisms/dp_vocabulary.py) or "char" (TFF Shakespeare's 86 characters + OOV;
    vocab_size is then 90 whatever is set)."""
    vocab_size: int = 1024
    """Tokens in the vocabulary, so the model's embedding rows."""
    corpus: str = "wikitext2"
    """The public corpus the SentencePiece model is trained on (cached after the first run)."""
    path: str = ""
    """An existing tokenizer folder, used instead of building one (overrides kind and corpus)."""
    allow_nonprivate_vocabulary: bool = False
    """kind = "word" without DP: the private clients' top words, outside the guarantee (the
    privacy report says so)."""
    word_counts: str = ""
    """kind = "word": a PUBLIC word-count file in TFF's format (`word count` a line, as TFF's
    `stackoverflow.word_count`); the most frequent words fill vocab_size (outside the private data,
    so no privacy cost)."""
    words: str = ""
    """kind = "word": a PUBLIC word list, one a line, likeliest first (instead of word_counts)."""
    oov_buckets: int = 1
    """kind = "word" from a public file: OOV hash buckets, as TFF's num_out_of_vocab_buckets."""
    split: str = "tff"
    """kind = "word" from a public file: "tff" (lower-case, split on spaces: TFF StackOverflow's
    pre-tokenized text) or "words" (words and punctuation marks, like the private word kind)."""
    dp_noise: float = 1.0
    """kind = "word": sigma on each word's count of users (each user's L2 weight <= 1)."""
    dp_words_per_user: int = 128
    """kind = "word": k, the distinct words one user contributes at most."""
    dp_delta: float = 1e-7
    """kind = "word": the chance a word held by one user alone is kept; adds to dp.delta. Must be
    below 1/N for the N training users (refused otherwise, as dp.delta)."""


def public_words(tok: TokenizerSection) -> str:
    """The public word file a word vocabulary is built from ("" when none)."""
    return tok.word_counts or tok.words


@dataclass(frozen=True)
class ClientSection:
    """A device's local training: one epoch of SGD over its examples, and what runs it."""

    lr: float = 1.0
    """Local SGD learning rate."""
    batch_size: int = 16
    """Local SGD batch size."""
    runtime: str = "eager"
    """"eager" (torch), or the exported phone training programs: "executorch" | "onnx"."""
    threads: int = 1
    """Torch threads; the cohort trainer runs this many worker processes (results depend on
    this number, not on how many cores the machine has)."""
    trainer: str = "auto"
    """Who trains a round's clients: "auto" (all at once, cohort, when runtime = "eager"; else
    sequential) | "sequential" | "cohort". summary.json says which ran."""
    device: str = "auto"
    """The cohort trainer's device: "auto" (CUDA when present) | "cpu" | "cuda"."""
    cohort_memory_mb: int = 160
    """Cohort chunk budget on CPU: clients per chunk = this / one client's working memory."""
    precision: str = "auto"
    """The cohort trainer's and public pretraining's GEMMs: "auto" (bfloat16 where the CPU has
    native BF16, AMX or AVX512-BF16, and the model has at least `edge.precision`'s
    AUTO_BF16_MIN_PARAMS parameters; else float32) | "float32" | "bfloat16" (an error on a CPU
    without it). The LSTM/CIFG cohort then runs its own bfloat16 GEMMs (bfloat16 weight copies once
    per local step), the transformer and pretraining run under bfloat16 autocast. "auto" by
    default: on a CPU with AMX-BF16 the Gboard-size CIFG (1.4M parameters) trained 1.26x faster
    in bfloat16 at 1 thread, the main job's CIFG (81k) no faster, so it stays float32 there and its
    results are float32's (benchmarks/precision_throughput.py). Weights, deltas, clipping and the DP sum stay
    float32; summary.json says which ran and why."""


@dataclass(frozen=True)
class DPSection:
    """DP-FTRL: clipping, noise, the server's update, and the privacy target or budget."""

    noise_multiplier: float = 1.0
    """z: the noise's standard deviation over the clip norm (the planner's with target_epsilon)."""
    clip_norm: float = 2.0
    """The L2 bound on each client's update (with adaptive clipping: the initial C^0)."""
    report_goal: int = 20
    """Clients summed per round (the planner's with target_epsilon)."""
    server_lr: float = 1.0
    """The server's learning rate on the noised mean update."""
    momentum: float = 0.5
    """Server momentum. It also amplifies the noise: 0.9 hurt at Shakespeare's population."""
    restart_rounds: list[int] = field(default_factory=list)
    """Rounds (0-based) at which a fresh noise tree starts (mechanisms with restarts)."""
    delta: float = 1e-6
    """The delta of the (eps, delta) guarantee; below 1/N for N users (a run is refused otherwise:
    at delta >= 1/N a mechanism that publishes one user's data outright meets the promise)."""
    budget_epsilon: float = 0.0
    """Stop before a round that would pass this eps (PLD at delta); 0: no budget."""
    warn_epsilon: float = 10.0
    """A finished run whose eps is above this gets a warning line (summary, summary.json, Result);
    0: never warn. 10 is where a guarantee stops meaning much: the "reasonable" tier of Ponomareva
    et al. 2023 (How to DP-fy ML) ends there, and Gboard's launched models (paper 002, rho
    0.25-1.86) are at eps 3.3-10.5 at delta 1e-6."""
    adaptive_clipping: bool = False
    """Adaptive clipping (paper 002 Alg. 1): clip_norm is the initial C^0, the estimate is adopted
    at tree restarts (restart_rounds, default 128 + 1024 i); noise_multiplier stays the accounted
    z (the model gets the inflated z_delta of App. A)."""
    target_quantile: float = 0.5
    """Adaptive clipping: the share of clients whose update the clip should not shrink."""
    clip_lr: float = 0.2
    """Adaptive clipping: the learning rate of the clip estimate's geometric update."""
    clip_count_stddev: float = -1.0
    """Adaptive clipping: sigma_b on the clipped counts; -1: report_goal / 20."""
    noise_seed: int = -1
    """-1: secret noise from a fresh 256-bit key per run. >= 0: research mode, the noise key is
    derived from this seed and the guarantee does not hold against anyone who knows it."""
    noise: str = "auto"
    """Where the noise goes. "discrete": a discrete Gaussian (banded / blt: their Gaussian rounded
    to integers) added to secure aggregation's integer ring sum before decoding (needs
    aggregation.kind = "secagg"), so one device moves the released ring value by at most its bound
    even when a dishonest co-participant parks the sum at the ring's wrap. "gaussian": continuous
    noise on the decoded sum (with secagg: private only against honest participants). "auto":
    "discrete" with secagg and noise_multiplier > 0, else "gaussian" (config.toml of a run holds
    the resolved value)."""
    mechanism: str = "tree"
    """The DP-FTRL noise: "tree" (online binary tree), or a matrix factorization optimised at run
    start for the enforced participation: "banded" (BandMF) | "blt" (buffered linear Toeplitz);
    "independent": fresh noise each round (the DP-SGD-style baseline); "auto": the planner's
    pick (least model noise at target_epsilon)."""
    auto_plugins: bool = False
    """mechanism = "auto" also weighs installed plugin mechanisms (entry point group
    dpfleet.mechanisms); false: only the mechanisms dpfleet ships. A plugin's sensitivity is
    declared, not verified by dpfleet: the run says so in its caveats, and its z is planned to
    meet target_epsilon as such a run is accounted (by RDP)."""
    target_epsilon: float = 0.0
    """> 0: the planner chooses report_goal, noise_multiplier, [participation] (uniform, largest
    MinS, worst-case MaxP) and, with mechanism = "auto", the mechanism for this eps at delta over
    `rounds` and the training population (plan.json). A planned key the config also states must
    agree with the plan. 0: no plan, you choose them."""


@dataclass(frozen=True)
class ProjectionSection:
    """A projection to a production-size population (pfl-research's method): the run trains
    dp.report_goal devices a round but adds the noise of a planned cohort over a planned
    population, so a laptop estimates a launch's accuracy. Its projected eps is a simulation of
    DP, not a guarantee; the run's own guarantee is stated beside it. Both 0: no projection."""

    noise_cohort: int = 0
    """M_noise: the planned report goal whose noise the average carries (std z C / M_noise): the
    sum of the report_goal trained devices gets noise z C report_goal / M_noise."""
    population: int = 0
    """The planned population the projected eps is accounted over (MinS = population //
    noise_cohort - 1, as the planner's, unless min_separation is given)."""
    min_separation: int = -1
    """The planned launch's MinS: -1, population // noise_cohort - 1 (the largest the population
    allows, `dpfleet plan -N`); else the MinS a plan over an availability trace enforces
    (`dpfleet plan --trace`: its timer, not the population, sets it)."""
    max_participation: int = 0
    """The planned launch's MaxP cap: 0, the worst case its MinS allows over the rounds; else the
    cap a plan over an availability trace enforces (the lower of the two is accounted)."""


@dataclass(frozen=True)
class ParticipationSection:
    """The coordinator's rules of who takes part when (see coordinator/engine/participation.py);
    how the devices behave is `[devices]`."""

    mode: str = "disjoint"
    """"disjoint" (each device at most once) | "uniform" (any eligible device each round) |
    "timer" (a device checks in when available and its timer since the last round ran out)."""
    timer_period: float = 24.0
    """Timer mode: hours a device stays away after taking part (at most a year, 8760)."""
    round_minutes: float = 10.0
    """Simulated duration of a round, and of a retry when too few devices check in; between 1/60
    (a second) and 525600 (a year)."""
    min_separation: int = -1
    """MinS: the coordinator refuses a device with fewer rounds strictly between two
    participations (-1: what the timer nominally gives, ceil(timer_period / round duration) - 1;
    0 otherwise)."""
    max_participation: int = 0
    """MaxP: the coordinator refuses a device past this many rounds; 0: no cap."""
    over_selection: float = 1.0
    """Timer mode: the coordinator selects ceil(over_selection x report_goal) of the devices that
    checked in (all of them if fewer; at least the report goal must check in), so that drops and
    stragglers still leave the goal (Bonawitz et al. 2019). 1: exactly the report goal."""
    deadline_minutes: float = 0.0
    """Timer mode: the round closes at the report goal (the first report_goal finishers are summed,
    later ones are told to stop) or at this many minutes after it opened, whichever comes first;
    at most round_minutes. 0: no deadline (every selected device that does not drop reports)."""
    min_reports: int = 0
    """Timer mode: a round with fewer reports than this at its close is abandoned and retried in
    the next slot (the selected devices' timers start all the same); at most the report goal.
    0: any round with one report commits."""


@dataclass(frozen=True)
class PretrainSection:
    """Central training on public text before the first private round (public/public_init.py):
    public data only, so no privacy cost; refused when a corpus overlaps the private dataset."""

    corpus: list[str] = field(default_factory=list)
    """Public corpora to train on, e.g. ["kjv"] or ["wikitext2", "kjv"]; empty: no pretraining."""
    steps: int = 0
    """Adam steps on the public rows (the result is cached in $DPFLEET_CACHE/pretrain)."""
    batch_size: int = 32
    """Public rows per step."""
    lr: float = 3e-3
    """Adam's learning rate."""
    seed: int = 0
    """The public model's init and batches (shared by every seed of the private run)."""


@dataclass(frozen=True)
class AggregationSection:
    """How a round's clipped updates are summed: in the clear, or by secure aggregation."""

    kind: str = "plain"
    """"plain" | "secagg" (pairwise-mask secure aggregation: the server sees only the sum)."""
    bits: int = 32
    """SecAgg: the ring Z_(2^bits), 1..32 bits."""
    graph: str = "harary"
    """SecAgg: the masking graph, "harary" (SecAgg+) | "complete" (SecAgg)."""
    signed: bool = False
    """SecAgg: malicious-server mode (signatures, consistency checks, pinned keys)."""
    corruption: float = 0.05
    """SecAgg threat model: the fraction of colluding clients the threshold must beat."""
    fleet_keys: str = ""
    """SecAgg signed mode: the fleet key file of the devices' identity keys."""


@dataclass(frozen=True)
class BackendSection:
    """Where a round's clients train (coordinator/engine/ray_backend.py)."""

    kind: str = "local"
    """"local" | "ray" (a round's cohort sharded over Ray workers; the `ray` extra)."""
    address: str = ""
    """The Ray cluster's address (`ray start --head`); "": a private local instance."""
    workers: int = 2
    """Ray actors, one CPU each."""


@dataclass(frozen=True)
class FleetSection:
    """How the emulated devices train (`dpfleet fleet emulate`); how they behave is `[devices]`."""

    client: str = "dpfleet"
    """"dpfleet": devices train with dpfleet's own runtime; "bundle": the coordinator publishes
    one signed phone bundle per run and devices train with its reference client."""


@dataclass(frozen=True)
class ServiceSection:
    """The networked coordinator (`dpfleet service serve`, edge/wire/PROTOCOL.md)."""

    time_scale: float = 1.0
    """Simulated seconds per wall second, shared with the devices."""
    overselect: float = 0.0
    """Assign ceil(report_goal * (1 + overselect)) devices per round."""
    report_deadline_s: float = 120.0
    """Wall seconds from assignment to the last accepted report."""
    secagg_phase_deadline_s: float = 30.0
    """Wall seconds per SecAgg phase before the phase closes with whoever answered."""
    checkin_retry_s: float = 1.0
    """The "come back after" a device is told when no round has room."""
    checkin_window_s: float = 2.0
    """Wait this long for over-selection before opening a round with fewer devices."""
    max_body_mb: float = 64.0
    """Request bodies above this are refused (413)."""
    rate_per_s: float = 50.0
    """Per-device requests per second (token bucket; 429 beyond)."""
    rate_burst: int = 100
    """The token bucket's size: requests a device may send at once."""


def main_job_model() -> ModelConfig:
    """The config's default `[model]`: the main job's CIFG (81k parameters at 1,024 tokens), sized
    for 2 laptop cores. `ModelConfig()` itself stays Gboard's size, for exports of a model alone."""
    return ModelConfig(vocab_size=TokenizerSection.vocab_size, embedding_dim=32, hidden_dim=64,
                       projection_dim=32)


@dataclass(frozen=True)
class SimulationConfig:
    """A run's config: the top-level keys, then one table per section.

    One source of defaults: a key a TOML file or a dict leaves out gets the value here, which is
    the main job's (examples/shakespeare_cifg.toml) except the choices that job states on top
    (`MAIN_JOB_CHOICES`). The docs' config reference is generated from these dataclasses."""

    rounds: int = 20
    """DP-FTRL rounds."""
    debug_nonprivate: bool = False
    """Also write un-noised client telemetry (train loss, update norms, clipped fraction) to
    debug_nonprivate.jsonl: outside the DP guarantee, for debugging only."""
    tensorboard: bool = False
    """Also write each round's metrics record (DP quantities, held-out evaluation) as TensorBoard
    scalars to RUN_DIR/tensorboard/ as the run goes (pip install 'dpfleet[tensorboard]')."""
    wandb: bool = False
    """Also log each round's metrics record to Weights & Biases as the run goes: offline in
    RUN_DIR/wandb/ unless WANDB_MODE=online (pip install 'dpfleet[wandb]')."""
    mlflow: bool = False
    """Also log each round's metrics record to MLflow as the run goes, in MLflow's tracking store
    (MLFLOW_TRACKING_URI, else sqlite:///mlflow.db; pip install 'dpfleet[mlflow]')."""
    eval_every: int = 10
    """Rounds between held-out evaluations (the last round is always evaluated)."""
    seed: int = 0
    """Client selection, batching and the initial model; never the DP noise (dp.noise_seed)."""
    checkpoint_every: int = 10
    """Rounds between resume points (`dpfleet simulate --resume RUN_DIR`); 0: none."""
    data: DataSection = field(default_factory=DataSection)
    """The private users' text."""
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    """The vocabulary."""
    model: ModelConfig = field(default_factory=main_job_model)
    """The zoo model that is trained (unused when you pass your own module to `dpfleet.simulate`)."""
    client: ClientSection = field(default_factory=ClientSection)
    """A device's local training."""
    dp: DPSection = field(default_factory=DPSection)
    """DP-FTRL's clipping and noise, and the privacy target or budget."""
    participation: ParticipationSection = field(default_factory=ParticipationSection)
    """Who takes part in which round."""
    pretrain: PretrainSection = field(default_factory=PretrainSection)
    """Central training on public text before the first private round."""
    aggregation: AggregationSection = field(default_factory=AggregationSection)
    """How a round's updates are summed."""
    backend: BackendSection = field(default_factory=BackendSection)
    """Where a round's clients train."""
    devices: DevicesSection = field(default_factory=DevicesSection)
    """How the devices behave: availability, timer, speed, link, dropouts (simulate's timer mode
    and the emulated fleet)."""
    fleet: FleetSection = field(default_factory=FleetSection)
    """The emulated devices' runtime (`dpfleet fleet`)."""
    service: ServiceSection = field(default_factory=ServiceSection)
    """The networked coordinator (`dpfleet service serve`)."""
    projection: ProjectionSection = field(default_factory=ProjectionSection)
    """A projection to a planned cohort and population (a simulation of DP, not a guarantee)."""

    def resolved(self) -> dict:
        return dataclasses.asdict(self)


# What the main job (examples/shakespeare_cifg.toml) states on top of the defaults, and why. The
# config reference lists them, and tests/test_config_reference.py holds every other key the
# example states to its default.
MAIN_JOB_CHOICES: dict[str, str] = {
    "client.threads": "2 worker processes, for the 2-core machine its figures come from; the "
                      "default trains in one process on any machine",
    "dp.target_epsilon": "8: it states a privacy target and the planner chooses the report goal, "
                         "the noise and [participation]; without a target you set those yourself",
    "dp.mechanism": '"auto": the planner picks the mechanism, which needs a target',
    "pretrain.corpus": '["kjv"]: public pretraining (about 3 min on the first run, then cached); '
                       "off by default because it trains the zoo model on a corpus you name",
    "pretrain.steps": "3000, for pretrain.corpus",
}

# Config keys that name a file or folder. In a config file a relative one is read from the file's
# folder (the config and its data move together); in a dict or a --set value, from the working
# folder.
PATH_KEYS = (("data", "path"), ("tokenizer", "path"), ("tokenizer", "word_counts"), ("tokenizer", "words"),
             ("aggregation", "fleet_keys"), ("devices", "trace"))


_CHOICES = {
    "tokenizer.kind": ("sentencepiece", "word", "char"),
    "tokenizer.split": ("tff", "words"),
    "client.runtime": ("eager", "executorch", "onnx"),
    "client.trainer": ("auto", "sequential", "cohort"),
    "client.device": ("auto", "cpu", "cuda"),
    "client.precision": ("auto", "float32", "bfloat16"),
    "backend.kind": ("local", "ray"),
    "participation.mode": ("disjoint", "uniform", "timer"),
    "aggregation.kind": ("plain", "secagg"),
    "aggregation.graph": ("harary", "complete"),
    "dp.noise": ("auto", "gaussian", "discrete"),
    "fleet.client": ("dpfleet", "bundle"),
    "devices.failure_draws": ("round", "device"),
    "model.preset": ("", *PRESETS),
}

def key_choices(key: str) -> tuple | None:
    """A key's allowed values; dp.mechanism's are the registered mechanisms' (`registry`)."""
    if key == "dp.mechanism":
        from dpfleet.coordinator.mechanisms.registry import names

        return (*names(), "auto")
    return _CHOICES.get(key)


_MOVED = {"dp.sampling": "participation.mode",
          **{f"participation.{k}": f"devices.{k}" for k in ("availability", "diurnal_amplitude", "trace",
                                                           "train_minutes", "train_jitter")},
          **{f"fleet.{k}": f"devices.{k}" for k in (
              "charging_hours", "charging_start", "timezone_spread", "idle", "unmetered",
              "condition_minutes", "speed_sigma", "bandwidth_mbps", "latency_ms", "link_sigma",
              "dropout_download", "dropout_train", "dropout_report", "dropout_secagg")},
          "aggregation.dropout": "devices.dropout_secagg"}


def _check_type(key: str, value: object, annotation: object) -> object:
    """`value` as the key's type; a float must be finite (TOML and --set take inf and nan, which no
    setting means and which overflow a run's clock or noise rounds later), an int within int64."""
    base = typing.get_origin(annotation) or annotation
    if isinstance(annotation, str):
        base = {"int": int, "float": float, "str": str, "bool": bool}.get(annotation, object)
    if base is float and isinstance(value, int | float) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:  # an int beyond float range
            value = math.inf
        if not math.isfinite(value):
            raise DpfleetError(f"config key {key!r} must be a finite number, got {value}")
        return value
    if base is list and isinstance(value, list):
        return value
    if isinstance(base, type) and base is not object and not isinstance(value, base):
        raise DpfleetError(f"config key {key!r} must be {base.__name__}, got {value!r}")
    if base is int and isinstance(value, bool):
        raise DpfleetError(f"config key {key!r} must be int, got {value!r}")
    if base is int and not -(2 ** 63) < value < 2 ** 63:  # numpy's int64 holds every count a run makes
        raise DpfleetError(f"config key {key!r} must be an integer within +-2^63, got {value}")
    return value


def build_section(cls: type, values: dict, prefix: str, default: object | None = None) -> object:
    """`cls` from a table: every key checked (name, type, choices); the keys left out keep
    `default`'s values (default: `cls`'s own), so a nested section's defaults are its field's in
    the parent (the config's [model] is `main_job_model()`)."""
    if not isinstance(values, dict):
        raise DpfleetError(f"config section {prefix.rstrip('.')!r} must be a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if prefix + key in _MOVED:
            raise DpfleetError(f"config key '{prefix}{key}' moved to '{_MOVED[prefix + key]}'")
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            raise DpfleetError(f"invalid config key '{prefix}{key}'{hint}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = build_section(hint, value, f"{prefix}{key}.", _field_default(fields[key]))
        else:
            if isinstance(hint, types.UnionType):
                hint = typing.get_args(hint)[0]
            kwargs[key] = _check_type(prefix + key, value, hint)
            choices = key_choices(prefix + key)
            if choices and value not in choices:
                raise DpfleetError(f"config key '{prefix}{key}' must be one of {choices}")
    return cls(**kwargs) if default is None else dataclasses.replace(default, **kwargs)


def _field_default(f: dataclasses.Field) -> object | None:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def paths_against(values: dict, folder: Path) -> dict:
    """Raw config values with each relative `PATH_KEYS` value made absolute against `folder`."""
    out = dict(values)
    for section, key in PATH_KEYS:
        table = out.get(section)
        if isinstance(table, dict) and isinstance(table.get(key), str) and table[key]:
            out[section] = {**table, key: os.path.abspath(folder / Path(table[key]).expanduser())}
    return out


# the keys dp.target_epsilon plans (coordinator/run_privacy/config_plan.py), as (section, key)
PLANNED_KEYS = (("dp", "report_goal"), ("dp", "noise_multiplier"), ("dp", "mechanism"),
                ("participation", "mode"), ("participation", "min_separation"),
                ("participation", "max_participation"))


def given_planned_keys(values: dict) -> dict[str, object]:
    """The planned keys a raw config dict states itself ("dp.report_goal" -> value)."""
    out = {}
    for section, key in PLANNED_KEYS:
        table = values.get(section)
        if isinstance(table, dict) and key in table:
            out[f"{section}.{key}"] = table[key]
    return out


def split_binding(values: dict) -> tuple[dict, dict | None]:
    """Raw config values without a run's mechanism binding, and the binding (None: none).

    A run's config.json carries its mechanism's binding ({name, sha256}): not a setting, a pin the
    run checks its mechanism against (`mechanism_binding.run_mechanism`), so it is kept beside the
    config (`config_plan.RunPlan`), never in it."""
    binding = values.get("mechanism") if isinstance(values, dict) else None
    if binding is None:
        return values, None
    if not (isinstance(binding, dict) and set(binding) == {"name", "sha256"}):
        raise DpfleetError("config key 'mechanism' is a run's binding {name, sha256} (config.json); "
                           "choose a mechanism with dp.mechanism")
    return {k: v for k, v in values.items() if k != "mechanism"}, binding


def parse_config(values: dict) -> SimulationConfig:
    """The checked, frozen config of raw `values` (a run's config.json parses too: its mechanism
    binding is read by `config_plan.read_run_config`), with `dp.noise = "auto"` resolved."""
    values, _ = split_binding(values)
    if isinstance(values, dict) and isinstance(values.get("model"), dict):
        values = {**values, "model": with_preset(values["model"])}
    cfg = build_section(SimulationConfig, values, "")
    cfg = with_values(cfg, {"dp.noise": resolve_noise(cfg)})
    validate(cfg)
    return cfg


def resolve_noise(cfg: SimulationConfig) -> str:
    """The run's tree noise, "discrete" or "gaussian" (`dp.noise = "auto"` resolved).

    Why discrete by default with secure aggregation: nobody range-checks a device's masked
    input, so a dishonest co-participant can park the ring sum at the signed wrap, where one
    honest device's small update flips the *decoded* sum by ~2^bits / scale. Noise added after
    decoding is then calibrated for the wrong sensitivity; noise added in the ring is not (the
    ring value moves by at most Delta_s, tests/test_ring_wrap_attack.py). With z = 0 there is
    no noise to place, and the plain path has no ring."""
    noise = cfg.dp.noise
    if noise == "auto":
        secagg = cfg.aggregation.kind == "secagg" and cfg.dp.noise_multiplier > 0
        return "discrete" if secagg else "gaussian"
    return noise


def honest_participants_only(cfg: SimulationConfig) -> bool:
    """Continuous noise after decoding a SecAgg sum (explicit `dp.noise = "gaussian"`): the DP
    guarantee then holds only if every participant is honest (module docstring of ring_noise)."""
    return (cfg.aggregation.kind == "secagg" and resolve_noise(cfg) == "gaussian"
            and cfg.dp.noise_multiplier > 0)


def read_toml(path: Path, what: str = "config file") -> dict:
    """A TOML file's values; a missing file or bad TOML is one clear DpfleetError."""
    path = Path(path)
    if not path.is_file():
        raise DpfleetError(f"{what} not found: {path}")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise DpfleetError(f"{path}: invalid TOML ({exc})") from exc


def config_values(path: Path, overrides: Mapping[str, object] | None = None,
                  python: bool = False) -> dict:
    """The raw values of the config file at `path`, with the command line's `--set` overrides
    ("section.key" -> value, `config_overrides`) applied. The file's relative `PATH_KEYS` are read
    from its folder (made absolute, so the run directory's config.toml still finds them).
    `python`: the overrides came from Python (`apply_overrides`)."""
    values = paths_against(read_toml(path), Path(path).parent)
    if overrides:
        values = apply_overrides(values, overrides, SimulationConfig, python)
    return values


def load_config(path: Path, overrides: Mapping[str, object] | None = None,
                python: bool = False) -> SimulationConfig:
    """The config file at `path` with `overrides` (`config_values`), parsed and validated."""
    return parse_config(config_values(path, overrides, python))


YEAR_MINUTES = 525_600  # the longest round or device timer a config may state

# the config's tracker switches and the package (and dpfleet extra) each needs: the trackers'
# own table (`state.trackers.WRITERS`, which opens them) is built from this one, so the config
# refuses a missing package without importing the trackers
TRACKER_PACKAGES = {"tensorboard": ("tensorboardX", "tensorboard"), "wandb": ("wandb", "wandb"),
                    "mlflow": ("mlflow", "mlflow")}


def missing_extras(cfg: object) -> list[str]:
    """One line per tracker the config asks for whose package is not installed, with its install."""
    return [f"{key} = true needs {module}: pip install 'dpfleet[{extra}]'"
            for key, (module, extra) in TRACKER_PACKAGES.items()
            if getattr(cfg, key, False) and importlib.util.find_spec(module) is None]


def validate(cfg: SimulationConfig) -> None:
    """Refuse a config that no run could mean, with one line naming the key (the first failing
    check). Why once, at parse: a config is frozen, so the checked config is the one that runs;
    code that makes a new one (the planner's keys) validates that one."""
    checks = [
        *run_checks(cfg),
        *data_checks(cfg),
        *dp_checks(cfg),
        *aggregation_checks(cfg.aggregation),
        *participation_checks(cfg.participation),
        *service_checks(cfg.service),
        *mechanism_checks(cfg),
        *devices_checks(cfg.devices),
        *projection_checks(cfg),
        *trace_checks(cfg.participation, cfg.devices),
        *round_close_checks(cfg.participation, cfg.devices, cfg.dp.report_goal),
    ]
    for ok, message in checks:
        if not ok:
            raise DpfleetError(message)
    if cfg.dp.adaptive_clipping:  # fails early when sigma_b leaves no room for z (App. A)
        model_noise_multiplier(cfg.dp.noise_multiplier, clip_count_stddev(cfg))


def run_checks(cfg: SimulationConfig) -> list[tuple[bool, str]]:
    """The run's own keys, its trackers' packages, and where and how its clients train."""
    return [
        (cfg.rounds >= 1, "rounds must be >= 1"),
        *((False, line) for line in missing_extras(cfg)),  # a tracker whose package is missing
        (cfg.eval_every >= 1, "eval_every must be >= 1"),
        (cfg.checkpoint_every >= 0, "checkpoint_every must be >= 0 (0: no resume points)"),
        (cfg.client.lr > 0, "client.lr must be > 0"),
        (cfg.client.batch_size >= 1, "client.batch_size must be >= 1"),
        (cfg.client.cohort_memory_mb >= 1, "client.cohort_memory_mb must be >= 1"),
        (cfg.backend.workers >= 1, "backend.workers must be >= 1"),
        (cfg.pretrain.steps >= 0 and cfg.pretrain.batch_size >= 1 and cfg.pretrain.lr > 0,
         "pretrain.steps must be >= 0, pretrain.batch_size >= 1 and pretrain.lr > 0"),
        (not cfg.pretrain.corpus or cfg.pretrain.steps > 0,
         "pretrain.corpus is set but pretrain.steps = 0: give the steps, or remove the corpus"),
        (cfg.fleet.client != "bundle" or cfg.client.runtime in ("onnx", "executorch"),
         "fleet.client = 'bundle' trains the bundle's ONNX or ExecuTorch program: set "
         "client.runtime = 'onnx' or 'executorch'"),
    ]


def data_checks(cfg: SimulationConfig) -> list[tuple[bool, str]]:
    """The private data, the vocabulary (a word vocabulary from private data needs DP) and the
    model's context."""
    return [
        (cfg.data.keyboard_words >= 0, "data.keyboard_words must be >= 0 (0: no keyboard metrics)"),
        (cfg.data.generated_population >= 0, "data.generated_population must be >= 0 (0: off)"),
        (cfg.tokenizer.vocab_size >= 8, "tokenizer.vocab_size must be >= 8"),
        (cfg.tokenizer.dp_noise >= 0, "tokenizer.dp_noise must be >= 0"),
        (cfg.tokenizer.kind != "word" or cfg.tokenizer.path or cfg.tokenizer.dp_noise > 0
         or cfg.tokenizer.allow_nonprivate_vocabulary or public_words(cfg.tokenizer),
         "tokenizer.dp_noise = 0 would build the word vocabulary from the private clients without "
         "DP; set tokenizer.allow_nonprivate_vocabulary = true to accept that it is outside the "
         "guarantee"),
        (cfg.tokenizer.dp_words_per_user >= 1, "tokenizer.dp_words_per_user must be >= 1"),
        (cfg.tokenizer.oov_buckets >= 1, "tokenizer.oov_buckets must be >= 1"),
        (not (cfg.tokenizer.word_counts and cfg.tokenizer.words),
         "tokenizer.word_counts and tokenizer.words both name the public words; set one"),
        (cfg.tokenizer.kind == "word" or not public_words(cfg.tokenizer),
         "tokenizer.word_counts / tokenizer.words need tokenizer.kind = \"word\""),
        (0 < cfg.tokenizer.dp_delta < 1, "tokenizer.dp_delta must be in (0, 1)"),
        (cfg.model.max_length >= cfg.data.seq_len, "model.max_length must be >= data.seq_len"),
    ]


def dp_checks(cfg: SimulationConfig) -> list[tuple[bool, str]]:
    """DP-FTRL's clipping, noise, budget and plan keys, and where the noise goes (`dp.noise`)."""
    return [
        (cfg.dp.noise_multiplier >= 0, "dp.noise_multiplier must be >= 0"),
        (cfg.dp.clip_norm > 0, "dp.clip_norm must be > 0"),
        (cfg.dp.report_goal >= 1, "dp.report_goal must be >= 1"),
        (0 < cfg.dp.delta < 1, "dp.delta must be in (0, 1)"),
        (0 <= cfg.dp.momentum < 1, "dp.momentum must be in [0, 1)"),
        (cfg.dp.budget_epsilon >= 0, "dp.budget_epsilon must be >= 0 (0: no budget)"),
        (cfg.dp.warn_epsilon >= 0, "dp.warn_epsilon must be >= 0 (0: no warning)"),
        (not cfg.dp.budget_epsilon or cfg.dp.noise_multiplier > 0,
         "dp.budget_epsilon needs dp.noise_multiplier > 0"),
        (0 < cfg.dp.target_quantile < 1, "dp.target_quantile must be in (0, 1)"),
        (cfg.dp.clip_lr > 0, "dp.clip_lr must be > 0"),
        (cfg.dp.clip_count_stddev >= 0 or cfg.dp.clip_count_stddev == -1,
         "dp.clip_count_stddev must be >= 0 (or -1: report_goal / 20)"),
        (cfg.dp.noise_seed >= -1, "dp.noise_seed must be >= 0 (research mode) or -1 (secret noise)"),
        (resolve_noise(cfg) != "discrete" or cfg.aggregation.kind == "secagg",
         "dp.noise = 'discrete' requires aggregation.kind = 'secagg' (the integer noise is added "
         "to secure aggregation's ring sum)"),
        (resolve_noise(cfg) != "discrete" or cfg.dp.noise_multiplier > 0,
         "dp.noise = 'discrete' needs dp.noise_multiplier > 0"),
        (all(isinstance(r, int) and r >= 1 for r in cfg.dp.restart_rounds),
         "dp.restart_rounds must be rounds >= 1 (0-based rounds at which a fresh tree starts)"),
        (cfg.dp.target_epsilon >= 0, "dp.target_epsilon must be >= 0 (0: no plan)"),
        (cfg.dp.mechanism != "auto" or cfg.dp.target_epsilon > 0,
         "dp.mechanism = 'auto' is the planner's choice: it needs dp.target_epsilon > 0"),
    ]


def aggregation_checks(a: AggregationSection) -> list[tuple[bool, str]]:
    """Secure aggregation's ring and threat model."""
    return [
        (0 <= a.corruption < 0.5, "aggregation.corruption must be in [0, 0.5)"),
        (not a.fleet_keys or a.signed,
         "aggregation.fleet_keys needs aggregation.signed = true"),
        (1 <= a.bits <= 32, f"aggregation.bits must be in 1..32, got {a.bits}"),
    ]


def participation_checks(p: ParticipationSection) -> list[tuple[bool, str]]:
    """Who takes part when: the timer, the clock's round and the MinS / MaxP guard."""
    return [
        (0 <= p.timer_period <= YEAR_MINUTES / 60,
         f"participation.timer_period must be in [0, {YEAR_MINUTES // 60}] hours (a year), got "
         f"{p.timer_period:g}"),
        (not round_minutes_error(p.round_minutes),
         round_minutes_error(p.round_minutes)),
        (p.min_separation >= -1,
         "participation.min_separation must be >= 0 (or -1: the timer's)"),
        (p.max_participation >= 0,
         "participation.max_participation must be >= 0 (0: no cap)"),
    ]


def service_checks(s: ServiceSection) -> list[tuple[bool, str]]:
    """The networked coordinator's clock, over-selection, deadlines and rate limits."""
    return [
        (s.time_scale > 0, "service.time_scale must be > 0"),
        (s.overselect >= 0, "service.overselect must be >= 0"),
        (min(s.report_deadline_s, s.secagg_phase_deadline_s,
             s.checkin_retry_s, s.max_body_mb, s.rate_per_s) > 0
         and s.checkin_window_s >= 0 and s.rate_burst >= 1,
         "service deadlines, checkin_retry_s, max_body_mb, rate_per_s must be > 0 "
         "(checkin_window_s >= 0, rate_burst >= 1)"),
    ]


def mechanism_checks(cfg: SimulationConfig) -> list[tuple[bool, str]]:
    """What the config's mechanism cannot do (the engine checks a caller's object the same way,
    `mechanism_binding.check_supported`): only a mechanism with restarts takes dp.restart_rounds."""
    if cfg.dp.mechanism == "auto":  # auto picks only what the config supports
        return []
    from dpfleet.coordinator.mechanisms.registry import entry

    return [
        (entry(cfg.dp.mechanism).cls.supports_restarts or not cfg.dp.restart_rounds,
         f"dp.mechanism = '{cfg.dp.mechanism}' has no tree to restart: dp.restart_rounds must be empty"),
    ]


def projection_checks(cfg: SimulationConfig) -> list[tuple[bool, str]]:
    """What a `[projection]` needs. Refused with it: secure aggregation (its discrete noise is
    planned in ring units for the sum it protects, and it protects real devices, while a projection
    is a simulation whose noise is too small for its own devices), a dp.target_epsilon (the planner
    plans for the training population, not the planned one) and adaptive clipping (its clipped-count
    noise is not projected)."""
    proj, dp = cfg.projection, cfg.dp
    if not (proj.noise_cohort or proj.population):
        return []
    return [
        (proj.noise_cohort > 0 and proj.population > 0,
         "projection.noise_cohort and projection.population go together (both 0: no projection)"),
        (proj.noise_cohort >= dp.report_goal,
         f"projection.noise_cohort = {proj.noise_cohort} must be >= dp.report_goal = {dp.report_goal} "
         "(a projection adds the noise of a larger cohort than it trains)"),
        (proj.population >= proj.noise_cohort,
         f"projection.population = {proj.population} must be >= projection.noise_cohort = "
         f"{proj.noise_cohort}"),
        (proj.min_separation >= -1, f"projection.min_separation = {proj.min_separation} must be "
         ">= 0, or -1 (population // noise_cohort - 1)"),
        (not _projection_returns(cfg) or (proj.min_separation + 1) * proj.noise_cohort <= proj.population,
         f"projection.min_separation = {proj.min_separation} with devices taking part more than "
         f"once needs (MinS + 1) x noise_cohort <= population, but {proj.min_separation + 1} x "
         f"{proj.noise_cohort} > {proj.population}: no launch of that population keeps devices "
         "apart that long; lower it or cap projection.max_participation at 1"),
        (proj.max_participation >= 0,
         f"projection.max_participation = {proj.max_participation} must be >= 0 (0: the worst case)"),
        (proj.population <= 0 or dp.delta < 1 / proj.population,
         f"dp.delta = {dp.delta:g} is not below 1/N = 1/{proj.population} for projection.population: "
         "the projected guarantee would mean nothing at that delta; lower dp.delta"),
        (cfg.aggregation.kind == "plain",
         "a projection is a simulation of DP at a planned population: it runs with "
         "aggregation.kind = 'plain' only (secure aggregation protects real devices)"),
        (not dp.target_epsilon,
         "dp.target_epsilon plans for the training population, not the projected one: give "
         f"dp.noise_multiplier from `dpfleet plan -N {proj.population} -T {cfg.rounds} --report-goal "
         f"{proj.noise_cohort} --target-epsilon EPS`"),
        (not dp.adaptive_clipping,
         "a projection scales the model's noise only: it cannot run with dp.adaptive_clipping "
         "(whose clipped-count noise it would leave unprojected)"),
    ]


def _projection_returns(cfg: SimulationConfig) -> bool:
    """Whether a stated projection MinS lets a device take part twice in the planned rounds (a
    trace plan's timer may enforce a MinS its population could not keep for many rounds, and
    needs not when its rounds or cap leave every device at one participation)."""
    proj = cfg.projection
    return proj.min_separation >= 0 and capped_max_participation(
        cfg.rounds, proj.min_separation, proj.max_participation) > 1


def projection_factor(cfg: SimulationConfig) -> float:
    """M_train / M_noise, the one factor a projection scales the run's noise by (1: none): the
    sum of report_goal devices gets noise z C M_train / M_noise, so the released average
    carries std z C / M_noise, as if M_noise devices had contributed (pfl's `noise_scale`). The
    run's own noise multiplier on its actual sum is then z times this."""
    if not cfg.projection.noise_cohort:
        return 1.0
    return cfg.dp.report_goal / cfg.projection.noise_cohort
def trace_checks(p: ParticipationSection, d: DevicesSection) -> list[tuple[bool, str]]:
    """A replayed trace decides availability on its own, for `simulate` and the emulated fleet
    alike: in timer mode, with no Bernoulli draw nor charging window beside it, from a file whose
    header reads (its devices are read when the run starts)."""
    if not d.trace:
        return []
    checks = [
        (p.mode == "timer", f"devices.trace is replayed in timer mode: set participation.mode = "
                            f"'timer' (not {p.mode!r}) or remove the trace"),
        (d.availability == 1 and d.diurnal_amplitude == 0,
         "devices.trace and devices.availability / diurnal_amplitude both say when devices "
         "are available: keep the trace and remove availability and diurnal_amplitude, or remove the trace"),
        (not d.charging_model(),
         "devices.trace and devices.charging_hours / idle / unmetered both say when devices are "
         "available: keep the trace and remove those keys, or remove the trace"),
    ]
    if all(ok for ok, _ in checks):
        read_header(Path(d.trace))  # one error line when the file is missing or not a trace
    return checks


def round_close_checks(p: ParticipationSection, d: DevicesSection, report_goal: int
                       ) -> list[tuple[bool, str]]:
    """How a timer-mode round is over-selected and closed (`participation.Participation`): the
    keys mean something only on the simulated clock of timer mode, so elsewhere they must keep
    their defaults rather than be silently ignored."""
    finite = all(math.isfinite(x) for x in (p.over_selection, d.train_minutes, d.train_jitter,
                                              p.deadline_minutes))
    changed = [k for k, default in (("over_selection", 1.0), ("deadline_minutes", 0.0),
                                    ("min_reports", 0)) if getattr(p, k) != default]
    return [
        (finite, "participation.over_selection, deadline_minutes, devices.train_minutes and "
                 "train_jitter must be finite numbers"),
        (not finite or 1 <= p.over_selection <= 100,
         f"participation.over_selection must be in [1, 100], got {p.over_selection:g}"),
        (not finite or d.train_minutes > 0,
         f"devices.train_minutes must be > 0, got {d.train_minutes:g}"),
        (not finite or 0 <= d.train_jitter <= 3,
         f"devices.train_jitter must be in [0, 3], got {d.train_jitter:g}"),
        (not finite or 0 <= p.deadline_minutes <= p.round_minutes,
         f"participation.deadline_minutes must be in [0, round_minutes = {p.round_minutes:g}] "
         f"(0: no deadline), got {p.deadline_minutes:g}"),
        (0 <= p.min_reports <= report_goal,
         f"participation.min_reports must be in [0, dp.report_goal = {report_goal}], got {p.min_reports}"),
        (p.mode == "timer" or not changed,
         f"participation.{', '.join(changed)} close rounds on the simulated clock of timer mode: "
         f"set participation.mode = 'timer' (not {p.mode!r}) or remove them"),
    ]


def devices_checks(d: DevicesSection) -> list[tuple[bool, str]]:
    probabilities = ("idle", "unmetered", "dropout_download", "dropout_train", "dropout_report",
                     "dropout_secagg")
    return [
        (0 < d.availability <= 1, "devices.availability must be in (0, 1]"),
        (0 <= d.diurnal_amplitude <= 1, "devices.diurnal_amplitude must be in [0, 1]"),
        (0 < d.charging_hours <= 24, "devices.charging_hours must be in (0, 24]"),
        (0 <= d.charging_start < 24, "devices.charging_start must be an hour in [0, 24)"),
        (0 <= d.timezone_spread <= 24, "devices.timezone_spread must be in [0, 24] hours"),
        (d.condition_minutes > 0, "devices.condition_minutes must be > 0"),
        (d.speed_sigma >= 0 and d.link_sigma >= 0, "devices.speed_sigma and link_sigma must be >= 0"),
        (d.bandwidth_mbps > 0, "devices.bandwidth_mbps must be > 0"),
        (d.latency_ms >= 0, "devices.latency_ms must be >= 0"),
        *((0 <= getattr(d, k) <= 1, f"devices.{k} must be a probability in [0, 1]")
          for k in probabilities),
    ]


def check_delta(delta: float, population: int, name: str = "dp.delta") -> None:
    """Refuse delta >= 1/N for N users (`name`: the setting, for the message). Why refuse rather
    than warn: an (eps, delta) guarantee with delta >= 1/N is met by a mechanism that publishes
    one random user's data in the clear, so such a run is no privacy at all; the usual rule is
    delta well below 1/N."""
    if population > 0 and delta >= 1 / population:
        raise DpfleetError(f"{name} = {delta:g} is not below 1/N = 1/{population} for the run's "
                           f"{population} users: at that delta a run may publish one user's data "
                           f"and keep its promise; choose {name} well below 1/N (e.g. 1e-6)")


def round_minutes_error(minutes: float, name: str = "participation.round_minutes") -> str | None:
    """What is wrong with a round duration (None: nothing). The clock counts slots of it, so
    1e-300 minutes overflowed them; a second to a year covers any fleet."""
    if 1 / 60 <= minutes <= YEAR_MINUTES:
        return None
    return f"{name} must be between 1/60 (a second) and {YEAR_MINUTES} (a year), got {minutes:g}"


def round_size(cfg: SimulationConfig) -> int:
    """Devices assigned per round: the report goal plus `[service] overselect` (the most clients
    one sum can hold, which secure aggregation's encoding is sized for)."""
    return over_selected(cfg.dp.report_goal, cfg.service.overselect)


def over_selected(report_goal: int, extra: float) -> int:
    """The one over-selection rule of the service (`service.overselect` = extra) and of simulate's
    timer mode (`participation.over_selection` = 1 + extra): the report goal plus
    ceil(report_goal x extra) devices, where the float noise of 0.1 x 10 must not add 2."""
    return report_goal + math.ceil(report_goal * extra - 1e-9)


def clip_count_stddev(cfg: SimulationConfig) -> float:
    """sigma_b of adaptive clipping's clipped counts, with the paper's default m / 20."""
    if cfg.dp.clip_count_stddev == -1:
        return default_count_stddev(cfg.dp.report_goal)
    return cfg.dp.clip_count_stddev
