"""The Python API: federate your own model over your own users' text, with DP-FTRL.

One function, `simulate`, runs the same in-process simulation as `dpfleet simulate CONFIG` (the
CLI calls `dpfleet.coordinator.run.run`, which `simulate` calls too: one path, not two) and
returns a `Result`:

    import dpfleet

    users = {"alice": ["first text", "second text"], "bob": ["..."]}
    result = dpfleet.simulate("examples/shakespeare_cifg.toml", users=users, model=my_module)
    print(result.accuracy, result.epsilon)

What you may bring, each optional:

* `config`: a TOML file, or a dict with the same sections and keys (unknown keys are errors).
  A key either leaves out gets the same default, the main job's value (the docs' config
  reference lists every key); a relative path is read from the TOML file's folder, or for a dict
  from the working folder.
* `users`: your per-user text. It is split into training and held-out users, cut into rows and
  capped per user exactly as the built-in datasets are (`edge.client_data.build_federated`).
* `tokenizer`: anything with `encode(str) -> list[int]` and `vocab_size`. Ids 0-3 are the
  toolkit's PAD / BOS / EOS / UNK (PAD targets are not scored), so a tokenizer should not give
  real words those ids. Default: the config's tokenizer.
* `model`: any `torch.nn.Module` mapping int64 token ids [batch, time] to float logits
  [batch, time, vocab], as a tensor or as `.logits` (a Hugging Face causal LM as it is); other
  embeddings (learned positions, segments) are its own business: the vocabulary check looks at
  the embedding the token ids index. With client.trainer = "auto" (the default) or "sequential" it trains
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
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from torch import nn

from dpfleet.coordinator import run as coordinator_run
from dpfleet.coordinator.config import SimulationConfig, validate
from dpfleet.coordinator.config_overrides import apply_overrides
from dpfleet.coordinator.run import Result, TokenizerLike, fresh_run_dir, user_records  # noqa: F401
from dpfleet.coordinator.run_privacy.config_plan import load_run_config, read_run_config
from dpfleet.errors import DpfleetError, DpfleetWarning
from dpfleet.extensions import ClippingRule, LocalUpdate, Mechanism, ParticipationPolicy
from dpfleet.public.public_init import pretrain_on_public

__all__ = ["Result", "TokenizerLike", "run", "simulate"]


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
    noise: Mechanism | None = None,
    participation: ParticipationPolicy | None = None,
    overrides: Mapping[str, Any] | None = None,
    on_round: Callable[[dict], None] | None = None,
) -> Result:
    """Train a model with DP-FTRL over a simulated fleet and return its `Result`.

    A result that is not fully private, or that means nothing (a model at or below the unigram
    baseline, noise that drowns the updates), is also said as a `DpfleetWarning` through
    `warnings.warn`, one per line of `Result.privacy["caveats"]` and `Result.warnings`.

    Args:
        config: a TOML file's path, or a dict with the same sections and keys; keys left out
            get the defaults of `dpfleet.coordinator.config` (the main job's values).
        model: a `torch.nn.Module` from int64 token ids [batch, time] to logits [batch, time,
            vocab] (a tensor, or an output with `.logits`); default the config's `[model]`.
            Checked with one forward on a dummy batch before training; trained by the
            sequential trainer unless client.trainer = "cohort".
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
            (`dpfleet.extensions.Mechanism`); default the config's `dp.mechanism`.
        participation: your choice among the eligible devices
            (`dpfleet.extensions.ParticipationPolicy`, participation.mode = "uniform"); default
            the config's mode.
        overrides: config keys to change for this run, as the CLI's `--set`:
            {"dp.noise_multiplier": 2.0, "rounds": 5}; checked like the config's own keys.
        on_round: called with each round's metrics record (a dict: round, accuracy when
            evaluated, epsilon so far, ...) once the round is committed; an exception it raises
            stops the run after that round (resume it with `dpfleet simulate --resume`).

    Raises:
        DpfleetError: a bad config, users, tokenizer or model, named in one line.
    """
    if overrides is not None and not isinstance(overrides, Mapping):
        raise DpfleetError(f"overrides must be a dict of config keys, not {type(overrides).__name__}")
    if on_round is not None and not callable(on_round):
        raise DpfleetError(f"on_round must be callable, not {type(on_round).__name__}")
    if isinstance(config, Mapping):
        values = copy.deepcopy(dict(config))
        if overrides:
            values = apply_overrides(values, overrides, SimulationConfig, python=True)
        (cfg, plan), name = read_run_config(values), "python"
    elif isinstance(config, str | Path):
        (cfg, plan), name = load_run_config(Path(config), overrides, python=True), Path(config).stem
    else:
        raise DpfleetError(f"config must be a TOML path or a dict, not {type(config).__name__}")
    if run_dir is None:
        run_dir = fresh_run_dir(Path("runs") / name)
    result = run(cfg, Path(run_dir), model=model, users=users, tokenizer=tokenizer, progress=progress,
                 overwrite=overwrite, log=(print if progress else _quiet), client_update=client_update,
                 clipping=clipping, noise=noise, participation=participation, on_round=on_round,
                 plan=plan)
    for line in (*result.privacy.get("caveats", ()), *result.warnings):
        warnings.warn(line, DpfleetWarning, stacklevel=2)
    return result


def run(cfg: SimulationConfig, run_dir: Path, **options: Any) -> Result:
    """`simulate` for a parsed config: `dpfleet.coordinator.run.run` (what the CLI calls, with the
    same options: model, users, tokenizer, progress, overwrite, resume, log, audit and the four
    extension points), with the public pretraining step of `[pretrain]` handed to it. `cfg` is
    checked here once (one built as `SimulationConfig(...)` was never parsed); `plan=` takes what
    `read_run_config` read beside it (the planned keys it states, a config.json's mechanism pin)."""
    validate(cfg)
    options.setdefault("pretrain", pretrain_on_public)
    return coordinator_run.run(cfg, Path(run_dir), **options)


def _quiet(_: str) -> None:
    pass
