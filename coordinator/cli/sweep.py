"""`dpfleet sweep CONFIG --grid KEY=V1,V2 [--seeds N]`: a grid of runs with seeds, summarised."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from dpfleet.coordinator.config_overrides import set_option


@click.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--grid", "grid_texts", multiple=True, required=True, metavar="KEY=V1,V2,...",
              help="A config key and the values to run it at (TOML values, comma-separated; "
                   "repeat for more keys: every combination runs).")
@click.option("--seeds", type=click.IntRange(1, 1000), default=1, show_default=True,
              help="Runs per grid point, with seeds SEED, SEED+1, ... (SEED: the config's seed).")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="The sweep's folder (default: runs/<config name>-sweep). Rerunning the same "
                   "command continues the sweep there.")
@set_option
@click.option("--quiet", is_flag=True, help="No progress bars for the runs.")
def sweep(config: Path, grid_texts: tuple[str, ...], seeds: int, out: Path | None,
          overrides: tuple[str, ...], quiet: bool) -> None:
    """Run CONFIG at every point of a grid of config values, each with several seeds.

    Each run is an ordinary run directory, SWEEP/<point>-seed<s>/ (`dpfleet compare` reads it
    like any other). The end is a table with each point's final held-out accuracy, eps and
    perplexity as mean ± the half-width of a 95% t-interval over the seeds, and a plot of the
    accuracy against the first swept key (SWEEP/sweep.png). `dpfleet compare SWEEP` shows them
    again at any time.

    Ctrl-C stops the run in progress at its resume point; the same command continues the sweep:
    finished runs are kept, the interrupted one resumes bit for bit, the rest start.

    \b
    Example:
      dpfleet sweep examples/shakespeare_cifg.toml --grid dp.target_epsilon=2,4,8 --seeds 5
    """
    from dpfleet.coordinator.config import load_config
    from dpfleet.coordinator.config_overrides import parse_overrides
    from dpfleet.coordinator.run import cli_pretrain, released_any, run
    from dpfleet.coordinator.run_privacy.config_plan import load_run_config, read_run_config
    from dpfleet.coordinator.state.mechanism_binding import saved_config
    from dpfleet.coordinator.sweep import (
        expand,
        final_figures,
        open_sweep,
        parse_grid,
        plot_summary,
        render_summary,
        summarize,
    )
    from dpfleet.errors import DpfleetError, resume_hint

    if not config.is_file():
        raise DpfleetError(f"config file not found: {config}")
    sets, grid = parse_overrides(overrides), parse_grid(grid_texts)
    clash = sorted(set(sets) & set(grid))
    if clash:
        raise DpfleetError(f"{', '.join(clash)} is both --set and --grid: give it in one of them")
    base = load_config(config, sets)
    for key, values in grid.items():  # every point is a valid config (parsed) before anything runs
        for value in values:
            load_config(config, {**sets, key: value})
    seed_list = [base.seed + i for i in range(seeds)]
    runs = expand(grid, seed_list)
    out = out or Path("runs") / f"{config.stem}-sweep"
    open_sweep(out, {"config": str(config.resolve()), "overrides": sets, "grid": grid, "seeds": seed_list,
                     "runs": [{"name": r.name, "values": r.values, "seed": r.seed} for r in runs]})
    again = "dpfleet " + shlex.join(sys.argv[1:]) if sys.argv[1:] else f"dpfleet sweep {config} ..."
    for i, item in enumerate(runs, 1):
        folder = out / item.name
        head = f"[{i}/{len(runs)}] {item.name}"
        if final_figures(folder) is not None:
            click.echo(f"{head}: finished earlier, kept")
            continue
        resume = released_any(folder)
        click.echo(f"{head}: {'resuming' if resume else 'running'}")
        if resume:
            cfg, plan = read_run_config(saved_config(folder))
        else:
            cfg, plan = load_run_config(config, {**sets, **item.values, "seed": item.seed})
        with resume_hint(again, kept=lambda: True):
            run(cfg, folder, overwrite=not resume, resume=resume, progress=not quiet,
                log=(lambda _: None) if quiet else click.echo, pretrain=cli_pretrain(), plan=plan)
    summary = summarize(out)
    click.echo("")
    click.echo(render_summary(summary))
    click.echo(f"plot: {plot_summary(summary, out / 'sweep.png')}")
