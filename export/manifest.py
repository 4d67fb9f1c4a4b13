"""The manifest of a phone export: what the program is, and the sha256 of every file.

An app (or a release pipeline) reads `manifest.json` to learn the architecture, vocabulary and
input shape, and checks each file's hash before loading it: a truncated download or a swapped
program is caught before it reaches the runtime.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

from dpfleet.errors import DpfleetError
from dpfleet.io import sha256_file
from dpfleet.jsonio import write_json

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


def write_manifest(folder: Path, info: dict) -> dict:
    """Hash every file under `folder` (except the manifest) and write `manifest.json`."""
    folder = Path(folder)
    files = {
        p.relative_to(folder).as_posix(): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "dpfleet_version": version("dpfleet"),
        **info,
        "files": files,
    }
    write_json(folder / MANIFEST, manifest, indent=2)
    return manifest


def verify_manifest(folder: Path) -> dict:
    """Check every listed file's size and sha256 (and that none is unlisted); returns the
    manifest. Any mismatch is a DpfleetError naming the file."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DpfleetError(f"{folder}: no readable {MANIFEST} ({exc})") from exc
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            raise DpfleetError(f"{folder}: {name} is listed in the manifest but missing")
        if path.stat().st_size != entry["bytes"] or sha256_file(path) != entry["sha256"]:
            raise DpfleetError(f"{folder}: {name} does not match its manifest hash")
    on_disk = {
        p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST
    }
    if extra := sorted(on_disk - set(files)):
        raise DpfleetError(f"{folder}: files not in the manifest: {extra}")
    return manifest
