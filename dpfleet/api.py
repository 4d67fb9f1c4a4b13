"""The Python API: federate your own model over your own users' text, with DP-FTRL.

One function, `simulate`, runs the same in-process simulation as `dpfleet simulate CONFIG` (the
CLI calls `run`, which `simulate` calls too: one path, not two) and returns a `Result`:

    import dpfleet

    users = {"alice": ["first text", "second text"], "bob": ["..."]}
    result = dpfleet.simulate("examples/shakespeare_cifg.toml", users=users, model=my_module)
    print(result.accuracy, result.epsilon)

What you may bring, each optional:

* `config`: a TOML file, or a dict with the same sections and keys (unknown keys are errors).
* `users`: your per-user text. It is split into training and held-out users, cut into rows and
  capped per user exactly as the built-in datasets are (`edge.client_data.build_federated`).
* `tokenizer`: anything with `encode(str) -> list[int]` and `vocab_size`. Ids 0-3 are the
  toolkit's PAD / BOS / EOS / UNK (PAD targets are not scored), so a tokenizer should not give
  real words those ids. Default: the config's tokenizer.
* `model`: any `torch.nn.Module` mapping int64 token ids [batch, time] to float logits
  [batch, time, vocab]. With client.trainer = "auto" (the default) or "sequential" it trains
  through the sequential eager client trainer, the reference (summary.json notes the fallback
  from "auto"); "cohort" trains a round's clients at once with torch.func over your module,
  after one trial step (a module vmap cannot batch, e.g. one with random dropout, is an error).
  Exported runtimes (ExecuTorch / ONNX) and Ray are for the zoo's models. Default: the config's
  zoo model.

* `client_update`, `clipping`, `noise`, `participation`: your own local training, clipping rule,
  noise mechanism (with its declared accounting) and participation policy, each a typed protocol
  of `dpfleet.extensions`, checked where the guarantee depends on it. Default: the built-in ones,
  which implement the same protocols.

Mistakes in these inputs are one `DpfleetError` naming the problem, raised before training.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from torch import nn

from dpfleet.coordinator.config import SimulationConfig, load_config, parse_config, validate
from dpfleet.edge.datasets import TextRecord
from dpfleet.errors import DpfleetError
from dpfleet.extensions import ClippingRule, LocalUpdate, NoiseMechanism, ParticipationPolicy

__all__ = ["Result", "TokenizerLike", "run", "simulate"]


@runtime_checkable
class TokenizerLike(Protocol):
    """What `simulate` needs of a tokenizer."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Result:
    """A finished run. Every figure is also in the run directory (summary.json, privacy.json,
    metrics.jsonl), which stays the record; this is its summary in Python.

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
        metrics: one dict per round, as in metrics.jsonl.
        privacy: privacy.json: the accounting, mechanism and what is not covered.
        stopped_early: why the run ended before its planned rounds (a budget), or None.
        client_trainer: "cohort" or "sequential": which trainer ran the clients.
    """

    accuracy: float
    unigram_accuracy: float
    perplexity: float
    unigram_perplexity: float
    epsilon: float
    delta: float
    run_dir: Path
    model: nn.Module
    metrics: list[dict]
    privacy: dict
    stopped_early: str | None
    client_trainer: str


