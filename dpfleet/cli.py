"""The `dpfleet` console script.

Subcommands live next to the code they drive (`coordinator/cli/simulate.py`, `secagg/cli.py`,
...) and are imported lazily, so `dpfleet account --help` does not pay for importing torch.
Every user mistake is raised as `DpfleetError` and printed as one line with exit code 2; so is
an OSError (an unwritable or full disk), with its path (`DPFLEET_DEBUG=1`: the traceback).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import sys

import click

from dpfleet.errors import DpfleetError, Interrupted
from dpfleet.io import hold_private_umask, release_private_umask

# command name -> "module:attribute" of a click command or group
COMMANDS: dict[str, str] = {
    "init": "dpfleet.examples:init",
    "data": "dpfleet.edge.cli_data:data",
    "simulate": "dpfleet.coordinator.cli.simulate:simulate",
    "audit": "dpfleet.coordinator.cli.audit:audit",
    "compare": "dpfleet.coordinator.cli.compare:compare",
    "sweep": "dpfleet.coordinator.cli.sweep:sweep",
    "account": "dpfleet.coordinator.cli.account:account",
    "plan": "dpfleet.coordinator.cli.plan:plan",
    "secagg": "dpfleet.secagg.cli:secagg",
    "export": "dpfleet.export.cli:export",
    "gate": "dpfleet.export.gate:gate",
    "public": "dpfleet.public.cli:public",
    "service": "dpfleet.service.cli:service",
    "coordinator": "dpfleet.service.cli:coordinator",  # hidden: `service`'s deprecated name
    "fleet": "dpfleet.fleet.cli:fleet",
    "trace": "dpfleet.edge.cli_trace:trace",
}


# command name -> the line `dpfleet --help` lists it with (its short help, untruncated): kept
# here so that listing the commands imports none of them (importing them all, torch among them,
# made `dpfleet --help` take 5 s); tests/test_cli.py checks each against the command's own
SUMMARIES: dict[str, str] = {
    "account": "Privacy of DP-FTRL: exact worst-case tree sensitivity -> rho-zCDP -> (eps, delta).",
    "audit": "Audit a run: train CONFIG with canary devices, estimate epsilon from the released model.",
    "compare": "Compare runs: accuracy, eps, wall time and the config keys that differ.",
    "data": "Inspect the real, user-keyed text datasets dpfleet ships loaders for.",
    "export": "Export a checkpoint folder (model.safetensors, model_config.json, tokenizer/) for phones.",
    "fleet": "Emulated phones that register, check in, train and report to a coordinator service.",
    "gate": "Judge the run folder RUN (or its checkpoint/) against a release policy, writing nothing.",
    "init": "Write an example config into the current folder (or PATH), then run it.",
    "plan": "Plan DP-FTRL's report goal, noise multiplier and client timer for a privacy target.",
    "public": "Jobs on public data and a public LLM teacher (GPU when present, CPU otherwise).",
    "secagg": "Secure aggregation (SecAgg, SecAgg+): the server learns only the sum of a round's updates.",
    "service": "The coordinator as an HTTP service: devices register, check in, train and report over "
               "HTTP (edge/wire/PROTOCOL.md).",
    "simulate": "Simulate private federated training of an on-device LM.",
    "sweep": "Run CONFIG at every point of a grid of config values, each with several seeds.",
    "trace": "Availability traces: when each device may train, its speed class and failure chance.",
}


class LazyGroup(click.Group):
    """A group whose subcommands are imported only when used (listed from `SUMMARIES`)."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Click's listing of the commands, from `SUMMARIES` instead of the imported commands."""
        names = [name for name in self.list_commands(ctx) if name in SUMMARIES]
        limit = formatter.width - 6 - max(len(name) for name in names)
        with formatter.section("Commands"):
            formatter.write_dl([(name, click.utils.make_default_short_help(SUMMARIES[name], limit))
                                for name in names])

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name in COMMANDS if _resolvable(COMMANDS[name]))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                return None
            raise
        return getattr(module, attr)

    def resolve_command(self, ctx: click.Context, args: list[str]):
        """Click's lookup, with the nearest command named when a typo finds none."""
        name = args[0] if args else ""
        if name and not name.startswith("-") and self.get_command(ctx, name) is None:
            near = difflib.get_close_matches(name, self.list_commands(ctx), n=1)
            hint = f" Did you mean '{near[0]}'?" if near else ""
            ctx.fail(f"No such command '{name}'.{hint}")
        return super().resolve_command(ctx, args)


def _resolvable(target: str) -> bool:
    return importlib.util.find_spec(target.split(":")[0]) is not None


@click.group(cls=LazyGroup, invoke_without_command=True,
             context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dpfleet")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """dpfleet: private cross-device federated learning of on-device language models.

    Emulate a fleet of phones, train next-word models with DP-FTRL and user-level
    differential privacy, account the guarantee, and export the result for phones.
    """
    if ctx.invoked_subcommand is None:  # bare `dpfleet`: the help, as a success (click says exit 2)
        click.echo(ctx.get_help())
        ctx.exit(0)
    ctx.obj = {"pretrain": pretrain_on_public}  # for the commands that run a config (simulate, audit)
    # the permission rule (dpfleet/io.py) also for what libraries write: a command owns its
    # process's umask while it runs (and puts it back: CliRunner runs commands in-process)
    hold_private_umask()
    ctx.call_on_close(release_private_umask)


def pretrain_on_public(*args: object, **kwargs: object) -> dict:
    """`[pretrain]`'s public pretraining step, handed to the coordinator's commands in the click
    context (the coordinator must not import `dpfleet.public`); imported when a run needs it."""
    from dpfleet.public.public_init import pretrain_on_public as pretrain

    return pretrain(*args, **kwargs)


# optional top-level modules -> the extra that installs them
EXTRAS = {
    "executorch": "edge", "onnx": "edge", "onnxruntime": "edge", "onnxscript": "edge",
    "transformers": "public", "gguf": "public", "accelerate": "public", "google": "public",
    "tensorboardX": "tensorboard", "wandb": "wandb", "mlflow": "mlflow",
}


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI, turning user errors and OS errors (a folder that cannot be
    written, a full disk, a file in the way) into one clean line, exit 2. `DPFLEET_DEBUG=1`
    lets them through with their traceback, for a developer."""
    try:
        cli.main(args=argv, standalone_mode=False)
    except (DpfleetError, OSError) as exc:
        if os.environ.get("DPFLEET_DEBUG"):
            raise
        click.echo(f"error: {exc if isinstance(exc, DpfleetError) else os_error_line(exc)}", err=True)
        sys.exit(2)
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top not in EXTRAS:
            raise
        click.echo(f"error: this command needs {top!r}: pip install 'dpfleet[{EXTRAS[top]}]'",
                   err=True)
        sys.exit(2)
    except Interrupted:  # the command's own hint was the last line
        sys.exit(130)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)


def os_error_line(exc: OSError) -> str:
    """An OSError as `main` prints it: the path (both, for a rename) and the system's reason.
    One without a path is an OSError that escaped the floor's writers: it says how to see where."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    if exc.filename is None:
        return f"{reason} (DPFLEET_DEBUG=1 shows where)"
    paths = str(exc.filename) + ("" if exc.filename2 is None else f" -> {exc.filename2}")
    return f"{paths}: {reason}"
