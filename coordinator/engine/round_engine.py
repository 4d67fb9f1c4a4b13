"""The transport-free round engine: everything a DP-FTRL round does at the coordinator.

Why a separate engine: the same rounds must run in-process (`simulation.run_simulation`, which
trains the clients itself) and, next, in a networked coordinator whose devices train remotely and
whose sums arrive as SecAgg messages. Both call the same phases, in the order of the one round
driver (`round_driver.drive`), so selection, the budget check, tree restarts, the release log
and the accounting cannot drift apart:

    plan = engine.open_round(before_round)   # selection, budget, restart -> RoundPlan | Stop
    ... the driver trains the plan's devices and aggregates their clipped deltas ...
    record = engine.close_round(plan, aggregate, client_stats)
        # DP-FTRL step -> participation commit -> accounting -> the round's metrics record (and
        # held-out evaluation when due) -> ONE commit of release + metrics (+ debug) records
        # (`ReleaseLog.record_release`, fsynced before return) -> participation log via the sink
    engine.save_resume_point(); engine.evaluate(); engine.finish(...)

The engine owns the secrets (the run's noise key, the tree) and the privacy state; it opens no
socket, starts no thread and trains nothing. Resume is a constructor path (`resume=True`): the
release log is replayed and released rounds are never recomputed (`release_log`, `resume`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dpfleet.coordinator.accounting.ledger import added_delta
from dpfleet.coordinator.accounting.privacy_report import render_privacy_report
from dpfleet.coordinator.accounting.zcdp import model_noise_multiplier
from dpfleet.coordinator.config import (
    SimulationConfig,
    check_delta,
    clip_count_stddev,
    projection_factor,
    resolve_noise,
    round_size,
)
from dpfleet.coordinator.engine.adaptive_clipping import QuantileClipEstimator, default_restart_rounds
from dpfleet.coordinator.engine.dp_ftrl import DPFTRLConfig, DPFTRLServer
from dpfleet.coordinator.engine.evaluation import evaluate
from dpfleet.coordinator.engine.keyboard_eval import keyboard_block
from dpfleet.coordinator.engine.participation import Participation, RoundUnfillable, Selection
from dpfleet.coordinator.engine.restore import resume_run, save_resume, save_server_state
from dpfleet.coordinator.mechanisms.base import Mechanism
from dpfleet.coordinator.mechanisms.noise_stream import key_id, new_noise_key, seeded_noise_key
from dpfleet.coordinator.mechanisms.registry import is_built_in
from dpfleet.coordinator.mechanisms.ring_noise import RingPlan, plan_ring
from dpfleet.coordinator.run_privacy.caveats import broken_reason, caveat_fields, with_caveats
from dpfleet.coordinator.run_privacy.projection import projection_summary
from dpfleet.coordinator.run_privacy.result_warnings import result_warnings
from dpfleet.coordinator.run_privacy.run_accountant import RunAccountant, conversion_for, run_privacy
from dpfleet.coordinator.state.guarantee import guarantee, guarantee_inputs
from dpfleet.coordinator.state.interrupts import interrupts_deferred, sigterm_interrupts
from dpfleet.coordinator.state.mechanism_binding import check_supported, run_mechanism
from dpfleet.coordinator.state.release_log import RELEASES, ReleaseLog, release_hash
from dpfleet.coordinator.state.resume import Frozen, ResumeSource, discard_resume
from dpfleet.coordinator.state.run_dir import RunDir, atomic_write, plot_accuracy
from dpfleet.coordinator.state.tensorboard_log import DEBUG_NONPRIVATE
from dpfleet.coordinator.state.trackers import open_trackers
from dpfleet.edge.tokenizer import oov_ids_of
from dpfleet.errors import DpfleetError
from dpfleet.export.checkpoint import save_checkpoint
from dpfleet.export.params import get_flat, set_flat
from dpfleet.secagg.encoding import Discretizer
from dpfleet.secagg.sums import AggregateResult

# secure aggregation's per-round counts that depend on the clients' data (not noised)
DATA_DEPENDENT_AGGREGATION = ("clipped_coordinates", "inputs_scaled_down", "count_out_of_range")


def restart_rounds(cfg: SimulationConfig, mechanism: Mechanism) -> list[int]:
    """Restart rounds of this run: the configured ones, or 128 + 1024 i with adaptive clipping on a
    mechanism that adopts a new clip norm only at restarts (the tree; matrix factorization adopts
    the estimate every round: no restarts)."""
    rounds = cfg.dp.restart_rounds
    if not rounds and cfg.dp.adaptive_clipping and not mechanism.adapts_every_round:
        rounds = default_restart_rounds(cfg.rounds)
    return sorted(r for r in set(rounds) if 0 < r < cfg.rounds)


def discrete_plan(cfg: SimulationConfig, dim: int, variance_factor: float | None = None) -> RingPlan:
    """The run's ring layout and discrete noise scale (`dp.noise = "discrete"`). The headroom is
    planned for `round_size` clients (the report goal plus the service's over-selection: the
    most devices one sum can hold); the noise is z Delta_s whatever the count, and DP-FTRL
    divides by the report goal as always. With adaptive clipping the model's share of the noise
    is z_delta (the clipped counts take the rest, as Gaussian noise added by the coordinator to
    the bounded count map: `adaptive_clipping`, Thm. 1; `count_bit.split_count`). Here, not in
    `ring_noise`: the noise layer takes the config's values as arguments (`plan_ring`)."""
    z = cfg.dp.noise_multiplier
    if cfg.dp.adaptive_clipping:
        z = model_noise_multiplier(z, clip_count_stddev(cfg))
    return plan_ring(dim, cfg.dp.clip_norm, cfg.aggregation.bits, round_size(cfg), z, cfg.rounds,
                     variance_factor=variance_factor)


