"""`dpfleet trace ...`: availability traces (docs/traces.md): generate, inspect, convert FedScale's."""

from __future__ import annotations

from pathlib import Path

import click
import numpy as np

from dpfleet.errors import DpfleetError
from dpfleet.jsonio import dumps

PERCENTILES = (10, 50, 90, 99)


def _new_file(out: Path) -> None:
    """OUT may be anyone's file (a config, another trace): a trace is written only where none is."""
    if out.exists() or out.is_symlink():
        raise DpfleetError(f"{out} exists: a trace is never written over a file; remove it or choose "
                           "another name")


@click.group(name="trace")
def trace() -> None:
    """Availability traces: when each device may train, its speed class and failure chance.

    A trace is plain text (JSON Lines, one device per line; gzipped if the name ends in .gz):
    the intervals in which the device is charging, idle and on unmetered Wi-Fi, in seconds from
    the trace's start. Generate a realistic one, convert FedScale's published traces, or
    inspect one.
    """


@trace.command()
@click.argument("out", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--devices", type=int, default=10_000, show_default=True,
              help="Devices in the trace (up to 10^6 and beyond; memory grows with the devices).")
@click.option("--days", type=float, default=7.0, show_default=True, help="Length of the trace in days.")
@click.option("--seed", type=int, default=0, show_default=True, help="Same seed, same file (byte for byte).")
@click.option("--start-hour", type=float, default=0.0, show_default=True,
              help="UTC hour of day at the trace's t = 0.")
def generate(out: Path, devices: int, days: float, seed: int, start_hour: float) -> None:
    """Write a seeded, realistic trace to OUT: diurnal (mostly nightly charging sessions in each
    device's time zone), bursty (sessions, not coin flips) and heterogeneous (a heavy-tailed
    availability propensity: a minority of devices holds most of the available time; speed
    classes; a failure chance around 1 in 10)."""
    from dpfleet.edge.trace_gen import generate as make
    from dpfleet.edge.traces import write_trace

    _new_file(out)
    built = make(devices, days, seed, start_hour=start_hour, progress=True)
    write_trace(out, built, progress=True)
    click.echo(f"wrote {out}: {len(built)} devices, {len(built.starts)} intervals, {days:g} days")


@trace.command()
@click.argument("path", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def inspect(path: Path, as_json: bool) -> None:
    """Summarize the trace at PATH: devices, the fraction available by UTC hour of day,
    percentiles of each device's available hours per day, the share of the available time held
    by the top 30% of devices, speed classes and failure chances."""
    from dpfleet.edge.traces import SPEED_CLASSES, availability_by_hour, available_seconds, load

    loaded = load(path, progress=True)
    n = len(loaded)
    days = loaded.header.duration / 86400.0
    seconds = available_seconds(loaded)
    per_day = seconds / 3600.0 / days
    ranked = np.sort(seconds)[::-1]
    total = float(ranked.sum())
    top = float(ranked[: max(int(0.3 * n), 1)].sum() / total) if total > 0 else float("nan")
    failure = loaded.failure[~np.isnan(loaded.failure)]
    summary = {
        "devices": n, "intervals": int(len(loaded.starts)), "days": days,
        "start_hour": loaded.header.start_hour, "source": loaded.header.source,
        "available_by_hour": [round(float(x), 4) for x in availability_by_hour(loaded)],
        "available_hours_per_day_percentiles": {  # NaN (null) for a trace without devices
            f"p{q}": round(float(np.percentile(per_day, q)), 3) if n else float("nan") for q in PERCENTILES},
        "never_available": round(float(np.mean(seconds == 0)), 4) if n else float("nan"),
        "top30_share": round(top, 4),
        "speed": {name: int(np.sum(loaded.speed == i)) for i, name in enumerate(SPEED_CLASSES)},
        "failure_mean": round(float(failure.mean()), 4) if len(failure) else None,
    }
    if as_json:
        click.echo(dumps(summary, indent=2))
        return
    click.echo(f"devices: {n}  intervals: {summary['intervals']}  days: {days:g}  (t = 0 at "
               f"{loaded.header.start_hour:g}h UTC)")
    if not n:
        click.echo("no devices: nothing more to summarize")
        return
    pct = summary["available_hours_per_day_percentiles"]
    click.echo("available hours per day per device: " + "  ".join(f"{k} {v:g}" for k, v in pct.items()))
    click.echo(f"never available: {summary['never_available']:.1%}   top 30% of devices hold "
               f"{top:.1%} of the available time")
    failure_text = ("" if summary["failure_mean"] is None
                    else f"   mean failure chance {summary['failure_mean']:.3f}")
    click.echo("speed classes: " + "  ".join(f"{k} {v}" for k, v in summary["speed"].items()) + failure_text)
    click.echo("fraction of devices available by UTC hour:")
    for hour, frac in enumerate(summary["available_by_hour"]):
        click.echo(f"  {hour:02d}h {frac:6.1%} " + "#" * int(round(frac * 100)))


@trace.command(name="convert-fedscale")
@click.argument("behave", type=click.Path(path_type=Path, dir_okay=False))
@click.argument("out", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--capacity", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="FedScale's client_device_capacity: speed classes from its computation times "
                   "(terciles); without it every device is 'mid'.")
@click.option("--days", type=float, default=None,
              help="The trace's length (default: the longest finish_time; each client's intervals "
                   "repeat every finish_time, as in FedScale).")
def convert_fedscale(behave: Path, out: Path, capacity: Path | None, days: float | None) -> None:
    """Convert FedScale's client_behave_trace BEHAVE to a plain-text trace OUT.

    The pickles are read as plain data only: a file naming any Python class or function (code
    that unpickling would run) is refused."""
    from dpfleet.edge.trace_fedscale import convert_fedscale as convert

    _new_file(out)
    header = convert(behave, out, capacity=capacity, duration=None if days is None else days * 86400.0,
                     progress=True)
    click.echo(f"wrote {out}: {header.devices} devices, {header.duration / 86400.0:g} days")
