"""Every attack by a dishonest participant (device or server) that the project tries, run live:
one row per attack with `name`, `succeeded_on_old_main`, `succeeds_now` and the value that shows
it. Each attack is a module in benchmarks/adversarial/ with `run() -> list[dict]`.

    python benchmarks/adversarial_participants.py [--only MODULE ...]

A module measures `succeeded_on_old_main` itself: by running the attack against the old
behaviour where a switch still selects it, or against old main's code in another environment.
The script exits non-zero when any attack succeeds now.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "adversarial_participants.json"
REQUIRED = {"name", "succeeded_on_old_main", "succeeds_now", "value"}


def modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules([str(HERE / "adversarial")]))


def run_module(name: str) -> list[dict]:
    sys.path.insert(0, str(HERE))
    rows = importlib.import_module(f"adversarial.{name}").run()
    for row in rows:
        missing = REQUIRED - row.keys()
        if missing:
            raise SystemExit(f"{name}: row {row.get('name')} lacks {sorted(missing)}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="module names (default: all)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    rows, started = [], time.time()
    for name in args.only or modules():
        t0 = time.time()
        module_rows = run_module(name)
        for row in module_rows:
            row.setdefault("module", name)
            row["seconds"] = round(time.time() - t0, 2)
            print(f"{row['name']:40s} old main: {'broken' if row['succeeded_on_old_main'] else 'held':6s}"
                  f"  now: {'BROKEN' if row['succeeds_now'] else 'held'}")
        rows.extend(module_rows)
    out = {"rows": rows, "threads": os.environ.get("OMP_NUM_THREADS", "default"),
           "loadavg": os.getloadavg(), "seconds": round(time.time() - started, 1),
           "python": sys.version.split()[0]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    if any(r["succeeds_now"] for r in rows):
        raise SystemExit("an attack succeeds now")


if __name__ == "__main__":
    main()
