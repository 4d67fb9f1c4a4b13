"""The teacher's top-k labels of a corpus, computed once per machine and reused by every job.

Labelling is the slow part of distillation (hours of CPU for the main job's public text), while
its inputs rarely change, so `cached_topk_corpus` keeps each corpus (public/topk.py's format)
under `$DPFLEET_CACHE/topk/<digest>/`, the digest taken over everything the labels depend on:

  teacher     its name and the SHA-256 of its config.json and of each weights file
  device      the device type (the body runs in bfloat16 on CUDA, float32 elsewhere)
  precision   "bfloat16" for a CPU teacher whose body runs in bfloat16 (absent for float32)
  head        the extractor's `head_mode` (an int8-screened head's labels are not float32's)
  vocabulary  the SHA-256 of the student <-> teacher id maps (idmap.npz's content)
  k, targets  how many entries per position, and in which vocabulary the top-k is taken
  sequences   the fingerprint of the student token sequences

Names, sizes and modification times do not identify weights (a re-converted teacher keeps
them), so the weights are hashed; a sidecar (`file-sha256.json`) keeps each file's hash under its
stamps (edge/staged.py: inode, size, mtime and ctime), so a 1 GB teacher is read once, not on
every call. The shard size and the
batch sizes change how the work is cut, not the labels, so they are not in the digest: a corpus
left half-done resumes with the shard size it was started with. `key.json` in each folder lists
the digest's inputs.

Only this cache's own entry for these labels is served. A folder's name is a digest anyone can
compute, and a shard only has to match its own manifest, so a folder copied or moved over
another's (teacher A's labels under teacher B's digest), or a shard swapped with its hash
written into manifest.json, would be served with no teacher forward. So an entry is used (or
resumed) only when its `key.json` equals the key computed now and its manifest carries
`cache_mac`: HMAC-SHA256 under the cache's secret (`cache-secret`, 32 random bytes, mode 0600,
made on first use) over the key's full SHA-256 and every shard's name and SHA-256. Anything
else is refused in one line on stderr and labelled again (its manifest is dropped, so no shard
of it is kept). Who can read the secret can forge entries: it is the cache owner's, like the
folder. Entries from before the MAC are refused once in the same way.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from dpfleet.edge.staged import file_stamps, hashed_with_stamps
from dpfleet.edge.wheel_cache import cache_dir
from dpfleet.errors import DpfleetError
from dpfleet.io import write_secret
from dpfleet.jsonio import SPACED, canonical_bytes, canonical_sha256, write_json
from dpfleet.public.topk import (
    TopKExtractor,
    build_corpus,
    read_manifest,
    sequences_fingerprint,
    shard_problem,
)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SIDECAR = "file-sha256.json"
_SECRET = "cache-secret"
_MAC_LABEL = b"dpfleet-topk-cache-v1\n"


def topk_cache_root() -> Path:
    """`$DPFLEET_CACHE/topk`, created on first use."""
    root = cache_dir() / "topk"
    root.mkdir(parents=True, exist_ok=True)
    return root


def cached_sha256(paths: Sequence[Path], sidecar: Path) -> dict[str, str]:
    """SHA-256 of each file, by name, reusing the hash `sidecar` holds for the same stamps
    (edge/staged.py's: inode, size, mtime and ctime; a rewrite changes ctime, which user space
    cannot set back, so a file rewritten since, even with its mtime restored, is hashed again)."""
    try:
        known = json.loads(sidecar.read_text()) if sidecar.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        known = {}  # a damaged sidecar only costs a re-hash
    out, changed = {}, False
    for path in paths:
        key, stamps = str(path.resolve()), list(file_stamps(path))
        entry = known.get(key)
        if not entry or entry.get("stamps") != stamps:
            digest, taken, keep = hashed_with_stamps(path)
            entry = {"stamps": list(taken), "sha256": digest}
            if keep:
                known[key], changed = entry, True
        out[path.name] = entry["sha256"]
    if changed:
        write_json(sidecar, known, indent=1, sort_keys=True)
    return out


def teacher_digest(folder: Path, sidecar: Path) -> dict[str, str]:
    """The SHA-256 of a Hugging Face teacher folder's config.json and weights file(s)."""
    folder = Path(folder)
    weights = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    if not (folder / "config.json").is_file() or not weights:
        raise DpfleetError(f"teacher folder {folder} has no config.json or no weights file to "
                           "identify its labels by")
    return cached_sha256([folder / "config.json", *weights], sidecar)


