"""`dpfleet public fred-stats` (the private query, once) and `fred-rank` (free, any number of times)."""

from __future__ import annotations

from pathlib import Path

import click

from dpfleet.jsonio import dumps, write_json


@click.command("fred-stats")
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="folder for fred_stats.npz, fred_privacy.md and fred_privacy.json")
@click.option("--quiet", is_flag=True, help="no progress bars")
def fred_stats(config, out, quiet) -> None:
    """Privately release the mean and covariance of the users' sentence embeddings (FreD).

    CONFIG is a TOML file with a [fred] table (embedder, private dataset, cohort_size K,
    level = "user" | "sample", epsilon, delta, clip, pca_dim, aggregation = "plain" | "secagg",
    dpftrl_run, ...). Each of K users sends the mean of its clipped embeddings, then the mean of
    its clipped centred outer products; Gaussian noise z1*c and z2*c^2 goes on the two sums, with
    (epsilon, delta) split between them and accounted by PLD (composed with dpftrl_run's DP-FTRL
    when given). Prints the privacy figures and the d this cohort supports (the covariance's
    noise-to-signal ratio per d on a public spectrum; set pca_dim accordingly).
    """
    from dpfleet.io import check_writable
    from dpfleet.public.fred_job import load_fred_config, run_fred_stats

    fred_cfg = load_fred_config(config)
    check_writable(out)  # before the private query: its release must not be lost to the disk
    summary = run_fred_stats(fred_cfg, out, progress=not quiet, log=click.echo)
    keys = ("embedder", "d", "level", "cohort", "noise_std_mean", "noise_std_cov_diag",
            "covariance_noise_to_signal", "recommended_pca_dim", "noise_to_signal_by_d")
    click.echo(dumps({**{k: summary[k] for k in keys}, "privacy": summary["privacy"]},
                          indent=2, default=float))


@click.command("fred-rank")
@click.option("--stats", "stats_file", type=click.Path(path_type=Path), required=True,
              help="fred_stats.npz from `dpfleet public fred-stats`")
@click.option("--candidates", required=True,
              help="public sets to score, space- or comma-separated: wikitext2 kjv "
                   "shakespeare-collab jsonl:PATH ...")
@click.option("--max-records", type=click.IntRange(2), default=2000, show_default=True,
              help="random records embedded per candidate")
@click.option("--seed", type=int, default=0, show_default=True, help="which random records")
@click.option("--plot", type=click.Path(path_type=Path),
              help="PNG of the ranking (default: fred_rank.png next to --stats)")
@click.option("--json-out", type=click.Path(path_type=Path), help="also write the table as JSON")
@click.argument("more", nargs=-1)
def fred_rank(stats_file, candidates, max_records, seed, plot, json_out, more) -> None:
    """Rank public candidate sets by FreD to the private data (post-processing: no privacy cost).

    Each candidate is embedded with the release's embedder (and its public PCA), and its Frechet
    distance to the DP mean / covariance is printed, closest first, with a bar plot.
    """
    from dpfleet.errors import DpfleetError
    from dpfleet.io import check_writable

    specs = [s for part in (candidates, *more) for s in part.replace(",", " ").split()]
    if not specs:
        raise DpfleetError("--candidates names no candidate")
    plot = Path(plot or Path(stats_file).with_name("fred_rank.png"))
    for destination in (plot, *([json_out] if json_out else [])):  # before the embedding work
        check_writable(destination, folder=False)
    from dpfleet.public.embedders import load_embedder
    from dpfleet.public.fred_job import load_release, plot_ranking, rank_candidates

    release = load_release(stats_file)
    s = release.summary
    rows = rank_candidates(release, specs, load_embedder(s["embedder"]), max_records, seed)
    width = max(len(r["candidate"]) for r in rows)
    click.echo(f"{'candidate':<{width}}  {'records':>7}  {'FreD':>10}")
    for r in rows:
        click.echo(f"{r['candidate']:<{width}}  {r['records']:>7}  {r['fred']:>10.5f}")
    eps = s["privacy"]["epsilon"]
    title = (f"FreD ({s['level']}-level, eps {eps:.3g}, delta {s['privacy']['delta']:g}; "
             f"{s['embedder']}, d = {s['d']})")
    path = plot_ranking(rows, title, plot)
    click.echo(f"plot: {path}")
    if json_out:
        write_json(Path(json_out), {"stats": str(stats_file), "rows": rows}, indent=2)
