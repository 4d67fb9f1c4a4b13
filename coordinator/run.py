"""One run of a parsed config, as the Python API and the command line both do it.

`run` checks the inputs, runs the in-process simulation (`engine.simulation.run_simulation`) and
reads the `Result` off the run directory. `dpfleet.simulate` (the front door, `dpfleet.api`)
and `dpfleet simulate` / `dpfleet audit` (`coordinator/cli/`) all call it: one path, not two.
It lives in the coordinator, not in `dpfleet.api`, because the coordinator's commands need it and
the coordinator must not import the front door (the layers: pyproject.toml `[tool.importlinter]`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import click
from torch import nn

from dpfleet.coordinator.config import SimulationConfig
from dpfleet.coordinator.engine.extensions import (
    ClippingRule,
    LocalUpdate,
    Mechanism,
    ParticipationPolicy,
)
from dpfleet.coordinator.engine.field_metrics import tff_figures
from dpfleet.coordinator.engine.simulation import Pretrain, run_simulation
from dpfleet.coordinator.result_methods import ResultMethods
from dpfleet.coordinator.run_privacy.config_plan import RunPlan
from dpfleet.coordinator.state.interrupts import sigterm_interrupts
from dpfleet.coordinator.state.release_log import RELEASES
from dpfleet.edge.datasets import TextRecord
from dpfleet.edge.tokenizer import load_tokenizer
from dpfleet.errors import DpfleetError
from dpfleet.io import private_mkdir, removed_on_failure
from dpfleet.jsonio import write_json

__all__ = ["Result", "TokenizerLike", "cli_pretrain", "fresh_run_dir", "released_any", "run",
           "user_records"]


@runtime_checkable
class TokenizerLike(Protocol):
    """What `simulate` needs of a tokenizer."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Result(ResultMethods):
    """A finished run. Every figure is also in the run directory (summary.json, privacy.json,
    metrics.jsonl), which stays the record; this is its summary in Python. Its model answers
    `suggest(text, k)` (keyboard words), `predict(text, k)` (next tokens with probabilities) and
    `probabilities(text)`, exports with `export(out, format)`, and `Result.load(run_dir)` reads a
    finished run back (`coordinator/result_methods.py`).

    Attributes:
        accuracy: held-out next-token accuracy of the final model (PAD and special targets unscored).
        unigram_accuracy: the same for the unigram baseline fitted on other held-out users.
        perplexity: held-out perplexity of the final model.
        unigram_perplexity: the baseline's.
        epsilon: user-level epsilon of all released models at `delta` (privacy.json; inf without
            noise or where it is no guarantee: `privacy["caveats"]` say why, first).
        delta: the config's dp.delta (with a DP word vocabulary, the total of both is in
            `privacy["total_with_vocabulary"]`).
        run_dir: the run directory.
        model: the trained module (yours, or the zoo's), holding the last released, noised weights.
        tokenizer: the run's tokenizer: yours, or the config's (SentencePiece or DP words).
        metrics: one dict per round, as in metrics.jsonl.
        privacy: privacy.json: the accounting, mechanism and what is not covered.
        stopped_early: why the run ended before its planned rounds (a budget), or None.
        client_trainer: "cohort" or "sequential": which trainer ran the clients.
        initial_accuracy: round 0: the starting model's held-out accuracy (the config's init or the
            model passed in, after public pretraining if any; no privacy cost), None if not evaluated.
        initial_perplexity: the starting model's held-out perplexity.
        warnings: one line for each way the result means nothing (summary.json's `warnings`,
            `coordinator/run_privacy/result_warnings.py`): a model at or below the unigram baseline,
            eps above dp.warn_epsilon, noise that drowns every update; () when there is none.
        keyboard: the final model's suggestion strip on held-out words (summary.json's `keyboard`:
            top-1 / top-3 recall and keystroke savings, next to the most-frequent-word strip's),
            None when not scored (a tokenizer without `decode`, data.keyboard_words = 0).
        tff: TFF's three next-word accuracies (`accuracy`, `accuracy_without_out_of_vocab`,
            `accuracy_without_out_of_vocab_or_end_of_sentence`) of the final model, the unigram
            baseline and the most-frequent-word baseline: {"model" | "unigram" |
            "most_frequent_word": {name: value}}, a value None where the run has none.
    """

    accuracy: float
    unigram_accuracy: float
    perplexity: float
    unigram_perplexity: float
    epsilon: float
    delta: float
    run_dir: Path
    model: nn.Module
    tokenizer: Any
    metrics: list[dict]
    privacy: dict
    stopped_early: str | None
    client_trainer: str
    warnings: tuple[str, ...] = ()
    initial_accuracy: float | None = None
    initial_perplexity: float | None = None
    keyboard: dict | None = None
    tff: dict | None = None


