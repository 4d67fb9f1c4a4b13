"""The coordinator's container recipe (deploy/Dockerfile): linted statically here on every run
(what it copies exists and is every subpackage, torch pinned as pyproject.toml pins it, a non-root
user, the state directory a volume, the listening port exposed, its command a real `dpfleet`
command, its health check answered by a real coordinator), and built where a container engine
can build (Docker with a daemon, or Podman), skipped with the reason elsewhere."""

import asyncio
import json
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner
from service_fleet import tiny_cfg

from dpfleet.cli import cli
from dpfleet.service.server import shutdown, start

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "deploy" / "Dockerfile"
HEALTHCHECK = ROOT / "deploy" / "healthcheck.py"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the recipe, continuation lines joined, comments left out."""
    text = "\n".join(line for line in RECIPE.read_text().splitlines() if not line.lstrip().startswith("#"))
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def of(kind: str) -> list[str]:
    return [rest for word, rest in instructions() if word == kind]


def exec_form(rest: str) -> list[str]:
    return json.loads(rest)


def command() -> list[str]:
    """What the container runs: ENTRYPOINT + CMD."""
    [entrypoint], [cmd] = of("ENTRYPOINT"), of("CMD")
    return exec_form(entrypoint) + exec_form(cmd)


def test_it_copies_what_exists_and_every_subpackage_the_wheel_has():
    copied = []
    for rest in of("COPY"):
        *sources, _dest = shlex.split(rest)
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such file in the repository"
            copied.append(source.rstrip("/"))
    folders = {d.split("/")[0] for d in PYPROJECT["tool"]["setuptools"]["package-dir"].values()}
    assert folders <= set(copied), f"not copied: {folders - set(copied)}"
    # the build context keeps them (.dockerignore lists what goes in)
    kept = {line.strip("!/ ") for line in (ROOT / ".dockerignore").read_text().splitlines()
            if line.startswith("!")}
    assert set(copied) <= kept


def test_torch_is_pinned_as_pyproject_pins_it():
    [pin] = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch")]
    assert pin.startswith("torch==")
    assert any(f'"{pin}"' in rest for rest in of("RUN")), f"the recipe does not install {pin}"


def test_it_runs_as_a_user_with_the_state_as_a_volume_and_the_port_exposed():
    words = [w for w, _ in instructions()]
    [user] = of("USER")
    assert user not in ("root", "0") and words.index("USER") > max(
        i for i, w in enumerate(words) if w == "RUN")  # nothing after it runs as root
    cmd = command()
    state = cmd[cmd.index("--state") + 1]
    assert state in exec_form(of("VOLUME")[0])
    port = cmd[cmd.index("--listen") + 1].rsplit(":", 1)[1]
    assert of("EXPOSE") == [port]


def test_its_command_is_a_real_dpfleet_command_with_real_options():
    cmd = command()
    assert cmd[:3] == ["dpfleet", "service", "serve"]
    help_ = CliRunner().invoke(cli, cmd[1:3] + ["--help"])
    assert help_.exit_code == 0, help_.output
    for option in (w for w in cmd[3:] if w.startswith("--")):
        assert f"{option} " in help_.output, f"`service serve` has no option {option}"
    # off loopback, serve refuses to start without TLS and the fleet's key registry: the recipe gives both
    assert {"--tls-cert", "--tls-key", "--fleet-public"} <= set(cmd)


def test_the_health_check_is_answered_by_a_running_coordinator_and_fails_without_one(tmp_path):
    [health] = of("HEALTHCHECK")
    probe = exec_form(health.split("CMD", 1)[1])
    assert probe[1] == "/usr/local/bin/dpfleet-healthcheck"
    assert any(f"{HEALTHCHECK.relative_to(ROOT)} {probe[1]}" in c for c in of("COPY"))
    state = tmp_path / "state"

    def check() -> int:
        return subprocess.run([sys.executable, str(HEALTHCHECK), str(state)], timeout=60).returncode

    assert check() == 1  # no coordinator (no admin.json)

    async def main() -> int:
        running = await start(tiny_cfg(rounds=1), state, log=lambda s: None)
        try:
            return await asyncio.to_thread(check)
        finally:
            running.driver.stop()
            await shutdown(running)

    assert asyncio.run(main()) == 0
    assert check() == 1  # stopped: admin.json left behind, nothing listening


def engine() -> str | None:
    """A container engine that can build here: podman, or docker with a reachable daemon."""
    if shutil.which("podman"):
        return "podman"
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        return "docker"
    return None


@pytest.mark.slow  # installs torch into an image: minutes
def test_the_image_builds_and_serves_help(tmp_path):
    tool = engine()
    if tool is None:
        pytest.skip("no container engine can build here (no podman; docker without a daemon)")
    tag = "dpfleet-coordinator:test"
    build = subprocess.run([tool, "build", "-f", str(RECIPE), "-t", tag, str(ROOT)],
                           capture_output=True, text=True)
    if build.returncode and any(s in build.stderr.lower() for s in (
            "pull", "resolve", "registry", "dial tcp", "no such host", "connection refused")):
        pytest.skip(f"the base image or an index is unreachable: {build.stderr.strip()[-300:]}")
    assert build.returncode == 0, build.stderr[-3000:]
    try:
        run = subprocess.run([tool, "run", "--rm", tag, "service", "serve", "--help"],
                             capture_output=True, text=True)
        assert run.returncode == 0 and "--state" in run.stdout, run.stderr
        [config] = json.loads(subprocess.run([tool, "image", "inspect", tag], capture_output=True,
                                             text=True, check=True).stdout)
        conf = config["Config"]
        assert conf["User"] == "dpfleet" and "/state" in conf["Volumes"]
        assert "8443/tcp" in conf["ExposedPorts"] and conf["Healthcheck"]["Test"][0] == "CMD"
    finally:
        subprocess.run([tool, "image", "rm", "-f", tag], capture_output=True)
