"""`dpfleet simulate CONFIG`: run a DP-FTRL federated simulation from a TOML config."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Run directory (default: runs/<config name>, or -2, -3, ... if that is taken).")
@click.option("--overwrite", is_flag=True, help="Reuse a non-empty run directory.")
@click.option("--rounds", type=int, default=None, help="Override the config's number of rounds.")
@click.option("--seed", type=int, default=None, help="Override the config's seed.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def simulate(config: Path, out: Path | None, overwrite: bool, rounds: int | None,
             seed: int | None, quiet: bool) -> None:
    """Simulate private federated training of an on-device LM.

    Reads CONFIG (TOML; see examples/shakespeare_cifg.toml for every key), builds the clients
    from the dataset, trains with DP-FTRL (tree noise, clipping, momentum) and writes a run
    directory: config.toml, metrics.jsonl (one line per round), participation.jsonl,
    checkpoint/ (safetensors + tokenizer), accuracy.png, privacy_report.md, privacy.json and
    summary.json. Participation is disjoint, uniform or limited by device timers on a simulated
    clock ([participation]); the run stops before a round that would pass dp.budget_epsilon.
    """
    from dpfleet.coordinator.config import load_config, validate
    from dpfleet.coordinator.simulation import run_simulation

    cfg = load_config(config)
    if rounds is not None:
        cfg.rounds = rounds
    if seed is not None:
        cfg.seed = seed
    validate(cfg)
    out = out or _fresh_run_dir(Path("runs") / config.stem)
    result = run_simulation(cfg, out, overwrite=overwrite, progress=not quiet, log=click.echo)
    f, b, p = result.final, result.baseline, result.privacy
    click.echo(f"next-token accuracy   model {f['accuracy']:.4f}   unigram baseline {b['accuracy']:.4f}")
    click.echo(f"perplexity            model {f['perplexity']:.1f}   unigram baseline {b['perplexity']:.1f}")
    mins = "n/a" if p["min_separation"] is None else p["min_separation"]
    click.echo(
        f"privacy               eps = {p['epsilon']:.2f} at delta = {p['delta']:g} (PLD; "
        f"zCDP {p['zcdp']:.4g}, noise multiplier {p['noise_multiplier']:g}, observed MinS {mins}, "
        f"MaxP {p['max_participation']}; see privacy_report.md)"
    )
    if result.stopped_early:
        click.echo(f"stopped early         {result.stopped_early}")
    click.echo(f"run directory         {result.run_dir}")


def _fresh_run_dir(base: Path) -> Path:
    """runs/NAME, or the first runs/NAME-N that is free: a rerun never overwrites a result."""
    candidate, n = base, 1
    while candidate.exists() and any(candidate.iterdir()):
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate
