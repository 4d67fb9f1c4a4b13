"""`dpfleet fleet ...`: an emulated fleet of phones against a coordinator service."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import click

from dpfleet.jsonio import write_json

DEVICES_HELP = "Emulate the first N train clients of the config (0: all of them)."
PROCESSES_HELP = "Worker processes; each trains one device at a time (torch threads = 1)."
BACKEND_HELP = ("Where the workers run: 'local' processes, or 'ray' actors (one CPU each) on a "
                "local Ray, or on the cluster at --address (`ray start --head`; every node needs "
                "dpfleet installed and must reach the coordinator's URL).")
ADDRESS_HELP = "With --backend ray: an existing Ray cluster (HOST:6379, or 'auto'); default: a local Ray."


SUMMARY_MARK = "dpfleet fleet emulate"  # in --summary's JSON: a file emulate may replace

@click.group(name="fleet")
def fleet() -> None:
    """Emulated phones that register, check in, train and report to a coordinator service.

    Each device holds only its own user's examples and identity key, keeps its own
    participation timer, and follows its availability, speed, link and dropout ([devices]
    config section, the device model `simulate`'s timer mode reads too), on the shared
    simulated clock ([service] time_scale).
    """


def _start_hour(value: float | None) -> float:
    if value is not None:
        return value % 24.0
    now = time.gmtime()
    return now.tm_hour + now.tm_min / 60.0


@fleet.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--coordinator", "url", default=None,
              help="The coordinator's URL (serve prints it; default: the one in --state).")
@click.option("--state", type=click.Path(path_type=Path), default=None,
              help="The coordinator's state directory on this machine (`service serve "
                   "--state`): the URL, TLS certificate, plan.json, bundle_key.pub and vocabulary "
                   "not given are taken from it.")
@click.option("--devices", type=int, default=0, show_default=True, help=DEVICES_HELP)
@click.option("--processes", type=int, default=2, show_default=True, help=PROCESSES_HELP)
@click.option("--fleet-dir", type=click.Path(path_type=Path), default=None,
              help="The fleet's own folder (mode 0700) for its keys and registry; default: "
                   "runs/<CONFIG name>_fleet, the one `fleet run --state runs/<CONFIG name>` uses.")
@click.option("--fleet-keys", type=click.Path(path_type=Path), default=None,
              help="The devices' private identity keys (created 0600 if absent); default: "
                   "fleet_keys.json in --fleet-dir.")
@click.option("--registry", type=click.Path(path_type=Path), default=None,
              help="Where to write the PUBLIC key registry for `serve --fleet-public` "
                   "(default: fleet_public.json next to --fleet-keys).")
@click.option("--coordinator-timeout", type=float, default=None,
              help="Stop the fleet (exit 2, one error line) once the coordinator has not answered "
                   "for this many seconds; 0: wait for it for ever (across coordinator restarts). "
                   "[default: 5]")
@click.option("--seed", type=int, default=None, help="Fleet seed for behaviour draws (default: config seed).")
@click.option("--vocabulary", type=click.Path(path_type=Path), default=None,
              help="The coordinator's STATE/vocabulary folder (needed for a DP word vocabulary).")
@click.option("--plan", "plan_file", type=click.Path(path_type=Path), default=None,
              help="The coordinator's STATE/plan.json; needed with dp.target_epsilon: the devices "
                   "follow the plan the coordinator made at its first start (report goal).")
@click.option("--ca-file", type=click.Path(path_type=Path), default=None,
              help="Trust this PEM certificate for an https:// coordinator.")
@click.option("--start-hour", type=float, default=None,
              help="Simulated hour of day at the start (default: the current UTC hour).")
@click.option("--summary", type=click.Path(path_type=Path), default=None,
              help="Also write the summary (counts, request latency p50/p99) as JSON here; an "
                   "existing file is replaced only if an earlier emulate wrote it.")
@click.option("--bundle-key", type=click.Path(path_type=Path), default=None,
              help="The run's bundle public key (the coordinator's STATE/bundle_key.pub), pinned "
                   "out of band; needed with [fleet] client = 'bundle': devices train only with "
                   "the bundle this key signed.")
@click.option("--backend", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help=BACKEND_HELP)
@click.option("--address", default="", help=ADDRESS_HELP)
@click.option("--progress/--no-progress", default=True, show_default=True)
def emulate(config: Path, url: str | None, state: Path | None, devices: int, processes: int,
            fleet_dir: Path | None, fleet_keys: Path | None, registry: Path | None,
            coordinator_timeout: float | None,
            seed: int | None, vocabulary: Path | None, plan_file: Path | None, ca_file: Path | None,
            start_hour: float | None, summary: Path | None, bundle_key: Path | None,
            backend: str, address: str, progress: bool) -> None:
    """Run an emulated fleet of CONFIG's train clients against the coordinator at --coordinator
    until it says the run is done. A worker process (or Ray actor) that dies is restarted with
    its devices. A coordinator that stops answering stops the fleet (--coordinator-timeout).

    What the devices need of the coordinator (its URL; with dp.target_epsilon its plan.json;
    with [fleet] client = "bundle" its bundle_key.pub; with a DP word vocabulary its
    vocabulary) comes from --state STATE on the same machine, or from the single flags; one
    error names every one that is missing. The progress bar counts the rounds committed.

    The devices' private keys live in --fleet-dir (never the current folder); rerunning the
    same command reuses them. Ctrl-C stops the workers and exits 130."""
    from dpfleet.coordinator.run_privacy.config_plan import load_run_config
    from dpfleet.coordinator.state.run_dir import check_replaceable
    from dpfleet.errors import DpfleetError
    from dpfleet.fleet.bundle_device import pinned_bundle_key
    from dpfleet.fleet.emulate import GONE_AFTER_S, CoordinatorWatch, Fleet, load_devices
    from dpfleet.fleet.emulate import fleet_keys as read_keys
    from dpfleet.io import check_writable
    from dpfleet.secagg.registry import public_registry, write_public_registry

    if address and backend != "ray":
        raise DpfleetError("--address is a Ray cluster's address: give it with --backend ray")
    timeout = GONE_AFTER_S if coordinator_timeout is None else coordinator_timeout
    if timeout < 0:
        raise DpfleetError("--coordinator-timeout must be >= 0 seconds (0: wait for ever)")
    if summary is not None:  # never a run's summary.json or a user's file
        check_replaceable(summary, SUMMARY_MARK, "--summary")
    cfg, plan = load_run_config(config)
    url, ca_file, plan_file, bundle_key, vocabulary = from_coordinator(
        cfg, state, url, ca_file, plan_file, bundle_key, vocabulary)
    cfg = follow_coordinator_plan(cfg, plan_file, plan)
    for destination, folder in ((fleet_dir, True), (summary, False), (registry, False),
                                (fleet_keys, False)):  # before any work: one line, at once
        if destination is not None:
            check_writable(destination, folder)
    log = lambda s: click.echo(s, err=True)  # noqa: E731
    pinned_bundle = pinned_bundle_key(cfg, bundle_key)
    ids, examples, params = load_devices(cfg, devices, vocabulary)
    fleet_keys = fleet_keys or default_fleet_dir(config, fleet_dir) / FLEET_KEYS
    keys = read_keys(fleet_keys, len(ids))
    pins = public_registry(keys, ids)
    registry = registry or fleet_keys.with_name("fleet_public.json")
    write_public_registry(registry, pins)
    log(f"fleet: {len(ids)} devices in {processes} {'Ray actors' if backend == 'ray' else 'processes'}"
        f"; public keys in {registry}")
    fleet_cls, placement = Fleet, {}
    if backend == "ray":
        from dpfleet.fleet.ray_workers import RayFleet

        fleet_cls, placement = RayFleet, {"address": address}
    runner = fleet_cls(cfg, url, ids, examples, keys, pins, processes=processes,
                       seed=cfg.seed if seed is None else seed, model_bytes=4 * params,
                       start_hour=_start_hour(start_hour),
                       ca_file=str(ca_file) if ca_file else None, log=log,
                       bundle_key=pinned_bundle, **placement)
    del examples
    began = time.perf_counter()
    drive(runner, CoordinatorWatch(url, str(ca_file) if ca_file else None, timeout), progress,
          fleet_keys)
    result = runner.summary(time.perf_counter() - began)
    if summary:
        write_json(summary, {**result, "written_by": SUMMARY_MARK}, indent=1)
    click.echo(finished_line(result))


def drive(runner, watch, progress: bool, fleet_keys: Path) -> None:
    """Start `runner` (a `Fleet` or `RayFleet`) and poll it until it is done or `watch` sees the
    coordinator finished and gone, with the coordinator's round count as the progress bar. Ctrl-C
    stops the workers (`Interrupted`, exit 130); the workers are stopped on every way out."""
    from dpfleet.errors import Interrupted

    bar = None
    if progress:
        from dpfleet.progress import progress_bar

        bar = progress_bar(desc="rounds committed", unit="round", dynamic_ncols=True, terminal_only=False)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the workers on the way out
    runner.start()
    try:
        while not runner.done:
            runner.poll(0.5)
            if watch.check():  # it finished its run and is gone: the devices asleep are done
                break
            if bar is not None:
                total = runner.total()
                if watch.rounds is not None:  # the coordinator's count: the run's progress
                    bar.n, bar.total = watch.rounds
                bar.set_postfix(assigned=total.get("assigned", 0), reported=total.get(
                    "reported", 0) + total.get("secagg_done", 0), dropped=total.get("dropped", 0),
                    refused=sum(v for k, v in total.items() if k.startswith("refused")), refresh=True)
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
            bar = None
        runner.stop()
        click.echo(f"\ninterrupted: the fleet stopped; rerun the same command to continue (the "
                   f"devices keep their keys in {fleet_keys})", err=True)
        raise Interrupted() from None
    finally:
        if bar is not None:
            bar.close()
        runner.stop()


def finished_line(result: dict) -> str:
    """The fleet's last line: devices, assignments, updates sent, dropouts, restarts, latency."""
    counts = result["counts"]
    return (f"fleet finished: {result['devices']} devices, {counts.get('assigned', 0)} assignments, "
            f"{counts.get('reported', 0) + counts.get('secagg_done', 0)} updates sent, "
            f"{counts.get('dropped', 0)} dropped, {result['restarts']} worker restarts; "
            f"request latency p50 {_ms(result['latency_p50_s'])} p99 {_ms(result['latency_p99_s'])}")


FLEET_KEYS = "fleet_keys.json"


def from_coordinator(cfg, state: Path | None, url: str | None, ca_file: Path | None,
                     plan_file: Path | None, bundle_key: Path | None, vocabulary: Path | None
                     ) -> tuple[str, Path | None, Path | None, Path | None, Path | None]:
    """(url, ca_file, plan_file, bundle_key, vocabulary): what the config needs of its coordinator,
    each the flag given, else taken from the coordinator's `state` directory (admin.json, plan.json,
    bundle_key.pub, vocabulary/). One `DpfleetError` names every flag still missing, so a user
    learns them all at once rather than one run at a time.

    Why from the state folder and not a route: the bundle key must reach the devices out of band
    (a coordinator that served its own key could sign any program), and an emulation runs on the
    coordinator's machine anyway."""
    from dpfleet.edge.wire.admin_client import target_from_state
    from dpfleet.edge.wire.protocol import ADMIN_FILE, PLAN_FILE, PUBLIC_FILE
    from dpfleet.errors import DpfleetError
    from dpfleet.fleet.emulate import needs_coordinator_vocabulary

    if state is not None:
        state = Path(state)
        if url is None and (state / ADMIN_FILE).is_file():
            target = target_from_state(state)
            url, ca_file = target.url, ca_file or target.tls_cert
        if plan_file is None and cfg.dp.target_epsilon > 0 and (state / PLAN_FILE).is_file():
            plan_file = state / PLAN_FILE
        if bundle_key is None and cfg.fleet.client == "bundle" and (state / PUBLIC_FILE).is_file():
            bundle_key = state / PUBLIC_FILE
        if vocabulary is None and needs_coordinator_vocabulary(cfg) and (state / "vocabulary").is_dir():
            vocabulary = state / "vocabulary"
    needed = [
        (url is None, "--coordinator URL (the URL `service serve` prints)"),
        (plan_file is None and cfg.dp.target_epsilon > 0,
         "--plan STATE/plan.json (dp.target_epsilon: the coordinator's plan of its first start)"),
        (bundle_key is None and cfg.fleet.client == "bundle",
         "--bundle-key STATE/bundle_key.pub ([fleet] client = 'bundle': the key devices pin)"),
        (vocabulary is None and needs_coordinator_vocabulary(cfg),
         "--vocabulary STATE/vocabulary (the coordinator's DP word vocabulary)"),
    ]
    missing = [flag for absent, flag in needed if absent]
    if missing:
        where = (f"{state} does not hold them (is `service serve --state {state}` running?)"
                 if state is not None else "or give --state STATE (the coordinator's state "
                                           "directory) to take them from it")
        raise DpfleetError(f"fleet emulate needs {'; '.join(missing)}; {where}")
    return url, ca_file, plan_file, bundle_key, vocabulary


def follow_coordinator_plan(cfg, plan_file: Path | None, plan=None):
    """The config the devices run. dp.target_epsilon: the coordinator plans at its first start
    (service/boot.py); the devices take its plan.json (what a device demands of a SecAgg round
    follows the report goal), never a plan of their own, which could differ (another population,
    another dpfleet). `plan`: the planned keys the config states (`read_run_config`)."""
    from dpfleet.coordinator.serve_plan import checked_plan, follow_plan
    from dpfleet.errors import DpfleetError

    if cfg.dp.target_epsilon <= 0:
        if plan_file is not None:
            raise DpfleetError("--plan is the coordinator's plan of dp.target_epsilon, which this "
                               "config does not set")
        return cfg
    if plan_file is None:
        raise DpfleetError("the config sets dp.target_epsilon, which the coordinator plans at its "
                           "first start: give the devices its plan with --plan STATE/plan.json")
    # not its rounds: `fleet run --rounds` gives them to the coordinator only, devices never count
    kept = checked_plan(cfg, plan_file, kept=("target_epsilon", "delta", "mechanism_choice"))
    return follow_plan(cfg, kept, plan)[0]


def default_fleet_dir(config: Path, fleet_dir: Path | None) -> Path:
    """--fleet-dir, else runs/<config name>_fleet (what `fleet run --state runs/<config name>`
    uses); created with mode 0700: it holds the devices' private keys."""
    from dpfleet.fleet.supervisor import fleet_dir_of

    folder = Path(fleet_dir) if fleet_dir is not None else fleet_dir_of(Path("runs") / config.stem)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


@fleet.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--state", type=click.Path(path_type=Path), default=Path("runs/fleet"), show_default=True,
              help="Coordinator state = run directory; an existing one is continued.")