def run(
    cfg: SimulationConfig,
    run_dir: Path,
    *,
    model: nn.Module | None = None,
    users: Mapping[str, Iterable[str]] | Iterable[tuple[str, str]] | None = None,
    tokenizer: TokenizerLike | None = None,
    progress: bool = True,
    overwrite: bool = False,
    resume: bool = False,
    log: Callable[[str], None] = print,
    audit=None,
    client_update: LocalUpdate | None = None,
    clipping: ClippingRule | None = None,
    noise: Mechanism | None = None,
    participation: ParticipationPolicy | None = None,
    pretrain: Pretrain | None = None,
    on_round: Callable[[dict], None] | None = None,
    plan: RunPlan | None = None,
) -> Result:
    """`simulate` for a parsed config (what the CLI calls): checks the inputs, runs, and reads
    the `Result` off the run. `resume` continues an interrupted run directory. `audit`: `dpfleet
    audit`'s canaries (`coordinator.audit_run`), the same run with canary devices added. The
    four extension points (`dpfleet.extensions`) default to the built-in parts. `pretrain`: the
    public pretraining step of a config with `[pretrain]` (`run_simulation`), handed down by the
    front door (`dpfleet.api`, `dpfleet.cli`): the coordinator does not import `dpfleet.public`.
    `on_round(record)`: each committed round's metrics record (a copy), as it commits. `cfg` is
    parsed, so checked (`config.parse_config`); `plan`: what it states beside its settings
    (`config_plan.read_run_config`: the planned keys it states, a config.json's mechanism pin)."""
    if model is not None and not isinstance(model, nn.Module):
        raise DpfleetError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    records = None if users is None else user_records(users)
    tok = None if tokenizer is None else _UserTokenizer(tokenizer)

    # a new run that fails before its first release (a config its data cannot satisfy, Ctrl-C
    # or SIGTERM while loading) leaves no half-written run directory behind: the rerun can use
    # the same one
    with sigterm_interrupts(), (nullcontext() if resume else
                                removed_on_failure(run_dir, kept=lambda: released_any(run_dir))):
        out = run_simulation(cfg, run_dir, overwrite=overwrite, resume=resume, progress=progress,
                             log=log, records=records, model=model, tokenizer=tok, audit=audit,
                             extensions={"client_update": client_update, "clipping": clipping,
                                         "noise": noise, "participation": participation},
                             pretrain=pretrain, on_round=on_round, plan=plan)
    summary = json.loads((out.run_dir / "summary.json").read_text())
    return Result(
        accuracy=out.final["accuracy"], unigram_accuracy=out.baseline["accuracy"],
        perplexity=out.final["perplexity"], unigram_perplexity=out.baseline["perplexity"],
        epsilon=out.privacy["epsilon"], delta=out.privacy["delta"], run_dir=out.run_dir,
        model=out.model, metrics=out.metrics, privacy=out.privacy, stopped_early=out.stopped_early,
        tokenizer=tokenizer or load_tokenizer(out.run_dir / "checkpoint" / "tokenizer"),
        client_trainer=summary.get("client_trainer", ""), warnings=tuple(summary.get("warnings", ())),
        initial_accuracy=(summary.get("initial") or {}).get("accuracy"),
        initial_perplexity=(summary.get("initial") or {}).get("perplexity"),
        keyboard=summary.get("keyboard"), tff=tff_figures(out.final, out.baseline),
    )


