"""`dpfleet compare RUN_DIR...`: runs side by side, as a table and a plot."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path), metavar="RUN_DIR...")
@click.option("--plot", type=click.Path(path_type=Path), default=Path("compare.png"), show_default=True,
              help="Where the plot goes (.png, .pdf or .svg); an existing file is replaced only if "
                   "an earlier compare drew it.")
@click.option("--no-plot", is_flag=True, help="Print the table only.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the comparison as JSON (each run's figures, the differing config keys) "
                   "instead of the table.")
@click.option("--tensorboard", type=click.Path(path_type=Path), default=None, metavar="DIR",
              help="Also export each run's metrics.jsonl as TensorBoard scalars to DIR/<run name>/ "
                   "(then: tensorboard --logdir DIR). Needs the tensorboard extra. A DIR/<run name> "
                   "that an earlier export did not make is refused, never replaced.")
def compare(runs: tuple[Path, ...], plot: Path, no_plot: bool, as_json: bool,
            tensorboard: Path | None) -> None:
    """Compare runs: accuracy, eps, wall time and the config keys that differ.

    Each RUN_DIR is a run directory of `simulate` or `audit` (or a coordinator's --state). A
    sweep's folder (`dpfleet sweep`), given alone, shows each grid point's final accuracy, eps and
    perplexity as mean and 95% interval over its seeds, and plots the accuracy against the key. A
    finished run shows its summary.json and privacy.json figures: held-out accuracy against the
    unigram baseline, TFF's three next-word accuracies next to the unigram and most-frequent-word
    baselines' (`TFF acc 1/2/3`), perplexity, the suggestion strip, eps at delta, rounds, wall
    time, noise, whether it is fully private. An unfinished run (interrupted, or still running)
    shows what it committed so far: the accuracy of its last evaluated round and its eps after its
    last round. Then every config key (config.json, --set overrides included) whose value is not
    the same in all runs.

    The plot (--plot, default compare.png) has held-out accuracy per round with each run's unigram
    baseline, eps per round, and each finished run's wall time.

    \b
    Example:
      dpfleet simulate examples/shakespeare_cifg.toml --set dp.target_epsilon=4 --out runs/eps4
      dpfleet simulate examples/shakespeare_cifg.toml --set dp.target_epsilon=8 --out runs/eps8
      dpfleet compare runs/eps4 runs/eps8
    """
    from dpfleet.coordinator.cli.compare_table import comparison, render
    from dpfleet.coordinator.state.run_record import read_run
    from dpfleet.coordinator.sweep import SWEEP_FILE
    from dpfleet.jsonio import dumps

    if len(runs) == 1 and (runs[0] / SWEEP_FILE).is_file():
        compare_sweep(runs[0], plot, no_plot, as_json, tensorboard)
        return
    records = [read_run(path) for path in runs]
    labels = [str(path) for path in runs]
    result = comparison(records, labels)
    click.echo(dumps(result, indent=2) if as_json else render(result))
    if not no_plot:
        from dpfleet.coordinator.cli.compare_plot import plot_runs

        click.echo(f"plot: {plot_runs(records, labels, plot)}", err=as_json)
    if tensorboard is not None:
        for folder in export_tensorboard(runs, tensorboard):
            click.echo(f"tensorboard: {folder}", err=as_json)
        click.echo(f"view with: tensorboard --logdir {tensorboard}", err=as_json)


def compare_sweep(folder: Path, plot: Path, no_plot: bool, as_json: bool, tensorboard: Path | None) -> None:
    """A sweep's folder (`dpfleet sweep`): each grid point's final figures as mean and 95%
    interval over its seeds, and the plot of the final accuracy against the first swept key."""
    from dpfleet.coordinator.cli.compare_plot import MARK, METADATA_KEY, check_replaceable
    from dpfleet.coordinator.sweep import plot_summary, read_sweep, render_summary, summarize
    from dpfleet.jsonio import dumps

    summary = summarize(folder)
    click.echo(dumps(summary, indent=2) if as_json else render_summary(summary))
    if not no_plot:
        check_replaceable(plot)
        metadata = {METADATA_KEY[plot.suffix.lower()]: MARK}
        click.echo(f"plot: {plot_summary(summary, plot, metadata)}", err=as_json)
    if tensorboard is not None:
        runs = tuple(folder / r.name for r in read_sweep(folder)["runs"] if (folder / r.name).is_dir())
        for out in export_tensorboard(runs, tensorboard):
            click.echo(f"tensorboard: {out}", err=as_json)


def export_tensorboard(runs: tuple[Path, ...], out: Path) -> list[Path]:
    """Each run's metrics as TensorBoard scalars in out/<run folder name> (-2, -3 if repeated).
    A run directory as `out` is refused (its runs' folders would land among the run's files), and
    so is an existing out/<name> without an earlier export's marker (`tensorboard_log.claim`)."""
    from dpfleet.coordinator.state.run_dir import check_not_a_run
    from dpfleet.coordinator.state.tensorboard_log import INSTALL, available, export
    from dpfleet.errors import DpfleetError

    if not available():
        raise DpfleetError(f"--tensorboard needs tensorboardX: {INSTALL}")
    check_not_a_run(out, "--tensorboard")
    folders: list[Path] = []
    for path in runs:
        name, n = path.resolve().name, 1
        while out / name in folders:
            n += 1
            name = f"{path.resolve().name}-{n}"
        try:
            folders.append(export(path, out / name))
        except OSError as exc:
            raise DpfleetError(f"cannot write {out / name}: {exc.strerror or exc}") from None
    return folders