def simulate(
    config: str | Path | Mapping[str, Any],
    *,
    model: nn.Module | None = None,
    users: Mapping[str, Iterable[str]] | Iterable[tuple[str, str]] | None = None,
    tokenizer: TokenizerLike | None = None,
    progress: bool = True,
    run_dir: str | Path | None = None,
    overwrite: bool = False,
    client_update: LocalUpdate | None = None,
    clipping: ClippingRule | None = None,
    noise: NoiseMechanism | None = None,
    participation: ParticipationPolicy | None = None,
) -> Result:
    """Train a model with DP-FTRL over a simulated fleet and return its `Result`.

    Args:
        config: a TOML file's path, or a dict with the same sections and keys.
        model: a `torch.nn.Module` from int64 token ids [batch, time] to logits [batch, time,
            vocab]; default the config's `[model]`. Checked with one forward on a dummy batch
            before training; trained by the sequential trainer unless client.trainer = "cohort".
        users: a mapping user id -> that user's texts, or an iterable of (user id, text);
            default the config's `[data]` dataset.
        tokenizer: anything with `encode(str) -> list[int]` and `vocab_size`; default the
            config's `[tokenizer]`.
        progress: show a progress bar over rounds.
        run_dir: where the run directory goes; default `runs/<config name>` (or `runs/python`
            for a dict), with -2, -3, ... appended if that is taken.
        overwrite: reuse a non-empty `run_dir`.
        client_update: your local training (`dpfleet.extensions.LocalUpdate`); default one
            epoch of plain SGD (`LocalSGD`).
        clipping: your clipping rule (`dpfleet.extensions.ClippingRule`), checked every round
            against the bound; default the L2 clip.
        noise: your noise mechanism with its declared accounting
            (`dpfleet.extensions.NoiseMechanism`); default the config's `dp.mechanism`.
        participation: your choice among the eligible devices
            (`dpfleet.extensions.ParticipationPolicy`, participation.mode = "uniform"); default
            the config's mode.

    Raises:
        DpfleetError: a bad config, users, tokenizer or model, named in one line.
    """
    if isinstance(config, Mapping):
        cfg, name = parse_config(copy.deepcopy(dict(config))), "python"
    elif isinstance(config, str | Path):
        cfg, name = load_config(Path(config)), Path(config).stem
    else:
        raise DpfleetError(f"config must be a TOML path or a dict, not {type(config).__name__}")
    if run_dir is None:
        from dpfleet.coordinator.cli.simulate import _fresh_run_dir

        run_dir = _fresh_run_dir(Path("runs") / name)
    return run(cfg, Path(run_dir), model=model, users=users, tokenizer=tokenizer, progress=progress,
               overwrite=overwrite, log=(print if progress else _quiet), client_update=client_update,
               clipping=clipping, noise=noise, participation=participation)


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
    noise: NoiseMechanism | None = None,
    participation: ParticipationPolicy | None = None,
) -> Result:
    """`simulate` for a parsed config (what the CLI calls): checks the inputs, runs, and reads
    the `Result` off the run. `resume` continues an interrupted run directory. `audit`: `dpfleet
    audit`'s canaries (`coordinator.audit_run`), the same run with canary devices added. The
    four extension points (`dpfleet.extensions`) default to the built-in parts."""
    validate(cfg)
    if model is not None and not isinstance(model, nn.Module):
        raise DpfleetError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    records = None if users is None else user_records(users)
    tok = None if tokenizer is None else _UserTokenizer(tokenizer)
    from dpfleet.coordinator.engine.simulation import run_simulation

    out = run_simulation(cfg, run_dir, overwrite=overwrite, resume=resume, progress=progress, log=log,
                         records=records, model=model, tokenizer=tok, audit=audit,
                         extensions={"client_update": client_update, "clipping": clipping,
                                     "noise": noise, "participation": participation})
    summary = json.loads((out.run_dir / "summary.json").read_text())
    return Result(
        accuracy=out.final["accuracy"], unigram_accuracy=out.baseline["accuracy"],
        perplexity=out.final["perplexity"], unigram_perplexity=out.baseline["perplexity"],
        epsilon=out.privacy["epsilon"], delta=out.privacy["delta"], run_dir=out.run_dir,
        model=out.model, metrics=out.metrics, privacy=out.privacy, stopped_early=out.stopped_early,
        client_trainer=summary.get("client_trainer", ""),
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
    """A caller's tokenizer with what the run needs of it: a `kind` for the log and a `save` for
    the data fingerprint and the checkpoint (the caller's own `save` when it has one)."""

    kind = "custom"

    def __init__(self, tokenizer: object):
        if not callable(getattr(tokenizer, "encode", None)):
            raise DpfleetError(f"tokenizer {type(tokenizer).__name__} has no encode(str) -> list[int]")
        vocab = getattr(tokenizer, "vocab_size", None)
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 5:
            raise DpfleetError(f"tokenizer.vocab_size must be an int >= 5 (ids 0-3 are PAD / BOS / "
                               f"EOS / UNK), got {vocab!r}")
        self.inner, self.vocab_size = tokenizer, vocab

    def encode(self, text: str) -> list[int]:
        ids = self.inner.encode(text)
        if not all(isinstance(i, int) and i >= 0 for i in ids):
            raise DpfleetError(f"tokenizer.encode must give non-negative int ids; got {list(ids)[:8]!r}")
        return list(ids)

    def save(self, folder: Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if callable(getattr(self.inner, "save", None)):
            self.inner.save(folder)
        else:
            (folder / "tokenizer.json").write_text(json.dumps(
                {"kind": self.kind, "class": type(self.inner).__qualname__, "vocab_size": self.vocab_size}))
        return folder


def _quiet(_: str) -> None:
    pass