def round_discretizer(cfg: SimulationConfig, dim: int, clip_norm: float, seed: int,
                      ring_clients: int | None = None) -> Discretizer:
    """THE discretizer of a SecAgg sum, for the noise calibration, `simulate`'s in-process sum
    and `serve`'s devices alike: the round's clip norm, `aggregation.bits`, and a per-client
    range sized for the most inputs one sum may hold, `ring_clients` (discrete noise's plan) or
    `round_size` (the report goal plus over-selection), so its scale is the same every round
    whoever drops. `seed` is the round's (`simulation.aggregation_seed`; 0 for the
    calibration, which reads only the scale)."""
    return Discretizer(dim, clip_norm, cfg.aggregation.bits, ring_clients or round_size(cfg), seed)


def sensitivity_factor(cfg: SimulationConfig, dim: int) -> float:
    """How much secure aggregation's discretization inflates one client's L2 contribution."""
    if cfg.aggregation.kind == "plain":
        return 1.0
    return round_discretizer(cfg, dim, cfg.dp.clip_norm, 0).norm_inflation


class RoundStateError(DpfleetError):
    """A phase called out of order: a plan that is not the open round's, or a second open."""


class ClientStats(Protocol):
    """What the engine reads of one client's report (edge/client_update.py:ClientUpdate)."""

    norm: float  # L2 norm before clipping (adaptive clipping's quantile)
    clipped: bool
    loss: float


@dataclass(frozen=True)
class RoundPlan:
    """What a round sends out: to whom, which model, under which clip norm."""

    round: int  # 0-based round index (record["round"] is round + 1)
    devices: list[int]  # selected devices (indices into the fleet), ascending
    device_ids: list[str]  # their user ids
    theta: np.ndarray  # the model to send (a copy; the engine keeps its own)
    theta_sha256: str  # content hash of `theta`, for content-addressed downloads
    clip_norm: float
    restart: bool  # the round starts a new noise tree
    selection: Selection
    # adaptive clipping: C^t, each device's bit is [||delta|| <= it] (None: fixed clipping)
    count_threshold: float | None = None


@dataclass(frozen=True)
class Stop:
    """Why no further round can be opened; returned, not raised (a normal end of a run)."""

    reason: str  # "unfillable" | "budget" | "done"
    message: str


class RunSink(Protocol):
    """Where the engine's participation log goes: a file here, checked against the committed
    rows in a service. (metrics / debug records are committed with the release itself.)"""

    def participation(self, entry: dict) -> None: ...


class RunDirSink:
    """participation.jsonl of a run directory (metrics.jsonl and debug_nonprivate.jsonl are
    written by the release log, with the release: `release_log` rule 4)."""

    def __init__(self, run: RunDir):
        self.run = run

    def participation(self, entry: dict) -> None:
        self.run.append("participation.jsonl", entry)


