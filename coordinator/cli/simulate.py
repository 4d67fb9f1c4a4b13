"""`dpfleet simulate CONFIG`: run a DP-FTRL federated simulation from a TOML config."""

from __future__ import annotations

from pathlib import Path

import click

from dpfleet.coordinator.config_overrides import set_option


@click.command()
@click.argument("config", type=click.Path(path_type=Path), required=False)
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Run directory (default: runs/<config name>, or -2, -3, ... if that is taken).")
@click.option("--overwrite", is_flag=True, help="Reuse a non-empty run directory.")
@click.option("--rounds", type=int, default=None, help="Override the config's number of rounds.")
@click.option("--seed", type=int, default=None, help="Override the config's seed.")
@set_option
@click.option("--resume", type=click.Path(path_type=Path), default=None, metavar="RUN_DIR",
              help="Continue an interrupted run from its last resume point (no CONFIG needed).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--debug-nonprivate", is_flag=True,
              help="Also write un-noised client telemetry (train loss, update norms, clipped "
                   "fraction) to debug_nonprivate.jsonl: NOT covered by the DP guarantee "
                   "(same as the config key debug_nonprivate = true).")
def simulate(config: Path | None, out: Path | None, overwrite: bool, rounds: int | None,
             seed: int | None, overrides: tuple[str, ...], resume: Path | None, quiet: bool,
             debug_nonprivate: bool) -> None:
    """Simulate private federated training of an on-device LM.

    Reads CONFIG (TOML: `dpfleet init` writes the main job's; every key, its default and
    meaning: the docs' config reference; relative paths are read from CONFIG's folder), builds the clients
    from the dataset, trains with DP-FTRL (tree noise, clipping, momentum) and writes a run
    directory: config.toml, metrics.jsonl (one line per round), participation.jsonl,
    checkpoint/ (safetensors + tokenizer), accuracy.png, privacy_report.md, privacy.json and
    summary.json. Participation is disjoint, uniform or limited by device timers on a simulated
    clock ([participation]); the run stops before a round that would pass dp.budget_epsilon.
    metrics.jsonl holds only DP quantities (clip, noise, eps so far, MinS / MaxP, counts,
    timing) and the held-out evaluation; privacy_report.md lists what is not covered.

    With the eager runtime a round's clients train at once as a cohort (client.trainer = "auto";
    "sequential" forces the reference path), optionally sharded over Ray ([backend] kind = "ray");
    summary.json's client_trainer says which ran.

    Resume: Ctrl-C (or SIGTERM) first saves a resume point for the last released round, then
    exits 130; `dpfleet simulate --resume RUN_DIR` continues with the config the run was started
    with and ends with the weights and eps the uninterrupted run would have had, bit for bit (a
    round whose devices were training is run again, on the same noise). A kill with no chance to
    save (SIGKILL, power loss) loses the rounds released since the last resume point, written
    every `checkpoint_every` rounds: they stay released and accounted, the run goes on from
    that point on fresh noise, and its weights and eps differ. A new run stopped or refused
    before its first release leaves no run directory.
    """
    from dpfleet.coordinator.cli.result_block import result_lines
    from dpfleet.coordinator.config_overrides import describe, parse_overrides
    from dpfleet.coordinator.run import cli_pretrain, fresh_run_dir, released_any, run
    from dpfleet.coordinator.run_privacy.config_plan import load_run_config, read_run_config
    from dpfleet.coordinator.state.mechanism_binding import saved_config
    from dpfleet.errors import DpfleetError, resume_hint

    if resume is not None:
        if (config is not None or out is not None or overwrite or rounds is not None
                or seed is not None or overrides or debug_nonprivate):
            raise DpfleetError("--resume RUN_DIR continues a run with its own config: give no CONFIG, "
                               "--out, --overwrite, --rounds, --seed, --set or --debug-nonprivate "
                               "with it")
        if not (resume / "config.json").is_file():
            raise DpfleetError(f"{resume} is not a run directory (no config.json): nothing to resume")
        (cfg, plan), out = read_run_config(saved_config(resume)), resume
    elif config is None:
        raise DpfleetError("give a CONFIG to start a run, or --resume RUN_DIR to continue one")
    else:
        sets = parse_overrides(overrides)
        # the options are overrides too, after --set: parsed and checked once, with the file
        options = {"rounds": rounds, "seed": seed, "debug_nonprivate": debug_nonprivate or None}
        cfg, plan = load_run_config(config, {**sets, **{k: v for k, v in options.items() if v is not None}})
        if sets:
            click.echo(f"overrides: {describe(sets)}")
        out = out or fresh_run_dir(Path("runs") / config.stem)
    with resume_hint(f"dpfleet simulate --resume {out}", kept=lambda: released_any(out)):
        result = run(cfg, out, overwrite=overwrite, resume=resume is not None, progress=not quiet,
                     log=click.echo, pretrain=cli_pretrain(), plan=plan)  # the Python API's own path
    for line in result_lines(final={"accuracy": result.accuracy, "perplexity": result.perplexity},
                             baseline={"accuracy": result.unigram_accuracy,
                                       "perplexity": result.unigram_perplexity},
                             privacy=result.privacy, warnings=result.warnings,
                             stopped_early=result.stopped_early, run_dir=result.run_dir,
                             initial={"accuracy": result.initial_accuracy,
                                      "perplexity": result.initial_perplexity},
                             keyboard=result.keyboard, tff=result.tff):
        click.echo(line)
