"""Resuming an interrupted run: the engine's DP-FTRL server and clip estimator saved to and
restored from a resume point (its files and keys: `state.resume`), and the released rounds
replayed through participation and the accountant.

Only what cannot be recomputed is saved, atomically, every `checkpoint_every` rounds and on Ctrl-C
/ SIGTERM for the last released round (`RoundEngine.save_interrupted`): the DP-FTRL server (theta,
momentum, the position of its noise stream), the adaptive clip estimator, the number of rounds
done, and the run's secret noise key. Participation (the guard, the device timers, the simulated
clock) and the running accountant are *replayed* from the release log (`release_log`), the same
records participation.jsonl and the privacy report come from: a resumed run cannot account
differently from what it released, and a config or dataset that no longer reproduces the logged
selections is refused. Every random draw of a round except the noise is keyed by (seed, round,
client); the noise by (secret key, tree, node).

Secrets: a resume point holds no noise. A noise stream is saved as its `state_dict()`, a JSON
position (`NoiseStream` in `mechanisms/base.py`), and `Mechanism.resume` rebuilds it from the key:
the tree recomputes its live nodes, matrix factorization replays. Why: with theta and theta_0
(rebuilt from config.json) the live tree nodes, whose sum is the whole noise, gave the clipped sum
of the clients' updates back to anyone who could read the folder. A resume point of an older
dpfleet (tree_node_i arrays) still resumes: the arrays are never read. `resume/noise_key` holds
the 32-byte key in its own 0600 file; it exists only while the run is unfinished, and the finished
run's `checkpoint/server_state.*` keeps theta, momentum, the clip norm and the streams' positions.
(A finished run cannot extend its tree: a continuation has to start a fresh tree.)

Privacy rules after a crash (`release_log` has the full design): a round that was released (it is
in the release log) is never computed again. Resuming from a point older than the last release
continues at the round after it, on a fresh tree; the lost rounds stay in the logs and the
accounting. If nothing was lost (always, after a Ctrl-C), the run continues bit for bit as an
uninterrupted run would (the key is restored). Resuming with other training data
(`data_fingerprint`) is refused.

The config is bound to the releases: the resume point (server_state.json's `guarantee`) and every
release record carry the run's guarantee digest (`guarantee`), and `resume_run` / `restore`
refuse a resume whose recomputed digest differs from any of them, naming the settings, before
anything is written. (`check_resumable` alone compared config.json with itself: the resume reads
its config from there.) A point or record without a digest is refused too.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors.numpy import save as numpy_bytes

from dpfleet.coordinator.engine.adaptive_clipping import QuantileClipEstimator
from dpfleet.coordinator.engine.dp_ftrl import DPFTRLServer
from dpfleet.coordinator.engine.participation import Participation, RoundUnfillable
from dpfleet.coordinator.mechanisms.noise_stream import key_id
from dpfleet.coordinator.run_privacy.run_accountant import RunAccountant
from dpfleet.coordinator.state.guarantee import check_guarantee
from dpfleet.coordinator.state.mechanism_binding import binding, check_bound
from dpfleet.coordinator.state.release_log import ReleaseLog, check_no_reuse
from dpfleet.coordinator.state.resume import (
    RESUME,
    ResumeSource,
    load_server_state,
    read_key,
    resume_point,
    write_key,
)
from dpfleet.coordinator.state.run_dir import atomic_write
from dpfleet.errors import DpfleetError
from dpfleet.io import fsync_path, private_mkdir
from dpfleet.jsonio import dumps, write_json


def save_server_state(folder: Path, server: DPFTRLServer, clip_estimator: dict | None,
                      extra: dict | None = None) -> None:
    """server_state.safetensors (theta, momentum) and server_state.json (the rest: the noise
    streams' `state_dict()`s as they are, JSON positions, never a noise value)."""
    s = server.state_dict()
    arrays = {"theta": s["theta"], "momentum": s["momentum"]}
    atomic_write(folder / "server_state.safetensors", numpy_bytes(arrays))
    write_json(
        folder / "server_state.json",
        {"round": s["round"], "clip_norm": s["clip_norm"],
         "tree": _stream_state(server.mechanism, s["tree"]),
         "clip_estimator": None if clip_estimator is None else dict(
             clip_estimator, tree=_stream_state(server.mechanism, clip_estimator["tree"])),
         "mechanism": binding(server.mechanism), **(extra or {})},
        indent=2)


def _stream_state(mechanism, state: object) -> dict:
    """A noise stream's `state_dict()`, checked to be what the `NoiseStream` contract asks: a
    JSON object (its position). Anything else (a noise array above all) is refused in one line
    before anything is written: a resume point never holds noise."""
    try:
        if not isinstance(state, dict):
            raise TypeError(type(state).__name__)
        return json.loads(json.dumps(state, allow_nan=False))
    except (TypeError, ValueError):
        raise DpfleetError(f"noise mechanism {getattr(mechanism, 'name', '?')!r}: its stream's state_dict() "
                           f"must be a JSON object of numbers, strings and lists (its position, e.g. "
                           f"{{'t': 3, 'tree_id': 0}}), got {type(state).__name__} {str(state)[:80]!r}"
                           ) from None


def load_clip_estimator(estimator: QuantileClipEstimator, state: dict) -> None:
    estimator.estimate, estimator.base = float(state["estimate"]), float(state["base"])
    estimator.noised_prefix = float(state["noised_prefix"])
    estimator.load_tree(state["tree"])


def save_resume(run_path: Path, rounds_done: int, server: DPFTRLServer,
                estimator: QuantileClipEstimator | None, guarantee: dict | None = None,
                precision: str = "float32", kernels: Sequence[str] = ()) -> None:
    """Replace the run's resume point with the state after `rounds_done` rounds (`server` and
    `estimator` may be `Frozen` states of theirs), with the run's `guarantee` (`guarantee.py`:
    a resume that would run under another one is refused, `restore`), the `precision` its
    clients trained at (a resume at another one is refused: the run would switch silently) and
    the `kernels` that decided the bits at bfloat16, in the order the run used them
    (`backends.trainer_precision`: a resume with others is said, `restore`).

    Written to resume.tmp (every file fsynced), then swapped in, so a crash at any moment leaves
    one whole resume point (`resume/`, or `resume.old/` if the crash fell between the two
    renames). The noise key goes to its own 0600 file.
    """
    tmp, final, old = (run_path / f"{RESUME}{s}" for s in (".tmp", "", ".old"))
    shutil.rmtree(tmp, ignore_errors=True)
    private_mkdir(tmp)
    save_server_state(tmp, server, estimator.state_dict() if estimator else None,
                      {"rounds_done": rounds_done, "guarantee": guarantee, "precision": precision,
                       **({"kernels": list(kernels)} if kernels else {})})
    write_key(tmp, server.noise_key)
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    fsync_path(run_path)  # the swap is durable before the point is said to be there
    shutil.rmtree(old, ignore_errors=True)


def restore(run_path: Path, server: DPFTRLServer, estimator: QuantileClipEstimator | None,
            source: ResumeSource | None = None, *, guarantee: dict,
            precision: str = "float32") -> tuple[int, list[str]]:
    """Load the resume point into `server` / `estimator`; returns the number of rounds done and
    the bfloat16 kernels its rounds ran, in order (`save_resume`). The point must have been saved
    under `guarantee`, the one this resume runs with, by clients training at `precision`
    (`client.precision` as this machine resolves it). Other kernels than the resume's (another
    compiler, CPU or kernel source) are not refused: privacy does not depend on them and both
    round at the same precision; but the later rounds are not the bits an uninterrupted run
    would have made, which the run's log and summary.json say (`RoundEngine.kernels_changed`)."""
    folder = resume_point(run_path) if source is None else source.point
    if folder is None:
        return 0, []
    state, meta = load_server_state(folder)
    if state["theta"].shape != server.theta.shape:
        raise DpfleetError(f"{folder} holds a model of {state['theta'].size} parameters, the config "
                           f"builds {server.theta.size}: it belongs to another run")
    check_bound(server.mechanism, meta.get("mechanism"), f"the resume point {folder}")
    check_guarantee(guarantee, meta.get("guarantee"), f"the resume point {folder}")
    saved = meta.get("precision", "float32")  # a point saved before the key: float32 throughout
    if saved != precision:
        raise DpfleetError(f"{folder}: the run's clients trained at {saved}, this resume would train "
                           f"at {precision} (client.precision as this machine resolves it); resume "
                           f"where client.precision gives {saved}")
    server.noise_key = read_key(folder if source is None else source.key_folder)
    server.load_state(state)
    if estimator is not None:
        if meta["clip_estimator"] is None:
            raise DpfleetError(f"{folder} has no adaptive-clipping state but the config clips adaptively")
        estimator.key = server.noise_key
        load_clip_estimator(estimator, meta["clip_estimator"])
    return int(meta["rounds_done"]), list(meta.get("kernels", []))


def replay(participation: Participation, accountant: RunAccountant, logged: list[dict],
           users: Sequence[str], networked: bool = False) -> list[dict]:
    """Bring participation and the accountant to where they were after the logged rounds
    (`networked`: `ResumeSource.networked`; the guard still refuses any MinS / MaxP break);
    returns the accountant's privacy after each of them (what each metrics record says)."""
    index = {u: i for i, u in enumerate(users)}
    spent = []
    for entry in logged:
        r = entry["round"]
        try:
            contributed = sorted(index[u] for u in entry["devices"])
        except KeyError as exc:
            raise DpfleetError(f"round {r + 1} of the log names device {exc}, which this config's "
                               "data does not have: the run was started with other data") from None
        try:
            if networked:  # who checked in is not logged: those in the sum, all of them (an
                # over-selected round may have more contributors than the report goal)
                extra = max(0, len(contributed) - participation.report_goal)
                selection = participation.propose(r, np.asarray(contributed, dtype=np.int64),
                                                  extra=extra)
            else:
                selection = participation.propose(r)
        except RoundUnfillable:
            selection = None
        if selection is None or not set(contributed) <= set(selection.devices):
            raise DpfleetError(f"round {r + 1} of the log does not replay under this config "
                               "(other devices would be selected): the run was started differently")
        participation.commit(selection, contributed)
        spent.append(accountant.record(entry["devices"], entry["restart"]))
    return spent


@dataclass
class Resumed:
    """Where a resumed run stands."""

    start: int  # 0-based index of the next round to run (= rounds released so far)
    rounds_done: int  # rounds in the resume point's state
    metrics: list[dict] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)  # 1-based rounds released but not in the state
    kernels: list[str] = field(default_factory=list)  # the bfloat16 kernels of the rounds so far

    @property
    def fresh_tree_at(self) -> int | None:
        """The round that starts a fresh tree because released state was lost."""
        return self.start if self.lost else None


