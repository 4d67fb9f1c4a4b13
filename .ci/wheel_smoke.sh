#!/usr/bin/env bash
# The installed package stands on its own (issue 33): build the wheel, install it in a fresh venv
# that sees nothing of this checkout (not --system-site-packages: the editable dpfleet lives
# there), then from an empty folder write the tiny example with `dpfleet init` and run it. It
# must finish and write summary.json. torch comes as the wheel's pinned requirement, from the
# machine's local file when pip finds one (PIP_FIND_LINKS), else from the index.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d "${TMPDIR:-/tmp}/dpfleet-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
# pip warns once per package about this machine's configured index folders that do not exist
pip_quiet() { "$@" 2> >(grep -v "^WARNING: Location 'file://" >&2); }
pip_quiet python3 -m pip wheel -q --no-deps -w "$work/dist" .
wheel=$(ls "$work"/dist/dpfleet-*.whl)
python3 -m venv "$work/venv"
pip_quiet "$work/venv/bin/python" -m pip install -q "$wheel"
mkdir "$work/empty" && cd "$work/empty"
# the first commands a user types: every --help (and bare `dpfleet`) exits 0 from the wheel,
# and the public modules import (an editable install imports importlib.util for us; a wheel not)
"$work/venv/bin/python" -c "import dpfleet, dpfleet.extensions, dpfleet.api"
"$work/venv/bin/dpfleet" >/dev/null
"$work/venv/bin/dpfleet" --help >/dev/null
for cmd in $("$work/venv/bin/python" -c "from dpfleet.cli import COMMANDS; print(*COMMANDS)"); do
    "$work/venv/bin/dpfleet" "$cmd" --help >/dev/null || { echo "dpfleet $cmd --help failed" >&2; exit 1; }
done
"$work/venv/bin/dpfleet" init --example tiny
"$work/venv/bin/dpfleet" simulate tiny.toml --quiet
"$work/venv/bin/python" - <<'PY'
import json, pathlib, dpfleet
assert "site-packages" in dpfleet.__file__, dpfleet.__file__  # the wheel's copy, not the checkout
summary = json.loads(pathlib.Path("runs/tiny/summary.json").read_text())
privacy = json.loads(pathlib.Path("runs/tiny/privacy.json").read_text())
assert summary["rounds_completed"] == 3, summary
print(f"wheel smoke: dpfleet from {pathlib.Path(dpfleet.__file__).parent} ran tiny.toml from an "
      f"empty folder: {summary['rounds_completed']} rounds, eps {privacy['epsilon']:.2f}")
PY
