"""`dpfleet gate RUN --policy FILE`: the release gate's verdict on a run, without exporting.

Why a command of its own: a team rehearsing a launch wants to know whether its run would ship
before it exports anything, and why not. It prints one line per rule of the policy (the rule, its
limit, the run's value, PASS or FAIL) and the verdict, whose FAIL line is the very refusal
`dpfleet export --bundle --policy` would print (`ReleasePolicy.verdicts` decides both). It writes
nothing. Exit status 0 when the run passes, 1 when it does not, 2 for a user error (one line).

A projection run (`[projection]`) is judged on its own guarantee, as the export judges it: its
model was trained with the noise scaled down and its own eps is what protects its users. Its
planned launch's figures (privacy.json's labelled `projection` block) get a second verdict under
their own heading, which never changes the exit status: it is a simulation, not a guarantee.
"""

from __future__ import annotations

from pathlib import Path

import click

from dpfleet.errors import DpfleetError
from dpfleet.export.policy import ReleasePolicy
from dpfleet.jsonio import dumps


@click.command("gate")
@click.argument("run", type=click.Path(path_type=Path))
@click.option("--policy", "policy_file", type=click.Path(path_type=Path), required=True,
              help="The release policy (TOML: max_epsilon at delta, max_rho, beat_public_model, "
              "beat_unigram, allow_caveats), as `dpfleet export --bundle --policy` checks it.")
@click.option("--json", "as_json", is_flag=True, help="Print the verdict as one JSON object.")
def gate(run: Path, policy_file: Path, as_json: bool) -> None:
    """Judge the run folder RUN (or its checkpoint/) against a release policy, writing nothing.

    Prints each rule's limit, the run's value and PASS or FAIL, then the verdict; a projection
    run also gets the planned launch's verdict, labelled as a projection. Exit status: 0 when the
    run's own guarantee and accuracy pass, 1 when they do not, 2 for a user error.
    """
    policy = ReleasePolicy.load(policy_file)  # a bad file: one line
    if run.name == "checkpoint" and not (run / "privacy.json").exists():
        run = run.parent  # the path `dpfleet export` takes
    if not run.is_dir():
        raise DpfleetError(f"no run at {run}")
    verdict = policy.gate(run)
    if as_json:
        click.echo(dumps(verdict, indent=2))
    else:
        click.echo("\n".join(verdict_lines(verdict)))
    if not verdict["passed"]:
        raise SystemExit(1)  # click's own exit returns the code to `dpfleet.cli.main`, which drops it


def verdict_lines(verdict: dict) -> list[str]:
    """The text `dpfleet gate` prints for `ReleasePolicy.gate`'s record."""
    own, planned = verdict["own"], verdict["projection"]
    lines = [f"release gate {verdict['policy']['file']} on {verdict['run']}: this run's own guarantee",
             *_rule_lines(own["rules"]),
             "verdict: PASS" if own["passed"] else f"verdict: FAIL: {own['refusal']}"]
    if planned is not None:
        word = "PASS" if planned["passed"] else "FAIL"
        lines += [f"{planned['what']}: {planned['label']}", *_rule_lines(planned["rules"]),
                  f"verdict for the planned launch: {word} (a projection, not a guarantee: the exit "
                  "status is the run's own verdict)"]
    return lines


def _rule_lines(rows: list[dict]) -> list[str]:
    return [f"  {r['rule']:<22} {r['limit']:<42} {r['value']:<30} {'PASS' if r['passed'] else 'FAIL'}"
            for r in rows]