class RoundEngine:
    """One run's coordinator state and its round phases (module docstring)."""

    def __init__(self, cfg: SimulationConfig, run: RunDir, *, model, model_cfg, tokenizer,
                 users: Sequence[str], fingerprint: str, test_rows, sink: RunSink | None = None,
                 vocabulary: dict | None = None, resume: bool = False,
                 releases: ReleaseLog | None = None, resume_source: ResumeSource | None = None,
                 mechanism: Mechanism | None = None, other_releases: list[dict] | None = None,
                 keyboard_rows: np.ndarray | None = None, precision: str = "float32",
                 binding: Mapping[str, str] | None = None, kernels: str | None = None):
        """`model` is the initial model (and the one evaluated); `users` the fleet's user ids;
        `fingerprint` the training data's (`resume.data_fingerprint`); `vocabulary` the DP
        vocabulary's privacy summary, already spent. `resume=True` continues `run`.
        `releases` / `resume_source` replace the run directory's releases.jsonl and resume
        point (the SQLite state store, `store_engine.open_engine`). `mechanism`: a caller's noise
        mechanism in place of the config's `dp.mechanism` (`dpfleet.extensions`). `other_releases`:
        other DP releases about the same devices, which the caller may append to while the run goes
        (FreD statistics), composed into the run's privacy (`run_accountant.run_privacy`).
        `keyboard_rows`: held-out rows of other users than `test_rows`' (the unigram baseline's),
        whose word counts make the keyboard's most-frequent-word strip (`keyboard_eval`).
        `binding`: a run's config.json pin of its mechanism (`config_plan.RunPlan.binding`).
        `precision` / `kernels`: what the clients train at and, at bfloat16, the kernels that decide
        the bits (`backends.trainer_precision`), kept by resume points."""
        self.cfg, self.run, self.run_path = cfg, run, run.path
        self.sink = sink if sink is not None else RunDirSink(run)
        self.model, self.model_cfg, self.tokenizer = model, model_cfg, tokenizer
        # a list is copied; a lazy sequence (a memory-mapped store's ids) is kept as it is
        self.users = list(users) if isinstance(users, list) or not isinstance(users, Sequence) else users
        self.fingerprint, self.test_rows = fingerprint, test_rows
        self.vocabulary, self.keyboard_rows = vocabulary, keyboard_rows
        self.precision = precision  # the clients' (`client.precision` resolved): kept by resume points
        self.kernels = kernels
        # the bfloat16 kernels of every round so far, in order (a resume may bring others)
        self.kernels_used: list[str] = [kernels] if kernels else []
        self.kernels_changed = False
        self.other_releases = other_releases if other_releases is not None else []
        check_delta(cfg.dp.delta, len(self.users))  # the population is known from here on
        # the run's (eps, delta) is stated at dp.delta plus the vocabulary's and other releases'
        if added := added_delta(vocabulary, self.other_releases):
            check_delta(cfg.dp.delta + added, len(self.users),
                        "dp.delta + the DP vocabulary's and other releases' delta")
        self.participation = Participation(cfg.participation, len(self.users), cfg.dp.report_goal,
                                           cfg.rounds, cfg.seed, users=self.users, devices=cfg.devices)
        # the one noise mechanism of the run (banded / blt: optimised for the enforced
        # participation), bound to the run directory (`mechanism_binding`)
        self.mechanism, self.mechanism_optimised_for = run_mechanism(
            cfg, self.participation.min_separation, run.path, resume, mechanism, binding)
        check_supported(cfg, self.mechanism)
        noise_key = seeded_noise_key(cfg.dp.noise_seed) if cfg.dp.noise_seed >= 0 else new_noise_key()
        self._privacy_state(vocabulary, noise_key, custom=not is_built_in(self.mechanism))
        self.audit_break: dict | None = None  # `dpfleet audit --break`: {mode, what} (caveats.py)
        self.server = self._make_server(get_flat(model), noise_key)
        self.releases = releases if releases is not None else ReleaseLog(self.run_path / RELEASES)
        self.start, self.metrics, self.fresh_tree_at, self.lost = 0, [], None, []
        # round 0, while the server holds theta_0: where the run's accuracy starts from
        self.initial = self._starting_model(resume)
        if resume:  # released rounds are never redone (`release_log`)
            resumed = resume_run(self.run_path, self.server, self.estimator, self.releases,
                                 self.participation, self.accountant, self.users, fingerprint,
                                 resume_source, guarantee=self.guarantee, precision=precision)
            self.start, self.metrics = resumed.start, resumed.metrics
            # a resume with other kernels than the last rounds': said in the log and summary.json
            self.kernels_changed = bool(resumed.kernels and kernels and resumed.kernels[-1] != kernels)
            self.kernels_used = resumed.kernels + ([kernels] if self.kernels_changed else [])
            self.fresh_tree_at, self.lost = resumed.fresh_tree_at, resumed.lost
        self.next_round = self.start  # 0-based index of the round open_round opens next
        self._open: RoundPlan | None = None
        # the server and estimator as the last release left them, while a round is open (what
        # Ctrl-C saves: `save_interrupted`), and the rounds the resume point on disk holds
        self._before_open: tuple[int, Frozen, Frozen | None] | None = None
        self._saved_at = self.start
        self._run_dir_points = releases is None  # not the state store's (it commits every round)
        # `tensorboard` / `wandb` / `mlflow = true`: the records to those trackers, the rounds so far first
        self.trackers = open_trackers(cfg, self.run_path, self.metrics)

    def _privacy_state(self, vocabulary: dict | None, noise_key: bytes, *, custom: bool) -> None:
        """The accountant, restarts, model noise multiplier, clip estimator and guarantee."""
        cfg = self.cfg
        # a projection's one factor (`[projection]`): the server adds z C M_train / M_noise to the
        # sum, and the run's own guarantee is accounted at that noise (`run_privacy/projection.py`)
        self.noise_scale = projection_factor(cfg)
        self.accountant = RunAccountant(
            cfg.dp.noise_multiplier * self.noise_scale, cfg.dp.delta, cfg.dp.budget_epsilon,
            vocabulary=vocabulary, mechanism=self.mechanism,
            count_stddev=clip_count_stddev(cfg) if cfg.dp.adaptive_clipping else None,
            conversion=conversion_for(cfg, type(self.mechanism), custom), declared=custom)
        self.accountant.check_first_round()  # a budget no round fits: an error, not 0 rounds
        self.restarts = restart_rounds(cfg, self.mechanism)
        self.z_model, self.estimator = cfg.dp.noise_multiplier, None
        if cfg.dp.adaptive_clipping:
            self.z_model = model_noise_multiplier(cfg.dp.noise_multiplier, clip_count_stddev(cfg))
            self.estimator = QuantileClipEstimator(
                cfg.dp.clip_norm, cfg.dp.report_goal, target_quantile=cfg.dp.target_quantile,
                learning_rate=cfg.dp.clip_lr, count_stddev=clip_count_stddev(cfg),
                noise_key=noise_key, mechanism=self.mechanism,
            )
        # what every release and resume point is bound to, and a resume checked against
        # (`guarantee`): the config as it runs (the planner's z in it), with what was derived
        self.guarantee = guarantee(guarantee_inputs(
            cfg, mechanism=self.mechanism, population=len(self.users), restarts=self.restarts,
            model_noise_multiplier=self.z_model * self.noise_scale, vocabulary=vocabulary))

    def _make_server(self, theta0: np.ndarray, noise_key: bytes) -> DPFTRLServer:
        """The DP-FTRL server at theta_0 (and, with `dp.noise = "discrete"`, the ring plan of the
        integer tree noise added to the SecAgg ring sum: `self.ring`)."""
        cfg = self.cfg
        self.ring = None
        if resolve_noise(cfg) == "discrete":
            self.ring = discrete_plan(cfg, theta0.size, self.mechanism.ring_variance_factor())
        return DPFTRLServer(
            theta0,
            DPFTRLConfig(
                noise_multiplier=self.z_model, clip_norm=cfg.dp.clip_norm,
                report_goal=cfg.dp.report_goal, server_lr=cfg.dp.server_lr,
                momentum=cfg.dp.momentum, restart_rounds=tuple(self.restarts),
                sensitivity_factor=sensitivity_factor(cfg, theta0.size), mechanism=self.mechanism,
                noise_scale=self.noise_scale,
            ),
            noise_key=noise_key, ring=self.ring,
        )

    def _starting_model(self, resume: bool) -> dict | None:
        """Round 0: the starting model's held-out evaluation, in initial_eval.json (atomically) when
        the run starts; a resumed run reads it back, so it shows what the run started from even when
        its model was rebuilt. Not a metrics.jsonl line: that log is one record per released
        round (the release log, resume and replay count on it), and round 0 releases nothing.
        None without held-out rows."""
        saved = self.run.initial() if resume else None
        if saved is not None or self.test_rows is None or not len(self.test_rows):
            return saved
        training = self.model.training
        try:  # scored as every round is (`evaluate`), on theta_0: called before a resume restores
            evaluation = self.evaluate()
        finally:
            self.model.train(training)  # a module the trainer shares keeps its mode
        return self.run.write_initial(evaluation)

    def open_round(self, before_round: Callable[[int, np.ndarray], np.ndarray | None] | None = None,
                   *, available: Sequence[int] | None = None, extra: int = 0) -> RoundPlan | Stop:
        """Select the next round's devices, check the budget, restart the tree where due.

        `before_round(r, theta)` may return a replacement theta (public training between private
        rounds: post-processing); the plan carries the model after it. A networked coordinator
        selects among the devices that checked in (`available`) plus `extra` over-selected ones.
        """
        if self._open is not None:
            raise RoundStateError(f"round {self._open.round + 1} is open: close it first")
        r, cfg = self.next_round, self.cfg
        if r >= cfg.rounds:
            return Stop("done", f"all {cfg.rounds} rounds are done")
        restart = r in self.restarts or r == self.fresh_tree_at
        try:
            selection = self.participation.propose(
                r, None if available is None else np.asarray(available, dtype=np.int64), extra)
        except RoundUnfillable as exc:
            return Stop("unfillable", f"stopped before round {r + 1}: {exc}")
        chosen = selection.devices
        if self.accountant.would_exceed([self.users[i] for i in chosen], restart):
            return Stop("budget", f"stopped before round {r + 1}: it would pass the privacy budget "
                                  f"eps = {cfg.dp.budget_epsilon:g} at delta = {cfg.dp.delta:g}")
        server, estimator = self.server, self.estimator
        if self._before_open is None:  # before this round moves anything (a restart, public theta)
            self._before_open = (r, *self._frozen())
        if restart and estimator is not None and server.tree.t > 0:  # estimate -> clip norm
            server.restart(estimator.estimate)
            estimator.restart()
        if estimator is not None and self.mechanism.adapts_every_round:  # C_t from earlier releases
            server.clip_norm = estimator.estimate
        public_update = before_round(r, server.theta) if before_round else None
        if public_update is not None:
            server.theta = np.asarray(public_update, dtype=np.float32).copy()
        theta = server.theta.copy()
        self._open = RoundPlan(r, list(chosen), [self.users[i] for i in chosen], theta,
                               release_hash(theta), server.clip_norm, restart, selection,
                               estimator.estimate if estimator is not None else None)
        return self._open

    def abandon_round(self, plan: RoundPlan) -> None:
        """The open round failed before its DP step (too few reports or survivors by the
        deadline): nothing was released and no noise was drawn, so the same round number is
        opened again by the next `open_round`."""
        if self._open is None or plan is not self._open:
            raise RoundStateError(f"round {plan.round + 1} is not the open round: only the open "
                                  "round can be abandoned")
        self._open = None

    def _check_close(self, plan: RoundPlan, aggregate: AggregateResult,
                     client_stats: Sequence[ClientStats]) -> None:
        if self._open is None or plan is not self._open:
            state = f"round {self._open.round + 1} is open" if self._open else "no round is open"
            raise RoundStateError(f"a sum for round {plan.round + 1} was handed in but {state}: "
                                  "a round is closed once, by the plan it was opened with")
        if len(client_stats) != len(plan.devices):
            raise RoundStateError(f"round {plan.round + 1} selected {len(plan.devices)} devices but "
                                  f"{len(client_stats)} client reports were handed in")
        if not set(aggregate.survivors) <= set(range(len(plan.devices))):
            raise RoundStateError(f"round {plan.round + 1}: survivors {aggregate.survivors} are not "
                                  "positions in the plan's device list")
        count = aggregate.clipped_count
        if count is not None and not 0 <= count <= len(aggregate.survivors):
            raise RoundStateError(f"round {plan.round + 1}: clipped count {count} is not in "
                                  f"[0, {len(aggregate.survivors)}] (the survivors)")
        if np.shape(aggregate.total) != self.server.theta.shape:
            raise RoundStateError(f"round {plan.round + 1}: the sum has shape "
                                  f"{np.shape(aggregate.total)}, the model {self.server.theta.shape}")

    def close_round(self, plan: RoundPlan, aggregate: AggregateResult,
                    client_stats: Sequence[ClientStats]) -> dict:
        """Step, account, build the round's metrics record (evaluating when due), then commit
        release + records in one step (fsynced before this returns), then the participation log.
        A Ctrl-C meanwhile acts once all of it is done (`interrupts`): the live state never
        moves past the release log.

        `client_stats[i]` is the report of `plan.devices[i]`; `aggregate.survivors` are the
        positions whose deltas are in the sum (dropped devices contributed nothing).
        """
        with interrupts_deferred():
            return self._close_round(plan, aggregate, client_stats)

    def _close_round(self, plan: RoundPlan, aggregate: AggregateResult,
                     client_stats: Sequence[ClientStats]) -> dict:
        self._check_close(plan, aggregate, client_stats)
        cfg, server, estimator = self.cfg, self.server, self.estimator
        r, restart, chosen = plan.round, plan.restart, plan.devices
        server.step(aggregate.total if self.ring is None else aggregate.ring)
        self._open, self.next_round = None, r + 1  # the nodes are spent: never reopen this round
        in_sum = [chosen[i] for i in aggregate.survivors]
        self.participation.commit(plan.selection, in_sum)
        spent = self.accountant.record([self.users[i] for i in in_sum], restart)
        clip = server.clip_norm
        if estimator is not None and aggregate.clipped_count is not None:  # summed in SecAgg
            estimator.update_count(aggregate.clipped_count, len(aggregate.survivors))
        elif estimator is not None:
            estimator.update([client_stats[i].norm for i in aggregate.survivors])
        selection = plan.selection
        record = {
            "round": r + 1,
            "clients": len(in_sum),
            "clip": clip,
            "noise_std": server.noise_std,
            "epsilon": spent["epsilon"],  # privacy.json's conversion (PLD for Gaussian noise), worst
            # case over the observed MinS / MaxP so far: the last round's is the report's eps
            "zcdp": spent["zcdp"],
            "min_separation": spent["min_separation"],
            "max_participation": spent["max_participation"],
            "restart": restart,
            "clock_hours": self.participation.hours(selection.slot),
            "waited_hours": self.participation.hours(selection.waited_slots),
            "refused": selection.refused,
            **selection.outcome(),  # timer mode: selected, failed, missed the deadline, over the goal
            "accuracy": None,
            "loss": None,
        }
        if estimator is not None:
            record["clip_estimate"] = estimator.estimate
        if aggregate.info:  # secure aggregation's costs and guarantees (`round_sum.record`), scalars
            # only; a null is a cost the driver cannot see (serve: the devices' encoding time)
            record["aggregation"] = {
                k: v for k, v in aggregate.info.items()
                if (v is None or isinstance(v, int | float | str | bool))
                and k not in DATA_DEPENDENT_AGGREGATION
            }
        if (r + 1) % cfg.eval_every == 0 or r + 1 == cfg.rounds:  # in-process: nothing leaves
            ev = self.evaluate()
            record.update(accuracy=ev["accuracy"], loss=ev["loss"], perplexity=ev["perplexity"],
                          **{k: v for k, v in ev.items() if k.startswith("tff_")})
        logs = {"metrics": record}
        if cfg.debug_nonprivate:  # un-noised, over this round's few clients: not DP
            logs["debug_nonprivate"] = {
                "round": r + 1,
                "train_loss": float(np.mean([u.loss for u in client_stats])),
                "mean_update_norm": float(np.mean([u.norm for u in client_stats])),
                "clipped_fraction": float(np.mean([u.clipped for u in client_stats])),
                **{k: aggregate.info[k] for k in DATA_DEPENDENT_AGGREGATION if k in aggregate.info},
            }
        # the commit: release and its records at once (durable before anything of round r + 1
        # leaves the engine), so a crash never leaves a released round without its metrics
        self.releases.record_release(
            round=r + 1, tree_id=server.tree.tree_id, t=server.tree.t, key_id=key_id(server.noise_key),
            participants=[self.users[i] for i in in_sum], restart=restart, clip_norm=clip,
            released=release_hash(server.theta, estimator.estimate if estimator else None),
            data_sha256=self.fingerprint, logs=logs,
            mechanism=self.mechanism.name, mechanism_sha256=self.mechanism.fingerprint(),
            guarantee=self.guarantee,
        )
        self._before_open = None  # released: the live state is the last release's
        self.metrics.append(record)
        self.trackers.round(logs)
        self.sink.participation(
            {"round": r, "devices": [self.users[i] for i in in_sum], "restart": restart})
        return record

    def resume_point_due(self) -> bool:
        """Whether the config asks for a resume point after the rounds closed so far (never with
        the state store, which commits every round: `store_engine`)."""
        done, every = self.next_round, self.cfg.checkpoint_every
        return self._run_dir_points and bool(every) and done % every == 0 and 0 < done < self.cfg.rounds

    def save_resume_point(self) -> None:
        """Atomically replace the resume point with the state after the rounds closed so far."""
        if self._open is not None:
            raise RoundStateError(f"round {self._open.round + 1} is open: a resume point is taken "
                                  "between rounds")
        with interrupts_deferred():
            save_resume(self.run_path, self.next_round, self.server, self.estimator, self.guarantee,
                        self.precision, self.kernels_used)
            self._saved_at = self.next_round

    def _frozen(self) -> tuple[Frozen, Frozen | None]:
        """The server and estimator now, for a resume point written later: copies of theta and
        momentum (a round's step changes them in place); the live noise nodes are never changed
        in place (a tree pushes and pops them), so they are shared."""
        state = self.server.state_dict()
        state = {**state, "theta": state["theta"].copy(), "momentum": state["momentum"].copy()}
        server = Frozen(state, self.server.mechanism, self.server.noise_key)
        return server, None if self.estimator is None else Frozen(self.estimator.state_dict())

    def save_interrupted(self) -> int | None:
        """After Ctrl-C / SIGTERM: make the resume point hold the last released round, so a
        resumed run loses nothing. A round that was open had released nothing: the point is
        the state before it opened, and the resumed run opens it again (same devices, same
        noise). Returns the rounds the point holds now, or None when it was already current."""
        if not self._run_dir_points:
            return None
        released = len(self.releases.released_rounds())
        if released <= self._saved_at:  # nothing released since the point on disk (or since a
            return None  # resume that lost rounds: its point and log already say what to redo)
        if self._before_open is not None and self._before_open[0] == released:
            server, estimator = self._before_open[1:]
        elif self._before_open is None and self._open is None and self.next_round == released:
            server, estimator = self.server, self.estimator
        else:  # cannot happen while close_round defers interrupts; never save a mixed state
            return None
        with interrupts_deferred():  # a second Ctrl-C does not cut the point in two
            save_resume(self.run_path, released, server, estimator, self.guarantee, self.precision,
                        self.kernels_used)
            self._saved_at = released
        return released

    @contextmanager
    def resume_point_on_interrupt(self) -> Iterator[None]:
        """Around a driver's rounds: Ctrl-C or SIGTERM (`interrupts`) first brings the resume
        point to the last released round (`save_interrupted`), then goes on as KeyboardInterrupt.
        The trackers are told how the run ended (KILLED, or FAILED on an exception), not left
        with a run that looks alive."""
        with sigterm_interrupts():
            try:
                yield
            except KeyboardInterrupt:
                self.save_interrupted()
                self.trackers.close("KILLED")
                raise
            except Exception:
                self.trackers.close("FAILED")
                raise

    def evaluate(self) -> dict:
        """Held-out accuracy / loss / perplexity of the current (released) model."""
        set_flat(self.model, self.server.theta)
        return evaluate(self.model, self.test_rows, oov_ids=oov_ids_of(self.tokenizer))

    def keyboard(self) -> dict | None:
        """The current model's suggestion strip on sampled held-out words, next to the
        most-frequent-word strip (`keyboard_eval.keyboard_block`; None when there is nothing to
        score). Call after `evaluate`, which loads the released weights into the model."""
        return keyboard_block(self.model, self.tokenizer, self.test_rows, words=self.cfg.data.keyboard_words,
                              seed=self.cfg.seed, seq_len=self.cfg.data.seq_len,
                              fit_rows=self.keyboard_rows)

    def privacy(self, *, stopped_early: str | None = None, public_data: Sequence[str] = (),
                committed: Sequence[dict] | None = None) -> dict:
        """The run's privacy summary now (`run_accountant.run_privacy`): privacy.json's content,
        what the report renders. `committed`: release records to account instead of the engine's
        own accountant (the service's live report, from its committed rows)."""
        accountant = self.accountant
        if committed is not None:
            accountant = accountant.fresh()
            for record in committed:
                accountant.record(record["participants"], record["restart"])
        return with_caveats(run_privacy(self.cfg, self.participation, accountant, len(self.users),
                           model_noise_multiplier=self.z_model * self.noise_scale,
                           stopped_early=stopped_early,
                           optimised_for=self.mechanism_optimised_for, vocabulary=self.vocabulary,
                           public_data=list(public_data), ring=self.ring,
                           debug_file=(self.run_path / DEBUG_NONPRIVATE).is_file(),
                           releases=self.other_releases), self.audit_break)

    def finish(self, *, stopped_early: str | None, baseline: dict, public_data: Sequence[str] = (),
               started: float, extra: dict | None = None) -> tuple[dict, dict]:
        """Final evaluation, checkpoint, privacy report, plot and summary; drops the resume point
        (and with it the key). `started` is the run's `time.perf_counter()` start; `extra` goes
        into summary.json. Returns (final evaluation, privacy report). Ctrl-C meanwhile leaves a
        resume point after the last round (`resume_point_on_interrupt`): `--resume` finishes."""
        with self.resume_point_on_interrupt():
            return self._finish(stopped_early=stopped_early, baseline=baseline,
                                public_data=public_data, started=started, extra=extra)

    def _finish(self, *, stopped_early: str | None, baseline: dict, public_data: Sequence[str],
                started: float, extra: dict | None) -> tuple[dict, dict]:
        cfg, run_path = self.cfg, self.run_path
        final = self.evaluate()
        keyboard = self.keyboard()
        privacy = self.privacy(stopped_early=stopped_early, public_data=public_data)
        save_checkpoint(run_path / "checkpoint", self.model, self.model_cfg, self.tokenizer,
                        not_private=self.audit_break and broken_reason(self.audit_break),
                        caveats=privacy["caveats"])  # they travel with the weights (export's gate)
        save_server_state(run_path / "checkpoint", self.server,  # positions only, no key
                          self.estimator.state_dict() if self.estimator else None)
        self.run.write_json("privacy.json", privacy)
        atomic_write(run_path / "privacy_report.md", render_privacy_report(privacy))
        title = (f"held-out accuracy, eps = {privacy['epsilon']:.2f} at delta = {cfg.dp.delta:g}"
                 if np.isfinite(privacy["epsilon"]) else "held-out accuracy, no DP guarantee")
        if "projection" in privacy:  # both eps, each saying which it is
            q = privacy["projection"]
            title += (f" (this run's own); projected eps = {q['epsilon']:.2f} at N = "
                      f"{q['population']:,}, a simulation")
        plot_accuracy(self.metrics, baseline["accuracy"], run_path / "accuracy.png", title, self.initial)
        summary = {
            **caveat_fields(privacy),  # first: whether the run is fully private, and if not why
            "warnings": result_warnings(cfg, final, baseline, privacy),  # a result that means nothing
            "initial": self.initial, "final": final, "unigram_baseline": baseline,
            "wall_seconds": time.perf_counter() - started, "parameters": int(self.server.theta.size),
            "rounds_completed": len(self.metrics), "stopped_early": stopped_early,
            "simulated_hours": self.participation.hours(self.participation.slot),
            **round_totals(self.metrics),
            "resumed_after_round": self.start or None,
            "rounds_lost_in_crash": self.lost,
            # which noise, and whether the guarantee needs every participant honest
            **{k: privacy[k] for k in ("noise_mechanism", "honest_participants_only",
                                       "honest_participants_only_statement") if k in privacy},
            **({"keyboard": keyboard} if keyboard else {}),
            # a projection: the projected eps and the run's own, each saying which it is
            **({"projection": projection_summary(privacy)} if "projection" in privacy else {}),
            **(extra or {}),
        }
        self.run.write_json("summary.json", summary)
        if keyboard:  # the final model's strip, at the last round's step
            strips = {k: v for k, v in keyboard.items() if isinstance(v, dict)}
            self.trackers.round({"metrics": {"round": self.metrics[-1]["round"] if self.metrics else 0,
                                             "keyboard": strips}})
        self.trackers.close()
        discard_resume(run_path)
        return final, privacy


