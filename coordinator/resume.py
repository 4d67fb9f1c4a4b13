"""Resuming an interrupted simulation from its run directory.

Only what cannot be recomputed is saved, every `checkpoint_every` rounds and atomically: the
DP-FTRL server (theta, momentum, the live noise nodes of the tree), the adaptive clip estimator
and the number of rounds done. Participation (the guard, the device timers, the simulated clock)
and the running accountant are *replayed* from participation.jsonl, the same log the privacy
report is computed from: a resumed run cannot account differently from what it logged, and a
config or dataset that no longer reproduces the logged selections is refused. Every random draw
of a round is keyed by (seed, round, client), so a resumed run continues bit for bit as the
uninterrupted run would have.

Privacy: rounds redone after a resume use the same tree-noise nodes as before the crash. That is
safe here only because the redone round is bit-identical (same clients, same data, same noise),
so nothing new is released, and the accountant counts each round once (the log is truncated, then
replayed). A networked fleet, whose devices' data move on, must not redo a released round with
the same noise: it would have to draw fresh noise and account the round again.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file as load_numpy
from safetensors.numpy import save_file as save_numpy

from dpfleet.coordinator.adaptive_clipping import QuantileClipEstimator
from dpfleet.coordinator.dp_ftrl import DPFTRLServer
from dpfleet.coordinator.participation import Participation
from dpfleet.coordinator.run_accounting import RunAccountant
from dpfleet.coordinator.run_dir import atomic_write
from dpfleet.coordinator.tree_noise import TreeNoise
from dpfleet.errors import DpfleetError

RESUME = "resume"  # folder in the run directory; gone once the run has finished


def save_server_state(folder: Path, server: DPFTRLServer, clip_estimator: dict | None,
                      extra: dict | None = None) -> None:
    """server_state.safetensors (theta, momentum, tree nodes) and server_state.json (the rest)."""
    s = server.state_dict()
    tree = s["tree"]
    arrays = {"theta": s["theta"], "momentum": s["momentum"]}
    arrays.update({f"tree_node_{i}": n for i, n in enumerate(tree["noise"])})
    save_numpy(arrays, str(folder / "server_state.safetensors"))
    meta = {k: v for k, v in tree.items() if k != "noise"}
    atomic_write(folder / "server_state.json", json.dumps(
        {"round": s["round"], "clip_norm": s["clip_norm"], "tree": meta,
         "clip_estimator": clip_estimator, **(extra or {})}, indent=2))


def load_server_state(folder: Path) -> tuple[dict, dict]:
    """(the server's state_dict, the rest of server_state.json) saved by `save_server_state`."""
    meta = json.loads((folder / "server_state.json").read_text())
    arrays = load_numpy(str(folder / "server_state.safetensors"))
    tree = dict(meta["tree"], noise=[arrays[f"tree_node_{i}"] for i in range(len(meta["tree"]["nodes"]))])
    state = {"theta": arrays["theta"], "momentum": arrays["momentum"], "round": meta["round"],
             "clip_norm": meta["clip_norm"], "tree": tree}
    return state, meta


def load_clip_estimator(estimator: QuantileClipEstimator, state: dict) -> None:
    estimator.estimate, estimator.base = float(state["estimate"]), float(state["base"])
    estimator.noised_prefix = float(state["noised_prefix"])
    tree = dict(state["tree"], noise=[np.array([v], dtype=np.float32) for v in state["tree"]["noise"]])
    estimator.tree = TreeNoise.from_state(tree)


def differing_keys(saved: dict, resolved: dict, keys: Sequence[str] | None = None) -> list[str]:
    """Top-level keys (all, or `keys`) where a config saved as JSON and a resolved one differ."""
    current = json.loads(json.dumps(resolved))  # compare like with like: tuples become lists
    keys = sorted(set(saved) | set(current)) if keys is None else list(keys)
    return [k for k in keys if saved.get(k) != current.get(k)]


def check_resumable(path: Path, resolved: dict) -> None:
    """`path` is an unfinished run of exactly this config (else resuming would mix two runs)."""
    if not (path / "config.json").is_file():
        raise DpfleetError(f"{path} is not a run directory (no config.json): nothing to resume")
    if (path / "summary.json").is_file():
        raise DpfleetError(f"{path} is a finished run: nothing to resume")
    changed = differing_keys(json.loads((path / "config.json").read_text()), resolved)
    if changed:
        raise DpfleetError(f"{path} was started with another config (it differs in "
                           f"{', '.join(changed)}); resume it with the config it was started with")


def save_resume(run_path: Path, rounds_done: int, server: DPFTRLServer,
                estimator: QuantileClipEstimator | None) -> None:
    """Replace the run's resume point with the state after `rounds_done` rounds.

    Written to resume.tmp, then swapped in, so a crash at any moment leaves one whole resume
    point (`resume/`, or `resume.old/` if the crash fell between the two renames).
    """
    tmp, final, old = (run_path / f"{RESUME}{s}" for s in (".tmp", "", ".old"))
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_server_state(tmp, server, estimator.state_dict() if estimator else None,
                      {"rounds_done": rounds_done})
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def resume_point(run_path: Path) -> Path | None:
    for name in (RESUME, f"{RESUME}.old"):
        if (run_path / name / "server_state.json").is_file():
            return run_path / name
    return None


def discard_resume(run_path: Path) -> None:
    for suffix in ("", ".tmp", ".old"):
        shutil.rmtree(run_path / f"{RESUME}{suffix}", ignore_errors=True)


def restore(run_path: Path, server: DPFTRLServer, estimator: QuantileClipEstimator | None) -> int:
    """Load the resume point into `server` / `estimator`; returns the number of rounds done."""
    folder = resume_point(run_path)
    if folder is None:
        return 0
    state, meta = load_server_state(folder)
    if state["theta"].shape != server.theta.shape:
        raise DpfleetError(f"{folder} holds a model of {state['theta'].size} parameters, the config "
                           f"builds {server.theta.size}: it belongs to another run")
    server.load_state(state)
    if estimator is not None:
        if meta["clip_estimator"] is None:
            raise DpfleetError(f"{folder} has no adaptive-clipping state but the config clips adaptively")
        load_clip_estimator(estimator, meta["clip_estimator"])
    return int(meta["rounds_done"])


def truncate_log(path: Path, lines: int) -> list[dict]:
    """Keep the first `lines` records of a JSONL log (later ones are redone); returns them."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:lines]
    if len(records) < lines:
        raise DpfleetError(f"{path} has {len(records)} rounds but the resume point has {lines}")
    atomic_write(path, "".join(json.dumps(r) + "\n" for r in records))
    return records


def replay(participation: Participation, accountant: RunAccountant, logged: list[dict],
           users: Sequence[str]) -> None:
    """Bring participation and the accountant to where they were after the logged rounds."""
    index = {u: i for i, u in enumerate(users)}
    for entry in logged:
        r = entry["round"]
        selection = participation.propose(r)
        try:
            contributed = sorted(index[u] for u in entry["devices"])
        except KeyError as exc:
            raise DpfleetError(f"round {r + 1} of the log names device {exc}, which this config's "
                               "data does not have: the run was started with other data") from None
        if not set(contributed) <= set(selection.devices):
            raise DpfleetError(f"round {r + 1} of the log does not replay under this config "
                               "(other devices would be selected): the run was started differently")
        participation.commit(selection, contributed)
        accountant.record(entry["devices"], entry["restart"])