def user_records(users: object) -> list[TextRecord]:
    """`users` (a mapping user -> texts, or (user, text) pairs) as the records a dataset loader
    gives, so they take the built-in datasets' split and row path. Every user needs some text."""
    if isinstance(users, str | bytes) or not isinstance(users, Mapping | Iterable):
        raise DpfleetError("users must be a mapping user id -> list of texts, or an iterable of "
                           f"(user_id, text) pairs, not {type(users).__name__}")
    if isinstance(users, Mapping):
        by_user: dict[str, list] = {}
        for user, texts in users.items():
            if isinstance(texts, str) or not isinstance(texts, Iterable):
                raise DpfleetError(f"users[{user!r}] must be a list of texts, not {type(texts).__name__}")
            by_user[str(user)] = list(texts)
    else:
        by_user = {}
        for item in users:
            if not isinstance(item, tuple | list) or len(item) != 2:
                raise DpfleetError(f"users as an iterable must give (user_id, text) pairs; got {item!r:.60}")
            by_user.setdefault(str(item[0]), []).append(item[1])
    if not by_user:
        raise DpfleetError("users is empty: give at least one user with text")
    records = []
    for user, texts in by_user.items():
        bad = next((t for t in texts if not isinstance(t, str)), None)
        if bad is not None:
            raise DpfleetError(f"user {user!r}: texts must be str, got {type(bad).__name__}")
        if not any(t.strip() for t in texts):
            raise DpfleetError(f"user {user!r} has no text")
        records.extend(TextRecord(user, t, "python") for t in texts if t.strip())
    return records


class _UserTokenizer:
    """A caller's tokenizer with what the run needs of it: a `kind` for the log, a `save` for
    the data fingerprint and the checkpoint (the caller's own `save` when it has one), and its
    `decode` and `lexicon` when it has them."""

    kind = "custom"

    def __init__(self, tokenizer: object):
        if not callable(getattr(tokenizer, "encode", None)):
            raise DpfleetError(f"tokenizer {type(tokenizer).__name__} has no encode(str) -> list[int]")
        vocab = getattr(tokenizer, "vocab_size", None)
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 5:
            raise DpfleetError(f"tokenizer.vocab_size must be an int >= 5 (ids 0-3 are PAD / BOS / "
                               f"EOS / UNK), got {vocab!r}")
        self.inner, self.vocab_size = tokenizer, vocab
        # what `suggest` needs, for the keyboard figures of the run's end (`keyboard_eval`): the
        # caller's decode and word list, as the Result's own `suggest` uses them
        if callable(getattr(tokenizer, "decode", None)):
            self.decode = tokenizer.decode
        self.lexicon = getattr(tokenizer, "lexicon", None)

    def encode(self, text: str) -> list[int]:
        ids = self.inner.encode(text)
        if not all(isinstance(i, int) and i >= 0 for i in ids):
            raise DpfleetError(f"tokenizer.encode must give non-negative int ids; got {list(ids)[:8]!r}")
        return list(ids)

    def save(self, folder: Path) -> Path:
        folder = Path(folder)
        private_mkdir(folder)
        if callable(getattr(self.inner, "save", None)):
            self.inner.save(folder)
        else:
            write_json(folder / "tokenizer.json", {"kind": self.kind, "class": type(self.inner).__qualname__,
                                                   "vocab_size": self.vocab_size})
        return folder


def fresh_run_dir(base: Path) -> Path:
    """runs/NAME, or the first runs/NAME-N that is free: a rerun never overwrites a result."""
    candidate, n = base, 1
    while candidate.exists() and any(candidate.iterdir()):
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def released_any(run_dir: Path) -> bool:
    """Whether a run directory's release log holds a round: from then on it is a run to resume
    (`--resume`), never removed."""
    log = Path(run_dir) / RELEASES
    return log.is_file() and log.stat().st_size > 0


def cli_pretrain() -> Pretrain | None:
    """The public pretraining step the front door (`dpfleet.cli`) hands the commands in its click
    context (`obj["pretrain"]`); None when a command is invoked on its own, without it."""
    ctx = click.get_current_context(silent=True)
    obj = ctx.find_root().obj if ctx is not None else None
    return obj.get("pretrain") if isinstance(obj, dict) else None
