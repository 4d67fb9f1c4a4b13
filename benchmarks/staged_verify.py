"""What checking a staged teacher against `staged.json` costs at each load (edge/staged.py).

Stages the converted Gemma 3 270M (`$DPFLEET_CACHE/teachers/gemma3-270m`, ~1.1 GB) into a
scratch cache by hard links (same bytes, no copy; a copy where links are impossible), writes its
`staged.json`, then times `verify_staged_teacher` cold (the per-process digest cache emptied:
the cost of the first load in a job) and warm (what every further load in that process pays),
and one `load_teacher` on CPU for scale. (Linking changes the files' ctime, so it waits out the
2 s during which a fresh file is never cached.) Saves results/staged_verify.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

from dpfleet.edge.staged import (
    RACY_NS,
    STAGED_MANIFEST,
    file_sha256,
    forget_digests,
    verify_staged_teacher,
)
from dpfleet.edge.wheel_cache import cache_dir
from dpfleet.io import atomic_write
from dpfleet.public.teacher import load_teacher

RESULTS = Path(__file__).resolve().parent / "results" / "staged_verify.json"


def _timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        out.append(round(time.perf_counter() - began, 4))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", default="gemma3-270m")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    source = cache_dir() / "teachers" / args.teacher
    if not (source / "config.json").is_file():
        raise SystemExit(f"error: {source} holds no converted teacher (run offline-stage once)")
    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=".staged-bench-") as tmp:
        folder = Path(tmp) / "teachers" / args.teacher
        folder.mkdir(parents=True)
        for f in sorted(source.iterdir()):
            try:
                os.link(f, folder / f.name)
            except OSError:
                shutil.copy2(f, folder / f.name)
        size = sum(f.stat().st_size for f in folder.iterdir())
        files = {f.relative_to(tmp).as_posix(): file_sha256(f) for f in sorted(folder.iterdir())}
        atomic_write(Path(tmp) / STAGED_MANIFEST, json.dumps({"sha256": files}))
        time.sleep(RACY_NS / 1e9 + 0.5)  # a staged file is old by the time a job loads it

        def cold() -> None:
            forget_digests()
            verify_staged_teacher(folder)

        cold_s = _timed(cold, args.repeats)
        warm_s = _timed(lambda: verify_staged_teacher(folder), args.repeats)
        forget_digests()
        load_s = _timed(lambda: load_teacher(str(folder), "cpu"), 1)
    result = {
        "teacher": args.teacher, "bytes": size, "files": len(files),
        "verify_cold_s": cold_s, "verify_warm_s": warm_s,
        "load_teacher_cpu_s_including_cold_verify": load_s,
        "cold_gb_per_s": round(size / 1e9 / min(cold_s), 2),
        "cold_over_load": round(min(cold_s) / load_s[0], 3),
        "host": {"machine": platform.machine(), "cpu_count": os.cpu_count(),
                 "torch_threads": torch.get_num_threads(),
                 "loadavg": [round(x, 2) for x in os.getloadavg()]},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(RESULTS, json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
