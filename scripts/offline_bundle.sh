#!/usr/bin/env bash
# Build an offline bundle of dpfleet for an air-gapped (GPU) server; run on a connected machine
# with the same OS family, CPU architecture and Python minor version as the server.
# Walkthrough, the server side and the check: docs/offline_gpu_server.md.
#
#   scripts/offline_bundle.sh OUT_DIR
#
# OUT_DIR/wheels  the project's own wheel and every dependency as wheels (pip wheel: binary
#                 wheels are downloaded, any sdist-only package is built here once)
# OUT_DIR/cache   a dpfleet cache ($DPFLEET_CACHE): the teachers converted once to the folder
#                 the teacher loader reads, and the public datasets' packages
# OUT_DIR/requirements.txt  every wheel as name==version --hash=sha256:..., for the server's
#                 pip install --no-index --find-links OUT_DIR/wheels --require-hashes -r it
#                 (a wheel swapped after bundling is then refused by pip)
#
# Settings (environment variables):
#   PYTHON=python3         the interpreter whose pip runs; for the teacher staging it must have
#                          dpfleet[public] installed (it converts the GGUF once)
#   EXTRAS=public          dpfleet extras to bundle (comma list, "" for none)
#   TORCH=cpu              cpu: torch 2.13.0+cpu (download.pytorch.org/whl/cpu, no CUDA libraries);
#                          cuda: PyPI's default Linux build (CUDA 12, pulls its nvidia-* wheels);
#                          cuXYZ (e.g. cu128): download.pytorch.org/whl/cuXYZ
#   TEACHERS=gemma3-270m   teachers to stage (space separated, "" for none)
#   DATASETS=wikitext2     datasets whose packages to stage (space separated, "" for none)
#   REQUIREMENTS=          replace dpfleet[EXTRAS]'s dependency set by these requirements
#                          (space separated; the tests use a tiny set)
set -euo pipefail

OUT=${1:?usage: scripts/offline_bundle.sh OUT_DIR}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS-public}
TORCH=${TORCH:-cpu}
TEACHERS=${TEACHERS-gemma3-270m}
DATASETS=${DATASETS-wikitext2}
REQUIREMENTS=${REQUIREMENTS:-}

case "$TORCH" in
  cpu) INDEX=(--extra-index-url https://download.pytorch.org/whl/cpu) ;;
  cuda) INDEX=() ;;
  cu[0-9]*) INDEX=(--extra-index-url "https://download.pytorch.org/whl/$TORCH") ;;
  *) echo "error: TORCH must be cpu, cuda or cuXYZ, not '$TORCH'" >&2; exit 2 ;;
esac

mkdir -p "$OUT/wheels" "$OUT/cache"
OUT=$(cd "$OUT" && pwd)
pip_() { "$PYTHON" -m pip --disable-pip-version-check "$@"; }

echo "== the project's wheel" >&2
pip_ wheel --no-deps -q -w "$OUT/wheels" "$ROOT"
WHEEL=$(ls -t "$OUT"/wheels/dpfleet-*.whl | head -n 1)

echo "== dependency wheels (torch: $TORCH)" >&2
if [[ -n "$REQUIREMENTS" ]]; then
  read -r -a REQS <<<"$REQUIREMENTS"
else
  REQS=("dpfleet[${EXTRAS}] @ file://$WHEEL")
  [[ -z "$EXTRAS" ]] && REQS=("$WHEEL")
fi
pip_ wheel -q -w "$OUT/wheels" "${INDEX[@]}" "${REQS[@]}"
if [[ "$TORCH" == "cpu" && -z "$REQUIREMENTS" ]] && ls "$OUT"/wheels/nvidia_* >/dev/null 2>&1; then
  echo "error: TORCH=cpu but CUDA wheels landed in $OUT/wheels (was torch taken from PyPI?)" >&2
  exit 1
fi

if [[ -n "$TEACHERS$DATASETS" ]]; then
  echo "== teachers ($TEACHERS) and data packages ($DATASETS)" >&2
  ARGS=()
  for t in $TEACHERS; do ARGS+=(--teacher "$t"); done
  for d in $DATASETS; do ARGS+=(--dataset "$d"); done
  "$PYTHON" -m dpfleet public offline-stage --out "$OUT/cache" "${ARGS[@]}"
fi

ls "$OUT/wheels" > "$OUT/wheels.txt"
echo "== requirements.txt: every wheel pinned by name, version and SHA-256" >&2
"$PYTHON" - "$OUT" <<'PY'
import hashlib, re, sys
from pathlib import Path

out = Path(sys.argv[1])
pins: dict[str, tuple[str, str, list[str]]] = {}  # normalised name -> (name, version, hashes)
for wheel in sorted((out / "wheels").glob("*.whl")):
    name, version = wheel.name[: -len(".whl")].split("-")[:2]
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in pins and pins[key][1] != version:
        sys.exit(f"error: wheels/ holds {name} {pins[key][1]} and {version}; bundle into an "
                 "empty OUT_DIR (pip installs one version of each)")
    digest = hashlib.sha256()
    with wheel.open("rb") as fh:  # CUDA wheels are GiBs: hash in blocks
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    pins.setdefault(key, (name, version, []))[2].append(digest.hexdigest())
lines = [f"{name}=={version} " + " ".join(f"--hash=sha256:{h}" for h in hashes)
         for name, version, hashes in pins.values()]
tmp = out / "requirements.txt.tmp"
tmp.write_text("# pip install --no-index --find-links wheels --require-hashes -r requirements.txt\n"
               + "\n".join(lines) + "\n")
tmp.replace(out / "requirements.txt")
PY
echo "bundle: $OUT ($(wc -l < "$OUT/wheels.txt") wheels, $(du -sh "$OUT" | cut -f1))" >&2