def labels_key(extractor: TopKExtractor, sequences: Sequence[Sequence[int]]) -> dict:
    """Everything the extractor's labels of `sequences` depend on (module docstring)."""
    root = topk_cache_root()
    maps = hashlib.sha256()
    for array in (extractor.s2t_np, extractor.t2s.cpu().numpy()):
        maps.update(np.ascontiguousarray(array, dtype=np.int64).tobytes() + b"|")
    key = {
        "format": "dpfleet-topk-v1",
        "teacher": extractor.teacher.name,
        "teacher_files": teacher_digest(extractor.teacher.path, root / _SIDECAR),
        "device": extractor.teacher.device.type,
        # a CPU teacher's bfloat16 body gives other labels (float32 keys are as they were)
        **({"precision": "bfloat16"} if extractor.teacher.device.type == "cpu"
           and extractor.teacher.precision.name == "bfloat16" else {}),
        "head_mode": extractor.head_mode,
        "vocabulary": maps.hexdigest(),
        "student_vocab_size": extractor.student_vocab,
        "k": extractor.k,
        "targets": extractor.targets,
        "fingerprint": sequences_fingerprint([s for s in sequences if len(s) > 0]),
    }
    return key


def cache_secret(root: Path) -> bytes:
    """The cache's MAC secret, `root/cache-secret` (made now, mode 0600, if there is none)."""
    path = Path(root) / _SECRET
    with contextlib.suppress(FileExistsError):  # made by an earlier (or a concurrent) job
        write_secret(path, os.urandom(32))
    secret = path.read_bytes()
    if len(secret) != 32:
        raise DpfleetError(f"{path} is not a top-k cache secret (32 bytes); delete it (the "
                           "cached labels are then computed again)")
    return secret


def manifest_mac(secret: bytes, key_sha256: str, manifest: dict) -> str:
    """HMAC-SHA256 binding a manifest's shards (each name and SHA-256, and the finished list)
    to the labels' key: what `build_corpus(seal=)` records as `cache_mac`."""
    shards = {name: record.get("sha256") for name, record in manifest.get("shard_files", {}).items()}
    text = canonical_bytes({"key_sha256": key_sha256, "shard_files": shards,
                            "shards": manifest.get("shards")})
    return hmac.new(secret, _MAC_LABEL + text, hashlib.sha256).hexdigest()


def _entry_problem(folder: Path, key: dict, manifest: dict | None, mac) -> str | None:
    """Why the entry at `folder` is not this cache's for `key` (None: it is, or it is empty).
    `manifest`: its manifest.json (None: none there); `mac`: manifest -> its expected MAC."""
    key_file = folder / "key.json"
    if key_file.is_file():
        try:
            recorded = json.loads(key_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return "its key.json is not JSON"
        if recorded != key:
            return "its key.json names other labels (another teacher, vocabulary, k or text)"
    elif manifest is not None:
        return "it has a manifest.json but no key.json"
    if manifest is None:
        return None
    try:
        expected = mac(manifest)
    except (AttributeError, TypeError):  # shard_files or a record of the wrong type
        expected = ""
    if not expected or not hmac.compare_digest(str(manifest.get("cache_mac", "")), expected):
        return "its manifest.json is not sealed by this cache for these labels"
    return None


def cached_topk_corpus(
    extractor: TopKExtractor,
    sequences: Sequence[Sequence[int]],
    *,
    shard_sequences: int = 4096,
    batch_tokens: int = 0,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> Path:
    """The folder of the top-k corpus of `sequences` in the cache, labelled now if needed.

    A finished corpus whose shards match their hashes returns at once (no teacher forward, one
    line "top-k labels: cached in PATH"); a missing, half-done or damaged one is built, resumed
    or repaired by `build_corpus` (whole shards kept). Load it with `TopKCorpus`."""
    key = labels_key(extractor, sequences)
    key_sha256 = canonical_sha256(key, separators=SPACED).hexdigest()  # old entries still hit
    root = topk_cache_root()
    secret = cache_secret(root)

    def seal(body: dict) -> str:
        return manifest_mac(secret, key_sha256, body)

    folder = root / key_sha256[:24]
    manifest_file = folder / "manifest.json"
    try:
        manifest = read_manifest(manifest_file) if manifest_file.is_file() else None
    except DpfleetError:
        manifest = {}  # not JSON: no MAC either, refused below
    problem = _entry_problem(folder, key, manifest, seal)
    if problem is not None:  # never served, never resumed: every shard is labelled again
        print(f"top-k labels: refused the cached entry {folder}: {problem}; labelling it again",
              file=sys.stderr)
        manifest_file.unlink(missing_ok=True)
        write_json(folder / "key.json", key, indent=2)
    manifest = {} if problem is not None or manifest is None else manifest
    records = manifest.get("shard_files", {})
    if "shards" in manifest and all(shard_problem(folder / name, records.get(name)) is None
                                    for name in manifest["shards"]):
        log(f"top-k labels: cached in {folder}")
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "key.json").is_file():
        write_json(folder / "key.json", key, indent=2)
    log(f"top-k labels: labelling into {folder} (once: later jobs with the same teacher, "
        "vocabulary, k, targets and text reuse them)")
    build_corpus(extractor, sequences, folder, manifest.get("shard_sequences", shard_sequences),
                 batch_tokens, progress, log, seal=seal)
    return folder