@click.option("--devices", type=int, default=0, show_default=True, help=DEVICES_HELP)
@click.option("--processes", type=int, default=2, show_default=True, help=PROCESSES_HELP)
@click.option("--rounds", type=int, default=None, help="Override the config's rounds.")
@click.option("--seed", type=int, default=None, help="Fleet seed for behaviour draws (default: config seed).")
@click.option("--grace", type=float, default=20.0, show_default=True,
              help="Seconds to wait for a clean stop before terminating, then killing.")
@click.option("--backend", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help=BACKEND_HELP)
@click.option("--address", default="", help=ADDRESS_HELP)
def run(config: Path, state: Path, devices: int, processes: int, rounds: int | None,
        seed: int | None, grace: float, backend: str, address: str) -> None:
    """Start a local coordinator (`service serve`) and an emulated fleet (`fleet emulate`)
    as subprocesses, show the rounds as they commit, and leave simulate's run directory in
    STATE (plus service.log), and the fleet's keys, registry and both console logs in
    STATE_fleet/ beside it; a finished run ends with the result block `simulate` ends with.

    Ctrl-C stops both cleanly (service stop, then terminate, then kill after --grace
    seconds) and exits 130; running the same command again continues the run.
    """
    from dpfleet.errors import Interrupted
    from dpfleet.fleet.supervisor import FleetInterrupted, run_fleet

    try:
        status = run_fleet(config, state, devices=devices, processes=processes, rounds=rounds,
                           seed=seed, grace_s=grace, log=lambda s: click.echo(s, err=True),
                           backend=backend, address=address)
    except FleetInterrupted as stopped:
        _status_line(stopped.status)
        click.echo(f"interrupted; continue with: dpfleet fleet run {config} --state {state} "
                   "(and the same options)", err=True)
        raise Interrupted() from None  # exit 130, as every command on Ctrl-C
    _status_line(status)
    if (Path(state) / "summary.json").is_file():  # written when the run finished
        from dpfleet.coordinator.cli.result_block import saved_result_lines

        for line in saved_result_lines(state):  # the block `simulate` and `serve` end with
            click.echo(line)


def _status_line(status: dict) -> None:
    if status:
        click.echo(f"{status.get('run_state')}: {status.get('rounds_committed')} of "
                   f"{status.get('rounds_planned')} rounds committed, "
                   f"{status.get('rounds_failed')} failed, eps {status.get('epsilon', 0.0):.3f}")