def _metrics_after_resume(logged: list[dict], rounds_done: int, released: list[dict],
                          spent: list[dict]) -> list[dict]:
    """Metrics of every released round: logged ones kept. A released round without one (a run
    or state of an older dpfleet, where the metrics were written after the release) gets a record
    rebuilt from its release and the replayed accountant (`spent`, the same numbers the round
    logged), so every reader finds the DP fields; its evaluation is gone (null)."""
    by_round = {m["round"]: m for m in logged}
    out = []
    for r, privacy in zip(released, spent, strict=True):
        stub = {"round": r["round"], "clients": len(r["participants"]), "clip": r["clip_norm"],
                "epsilon": privacy["epsilon"], "zcdp": privacy["zcdp"],
                "min_separation": privacy["min_separation"],
                "max_participation": privacy["max_participation"], "restart": r["restart"],
                "lost_in_crash": r["round"] > rounds_done, "rebuilt_after_crash": True,
                "accuracy": None, "loss": None}
        out.append(by_round.get(r["round"], stub))
    return out


def resume_run(run_path: Path, server: DPFTRLServer, estimator: QuantileClipEstimator | None,
               releases: ReleaseLog, participation: Participation, accountant: RunAccountant,
               users: Sequence[str], fingerprint: str, source: ResumeSource | None = None,
               *, guarantee: dict, precision: str = "float32") -> Resumed:
    """Restore the resume point, replay every released round, and start a fresh tree when
    released rounds were lost (module docstring); rewrites metrics/participation logs to match
    (with `source`, the state store's, nothing is rewritten: its logs commit with the release).
    `guarantee` is what this resume would run under (`guarantee.py`): every release record and
    the resume point must carry it, checked before anything is written."""
    released = releases.released_rounds()
    check_no_reuse(released)  # the log replayed must never have put one noise position on two sums
    for record in released:  # every release names the mechanism its noise came from
        bound = ({"name": record.get("mechanism", "tree"), "sha256": record["mechanism_sha256"]}
                 if record.get("mechanism_sha256") else None)
        check_bound(server.mechanism, bound, f"round {record['round']} of {releases.path}")
    for record in released:  # and the guarantee it was released under: this config's
        check_guarantee(guarantee, record.get("guarantee"), f"round {record['round']} of {releases.path}")
    if released and released[-1]["data_sha256"] != fingerprint:
        raise DpfleetError(f"{run_path} was trained on other client data (the tokenized training "
                           "clients or the tokenizer changed): resuming would mix two datasets")
    done, kernels = restore(run_path, server, estimator, source, guarantee=guarantee,
                            precision=precision)
    if len(released) < done:
        raise DpfleetError(f"{releases.path} has {len(released)} released rounds but the resume "
                           f"point has {done}: the release log was edited")
    if done and released[done - 1]["key_id"] != key_id(server.noise_key):
        raise DpfleetError(f"{run_path}: the resume point's noise key is not the one round {done} "
                           "was released with: the resume point belongs to another run")
    resumed = Resumed(start=len(released), rounds_done=done,
                      lost=[r["round"] for r in released[done:]], kernels=kernels)
    if resumed.lost:  # never reuse the lost rounds' nodes: a fresh tree from the saved model
        tree_id = releases.next_tree_id()
        server.round = resumed.start
        server.restart(estimator.estimate if estimator else None, tree_id=tree_id)
        if estimator is not None:
            estimator.restart(tree_id)
    entries = [{"round": r["round"] - 1, "devices": r["participants"], "restart": r["restart"]}
               for r in released]
    if source is not None:
        spent = replay(participation, accountant, entries, users, source.networked)
        resumed.metrics = _metrics_after_resume(source.metrics, done, released, spent)
        return resumed
    atomic_write(run_path / "participation.jsonl", "".join(dumps(e) + "\n" for e in entries))
    path = run_path / "metrics.jsonl"
    logged = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if len(logged) < done:  # the saved rounds must all be there
        raise DpfleetError(f"{path} has {len(logged)} rounds but the resume point has {done}")
    spent = replay(participation, accountant, entries, users)
    resumed.metrics = _metrics_after_resume(logged, done, released, spent)
    atomic_write(run_path / "metrics.jsonl", "".join(dumps(m) + "\n" for m in resumed.metrics))
    return resumed
