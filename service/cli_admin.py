"""`dpfleet service status | pause | resume | stop | report`: operate a running coordinator.

Standalone click commands; `add_admin_commands(group)` hangs them under the `service` group
(`service/cli.py`). Each reaches the coordinator through STATE/admin.json (`--state`, a
coordinator on this machine) or `--url` + `--token-file` (anywhere), and prints a table for a
person or, with `--json`, the coordinator's own JSON (which always has `rounds_committed`).

`report --state` on a FINISHED run needs no coordinator: a finished run's report is final, so
it is read from the state directory itself (its SQLite says finished; privacy_report.md and
privacy.json are what the coordinator wrote at the end, and what its admin API would serve).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import sqlite3
from collections.abc import Callable
from pathlib import Path

import click

from dpfleet.edge.wire.admin_client import AdminClient, target_from_state, target_from_url
from dpfleet.errors import DpfleetError
from dpfleet.jsonio import dumps
from dpfleet.service.status_page import format_duration


def finished_run(state: Path) -> dict | None:
    """A finished run in `state`, read from its files (no coordinator needed): {"report" (the
    markdown), "rounds_committed", "rounds_failed", "epsilon", "delta", "run_state"}; None when
    `state` holds no finished run (none at all, or one a coordinator can still continue)."""
    from dpfleet.coordinator.state.state_store import DB_FILE

    db_path = Path(state) / DB_FILE
    if not db_path.is_file():
        return None
    try:  # read-only: a lingering coordinator may still hold it (WAL allows readers)
        db = sqlite3.connect(f"{db_path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
            counts = dict(db.execute("SELECT status, COUNT(*) FROM rounds GROUP BY status").fetchall())
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise DpfleetError(f"{db_path} is not a readable coordinator state ({exc})") from None
    if meta.get("finished") != "1":
        return None
    report_path, privacy_path = Path(state) / "privacy_report.md", Path(state) / "privacy.json"
    try:
        text = report_path.read_text()
    except OSError as exc:
        raise DpfleetError(f"{state} holds a finished run but its {report_path.name} is not "
                           f"readable ({exc.strerror or exc})") from None
    privacy: dict = {}
    with contextlib.suppress(OSError, ValueError):
        privacy = json.loads(privacy_path.read_text())
    return {"run_state": "finished", "rounds_committed": counts.get("committed", 0),
            "rounds_failed": counts.get("failed", 0), "epsilon": privacy.get("epsilon"),
            "delta": privacy.get("delta"), "report": text}


def _target_options(fn: Callable) -> Callable:
    """The options every admin command shares, turned into one `client` argument (the `report`
    command gets None instead when --state holds a finished run: `finished_run`)."""

    @click.option("--state", "state", type=click.Path(path_type=Path), default=None,
                  help="The coordinator's state directory on this machine: reads STATE/admin.json "
                       "(url, admin token, pid, TLS certificate) that `serve` wrote.")
    @click.option("--url", default=None,
                  help="The coordinator's URL (http[s]://HOST:PORT), with --token-file.")
    @click.option("--token-file", type=click.Path(path_type=Path), default=None,
                  help="A file holding the admin token (with --url); a file, so the token never "
                       "shows in the shell history or the process list.")
    @click.option("--tls-cert", type=click.Path(path_type=Path), default=None,
                  help="With an https --url: the coordinator's (self-signed) certificate to trust.")
    @click.option("--json", "as_json", is_flag=True,
                  help="Print machine-readable JSON (always includes rounds_committed).")
    @click.option("--timeout", type=float, default=10.0, show_default=True,
                  help="Seconds to wait for the coordinator's answer.")
    @functools.wraps(fn)
    def wrapper(state, url, token_file, tls_cert, as_json, timeout, **kwargs):
        if state is not None and (url or token_file or tls_cert):
            raise DpfleetError("give either --state DIR or --url URL --token-file FILE, not both")
        if state is not None and getattr(fn, "reads_finished_state", False):
            done = finished_run(state)
            if done is not None:
                return fn(None, as_json, finished=done, **kwargs)
        if state is not None:
            target = target_from_state(state)
        elif url and token_file:
            target = target_from_url(url, token_file, tls_cert)
        elif url or token_file:
            raise DpfleetError("--url and --token-file go together (or use --state DIR)")
        else:
            raise DpfleetError("which coordinator? give --state DIR (one on this machine) "
                               "or --url URL --token-file FILE")
        return fn(AdminClient(target, timeout=timeout), as_json, **kwargs)

    return wrapper


def _num(value: object, fmt: str, none: str = "-") -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return none
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value == math.inf else none
    return format(value, fmt)


def format_status(status: dict, url: str) -> str:
    """The status as an aligned two-column table, then the mean time of each phase."""
    dev = status.get("devices") if isinstance(status.get("devices"), dict) else {}
    planned = status.get("rounds_planned")
    rows = [
        ("coordinator", f"{url}  (up {format_duration(status.get('uptime_s'))})"),
        ("run state", str(status.get("run_state", "-"))),
        ("round", f"{_num(status.get('round'), 'd')}  phase {status.get('phase', '-')}"),
        ("devices", f"{_num(dev.get('waiting'), 'd')} waiting, {_num(dev.get('training'), 'd')} "
                    f"training, {_num(dev.get('refused_timer'), 'd')} refused by timer "
                    f"({_num(dev.get('registered'), 'd')} registered)"),
        ("rounds", f"{_num(status.get('rounds_committed'), 'd')} committed, "
                   f"{_num(status.get('rounds_failed'), 'd')} failed, "
                   f"{_num(planned, 'd')} planned"),
        ("eps spent so far", f"{_num(status.get('epsilon'), '.4f', 'n/a')} at delta "
                             f"{_num(status.get('delta'), 'g', 'n/a')}"),
        ("last accuracy", _num(status.get("last_accuracy"), ".4f", "n/a (no evaluation yet)")),
    ]
    width = max(len(k) for k, _ in rows) + 2
    lines = [f"{k:<{width}}{v}" for k, v in rows]
    phases = status.get("phase_seconds")
    if isinstance(phases, dict) and phases:
        lines.append("mean time per phase")
        pw = max(len(str(p)) for p in phases) + 2
        lines += [f"  {str(p):<{pw}}{_num(s, '9.3f')} s" for p, s in phases.items()]
    return "\n".join(lines)


def _one_line(status: dict) -> str:
    return (f"{status['run_state']}: round {status['round']} (phase {status['phase']}), "
            f"{status['rounds_committed']} committed, {status['rounds_failed']} failed of "
            f"{status['rounds_planned']} planned")


@click.command("status")
@_target_options
def status(client: AdminClient, as_json: bool) -> None:
    """Show a running coordinator: run state, round and phase, devices waiting / training /
    refused by their timer, rounds committed / failed / planned, eps spent so far, the last
    held-out accuracy and the mean time of each phase."""
    st = client.status()
    click.echo(dumps(st) if as_json else format_status(st, client.target.url))


def _control(action: str) -> click.Command:
    verbs = {"pause": "Pause the run: no new round opens (the open one still finishes or fails by "
                      "its deadlines) and devices that check in are told to come back later.",
             "resume": "Resume a paused run.",
             "stop": "Stop the coordinator: an open round fails now (nothing of it is released); "
                     "committed rounds are durable and `serve` on the same --state continues."}

    @_target_options
    def command(client: AdminClient, as_json: bool) -> None:
        st = getattr(client, action)()
        click.echo(dumps(st) if as_json else _one_line(st))

    command.__doc__ = verbs[action] + " Prints the new status."
    return click.command(action)(command)


pause = _control("pause")
resume = _control("resume")
stop = _control("stop")


def _reads_finished_state(fn: Callable) -> Callable:
    """Mark an admin command that `_target_options` hands a finished run's files (`finished=`)
    when --state holds one, instead of asking a coordinator."""
    fn.reads_finished_state = True
    return fn


REPORT_MARK = "written by dpfleet coordinator report"  # the first line of an --out file (kept as
# it was: files written before `coordinator` became `service` stay replaceable)


@click.command("report")
@_target_options
@_reads_finished_state
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Write the report (markdown) to this file instead of printing it; an existing "
                   "file is replaced only if an earlier report wrote it.")
def report(client: AdminClient | None, as_json: bool, out: Path | None,
           finished: dict | None = None) -> None:
    """The privacy report (markdown) that the coordinator writes from its own release log:
    eps spent, MinS / MaxP observed, and what the guarantee does not cover. With --state on a
    finished run, read from that folder (no coordinator needs to run)."""
    text = finished["report"] if finished is not None else client.report()
    if out is not None:
        from dpfleet.coordinator.state.run_dir import check_replaceable
        from dpfleet.io import atomic_write

        check_replaceable(out, REPORT_MARK, "--out")  # never a run's own report or a user's file
        try:
            atomic_write(out, f"<!-- {REPORT_MARK} -->\n{text}")
        except OSError as exc:
            raise DpfleetError(f"cannot write the report to {out} ({exc.strerror})") from None
    if as_json:
        st = finished if finished is not None else client.status()
        click.echo(dumps({"rounds_committed": st["rounds_committed"], "epsilon": st["epsilon"],
                          "delta": st["delta"], "report": text,
                          "out": None if out is None else str(out)}))
    elif out is not None:
        click.echo(f"privacy report written to {out}")
    else:
        click.echo(text.rstrip("\n"))


ADMIN_COMMANDS = (status, pause, resume, stop, report)


def add_admin_commands(group: click.Group) -> click.Group:
    """Hang the admin commands under `group` (the `service` group)."""
    for command in ADMIN_COMMANDS:
        group.add_command(command)
    return group