def round_totals(metrics: Sequence[dict]) -> dict:
    """summary.json's totals of how timer-mode rounds closed (`Selection.outcome`; {} in other
    modes): rounds committed and abandoned, and what became of the devices the committed rounds
    selected (an abandoned attempt's devices are counted apart: `abandoned_selected`)."""
    timed = [m for m in metrics if "selected" in m]
    if not timed:
        return {}
    total = {k: sum(m[k] for m in timed) for k in ("selected", "failed", "missed_deadline",
                                                  "over_goal", "committed", "abandoned",
                                                  "abandoned_selected")}
    selected = total["selected"]
    return {"round_close": {
        "rounds_committed": len(timed), "rounds_abandoned": total["abandoned"],
        "selected": selected, "committed": total["committed"], "failed": total["failed"],
        "missed_deadline": total["missed_deadline"], "over_goal": total["over_goal"],
        "abandoned_selected": total["abandoned_selected"],
        "missed_deadline_fraction": total["missed_deadline"] / selected if selected else 0.0,
        "mean_round_minutes": sum(m["round_duration_minutes"] for m in timed) / len(timed),
    }}


def round_close_line(closes: dict) -> str:
    """The run log's line on how rounds closed (`round_totals`' "round_close")."""
    selected = closes["selected"] or 1

    def share(k: str) -> str:
        return f"{closes[k] / selected:.0%}"

    return (f"rounds: {closes['rounds_committed']} committed, {closes['rounds_abandoned']} abandoned; of "
            f"{closes['selected']} devices selected, {share('missed_deadline')} missed the deadline, "
            f"{share('over_goal')} finished over the goal, {share('failed')} failed; rounds took "
            f"{closes['mean_round_minutes']:.1f} simulated minutes on average")
