"""Canary devices for `dpfleet audit`: one real run of a config with canaries in its fleet, scored.

Why canaries inside the run: the accountant proves epsilon from the mechanism's arithmetic, so a
bug in clipping, noise, participation or aggregation goes unseen as long as the arithmetic holds.
An audit measures what the released model actually reveals about devices the auditor planted:

* gradient canaries (Andrew et al., ICLR 2024; Steinke, Nasr, Jagielski, NeurIPS 2023): 2N unit
  directions in model space, each from the audit's secret key; each is INSERTED with probability
  1/2 (the Steinke coin) as a device whose update is its direction times `CANARY_NORM` clip
  norms (clipping brings it to exactly C, the most any device can move the sum; with clipping
  broken it stays 100x larger; at 1000x the canaries wrecked the tests' model, whose real
  updates then grew larger still and hid them).
  The others, plus `null_directions` more never drawn for any device, are the unobserved null.
  Scores: the cosine of theta_T - theta_0 with each direction (the paper's one-shot, final-model
  score), and the max over rounds of the cosine of each released change theta_t - theta_{t-1}
  (their all-iterates score: every release of DP-FTRL is public, so an adversary may look at each
  round, where a canary is not diluted by every other round's updates). Never-inserted directions
  are scored the same two ways, so under "not inserted" a direction's score has the null's law.
* text canaries (Carlini et al., "The Secret Sharer", 2019): devices whose only data is "my
  secret code is" + random tokens, trained like any device; exposure = rank of the secret's
  log-perplexity among `references` random secrets of the same format, in bits. As many secrets
  are drawn and never inserted: their exposure is the null reference.

Canaries are extra devices (`users` appends them after the real ones): the participation
policy, timers, MinS / MaxP guard, clipping, noise and secure aggregation treat them like any
device, so the run's accounting is the accounting of the config with a slightly larger fleet.
They hold no held-out data, so evaluation only scores real users. Broken modes (`BROKEN`) exist
only here, to show the audit can fail: they are applied to the engine after it is built and are
written loudly into audit.json and the report.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dpfleet.coordinator.accounting.privacy_report import render_privacy_report
from dpfleet.coordinator.config_overrides import with_values
from dpfleet.coordinator.engine.simulation import derive_seed
from dpfleet.edge.client_data import to_rows
from dpfleet.edge.client_update import ClientUpdate
from dpfleet.edge.clipping import clip_l2
from dpfleet.edge.model_output import logits_of
from dpfleet.errors import DpfleetError
from dpfleet.export.params import set_flat
from dpfleet.io import atomic_write, private_mkdir
from dpfleet.jsonio import write_json

# deliberately broken runs, for the tests and benchmark that show the audit can fail
BROKEN = {
    "noise-off": "noise switched off (--break noise-off): the accountant still reports the configured z",
    "clipping": "clipping disabled (--break clipping): updates enter the sum at their full norm",
    "noise-div-10": "noise scaled down 10x (--break noise-div-10): the accountant still reports the "
                    "configured z",
}
NOISE_SCALE = {"noise-off": 0.0, "noise-div-10": 0.1}
CANARY_NORM = 100.0  # a gradient canary's raw update, in clip norms (clipped to exactly C)
CANARY_PREFIX = "audit-canary-"
SECRET_FORMAT = "my secret code is"


@dataclass(frozen=True)
class AuditSettings:
    """What `dpfleet audit` plants and how it scores (CLI flags)."""

    canaries: int = 256  # N: 2N gradient directions are drawn, each inserted with probability 1/2
    text_canaries: int = 4  # secret-sharer devices (and as many never-inserted control secrets)
    confidence: float = 0.95
    broken: str | None = None  # a key of BROKEN, or None for an honest audit
    null_directions: int = 1000  # extra never-inserted directions for the null distribution
    references: int = 2000  # random secrets each text canary is ranked against
    secret_tokens: int = 6
    text_copies: int = 8  # rows of the secret in a text canary's data
    bootstrap: int = 1000

    def check(self) -> None:
        """Every setting a user can give, refused in one line."""
        checks = [
            (self.canaries >= 1, f"--canaries must be >= 1, got {self.canaries}"),
            (self.text_canaries >= 0, f"--text-canaries must be >= 0, got {self.text_canaries}"),
            (0.5 < self.confidence < 1, f"--confidence must be in (0.5, 1), got {self.confidence}"),
            (self.broken is None or self.broken in BROKEN,
             f"broken mode must be one of {sorted(BROKEN)}, got {self.broken!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise DpfleetError(message)


@dataclass
class CanaryScores:
    """One audited run's raw scores (the estimators' inputs)."""

    scores: np.ndarray  # cosine of theta_T - theta_0 with each of the 2N directions
    inserted: np.ndarray  # bool per direction: the Steinke coin
    null: np.ndarray  # cosines with directions never drawn for any device
    in_sum: np.ndarray  # bool per direction: an inserted canary whose update reached a sum
    exposure: list[float] = field(default_factory=list)  # inserted text canaries, bits
    null_exposure: list[float] = field(default_factory=list)  # never-inserted secrets, bits
    text_in_sum: int = 0
    scored_rounds: int = 0  # rounds in the scored model (fewer: the final one was not finite)
    round_scores: np.ndarray | None = None  # max over releases of the cosine of each release's change
    round_null: np.ndarray | None = None  # the same for the never-drawn directions
    exposure_note: str | None = None  # why there is no exposure (a diverged model)

    @property
    def observed(self) -> np.ndarray:
        return self.scores[self.inserted]

    @property
    def unobserved(self) -> np.ndarray:
        return np.concatenate([self.scores[~self.inserted], self.null])

    def all_rounds(self) -> CanaryScores:
        """These scores with the all-iterates score in place of the final-model one."""
        return CanaryScores(self.round_scores, self.inserted, self.round_null, self.in_sum)


class CanaryRun:
    """The `audit` hooks of `simulation.run_simulation` for one run (module docstring).

    `key` is the audit's secret (fresh from the OS per run): the canary directions, the coins and
    the secrets derive from it, and it is never written anywhere.
    """

    def __init__(self, settings: AuditSettings, key: bytes | None = None):
        settings.check()
        self.settings = settings
        self.key = os.urandom(32) if key is None else key
        self.inserted = self._rng("coin").random(2 * settings.canaries) < 0.5
        self.gradient = np.flatnonzero(self.inserted)  # the direction of each gradient device
        self.base = self.engine = self.theta0 = None
        self.last_finite: tuple[int, np.ndarray] | None = None  # (rounds in it, released model)
        self.releases: list[np.ndarray] = []  # theta_1, theta_2, ...: every finite release before the last
        self.text_rows: list[np.ndarray] = []
        self.secret_ids: list[list[int]] = []  # inserted secrets, then the control secrets

    def _rng(self, *parts: object) -> np.random.Generator:
        digest = hashlib.sha256(self.key + repr(parts).encode()).digest()
        return np.random.default_rng(int.from_bytes(digest, "little"))

    # --- the hooks run_simulation calls -----------------------------------------------------
    def users(self, real: object) -> list[str]:
        """The fleet's user ids: the real ones, then the gradient canaries, then the text ones."""
        ids = list(real)
        self.base = len(ids)
        return ids + [f"{CANARY_PREFIX}g{j:04d}" for j in self.gradient] + [
            f"{CANARY_PREFIX}t{k:02d}" for k in range(self.settings.text_canaries)]

    def engine_ready(self, engine) -> None:
        """Remember theta_0, build the secrets with the run's tokenizer, break what is asked."""
        self.engine = engine
        self.theta0 = engine.server.theta.astype(np.float64)
        if self.settings.broken in NOISE_SCALE:
            engine.server.audit_noise_scale = NOISE_SCALE[self.settings.broken]
        if self.settings.broken:  # the run then states no eps, and its checkpoint does not export
            engine.audit_break = {"mode": self.settings.broken, "what": BROKEN[self.settings.broken]}
        self._make_secrets(engine.tokenizer, engine.cfg.data.seq_len)

    def clip_bound(self, plan) -> float:
        """The norm the driver checks each update against: the plan's clip norm, or none with
        --break clipping (a per-update check exists only in simulation: under SecAgg a deployed
        server never sees one device's update, so a device-side clipping bug goes through)."""
        return float("inf") if self.settings.broken == "clipping" else plan.clip_norm

    def train_plan(self, cfg, trainer, population, plan) -> list[ClientUpdate]:
        """The plan's updates in device order: real and text-canary devices trained by the run's
        trainer (seeds as `simulation.train_plan`), gradient canaries built from their direction."""
        clip = float("inf") if self.settings.broken == "clipping" else plan.clip_norm
        if np.isfinite(plan.theta).all():  # a broken run may diverge: score its last finite release
            self.last_finite = (plan.round, plan.theta)
            if plan.round >= 1:
                self.releases.append(np.array(plan.theta, dtype=np.float32))
        out: list[ClientUpdate | None] = [None] * len(plan.devices)
        trained, rows = [], []
        for pos, i in enumerate(plan.devices):
            k = i - self.base
            if k < 0:
                trained.append(pos)
                rows.append(population.examples(i))
            elif k >= len(self.gradient):
                trained.append(pos)
                rows.append(self.text_rows[k - len(self.gradient)])
            else:
                raw = self.direction(int(self.gradient[k])) * (CANARY_NORM * plan.clip_norm)
                delta, norm = clip_l2(raw.astype(np.float32), clip)
                out[pos] = ClientUpdate(delta, norm, norm > clip, 0.0, 0)
        if trained:
            updates = trainer.train_round(
                plan.theta, rows, [derive_seed(cfg.seed, plan.round, plan.devices[p]) for p in trained],
                lr=cfg.client.lr, batch_size=cfg.client.batch_size, clip_norm=clip)
            for pos, update in zip(trained, updates, strict=True):
                out[pos] = update
        return out  # type: ignore[return-value]

    # --- canaries -----------------------------------------------------------------------------
    def direction(self, j: int) -> np.ndarray:
        """Canary direction j: a uniformly random unit vector in model space (float64)."""
        v = self._rng("direction", j).standard_normal(self.theta0.size)
        return v / np.linalg.norm(v)

    def _make_secrets(self, tokenizer, seq_len: int) -> None:
        s = self.settings
        rng = self._rng("secrets")
        digits = [ids[0] for d in "0123456789" if len(ids := tokenizer.encode(d)) == 1]
        self.alphabet = np.array(sorted(set(digits)), dtype=np.int64)
        if self.alphabet.size < 8:  # a tokenizer that splits digits: random ordinary tokens
            self.alphabet = rng.choice(np.arange(4, tokenizer.vocab_size), 10, replace=False)
        room = seq_len - s.secret_tokens
        if room < 0 and s.text_canaries:
            raise DpfleetError(f"data.seq_len = {seq_len} is shorter than a text canary's "
                               f"{s.secret_tokens} secret tokens: use --text-canaries 0")
        self.prefix = list(tokenizer.encode(SECRET_FORMAT))[:max(room, 0)]
        secrets = rng.choice(self.alphabet, (2 * s.text_canaries, s.secret_tokens))
        self.secret_ids = [list(map(int, row)) for row in secrets]
        self.text_rows = [np.repeat(to_rows([self.prefix + sec], seq_len), s.text_copies, axis=0)
                          for sec in self.secret_ids[:s.text_canaries]]

    # --- scoring --------------------------------------------------------------------------------
    def score(self, participants: dict[str, int]) -> CanaryScores:
        """Scores of the finished run (theta_T = the last released model). `participants`: user
        id -> round whose released sum held its update (`participants`)."""
        s = self.settings
        rounds, theta = self.scored_model()
        # row 0: theta_T - theta_0 (final model); rows 1..: each release's change (all iterates)
        models = [self.theta0, *(r for r in self.releases[:max(rounds - 1, 0)]), theta]
        changes = np.stack([theta.astype(np.float64) - self.theta0,
                            *(np.diff(np.stack(models).astype(np.float64), axis=0))])
        sizes = np.linalg.norm(changes, axis=1, keepdims=True)
        units = np.divide(changes, sizes, out=np.zeros_like(changes), where=sizes > 0)
        cos = np.array([units @ self.direction(j) for j in range(2 * s.canaries)])
        null_cos = np.empty((s.null_directions, len(units)))
        rng, chunk = self._rng("null"), 64
        for start in range(0, s.null_directions, chunk):  # never drawn for any device
            block = rng.standard_normal((min(chunk, s.null_directions - start), units.shape[1]))
            null_cos[start:start + len(block)] = (block @ units.T) / np.linalg.norm(block, axis=1)[:, None]
        scores, null = cos[:, 0], null_cos[:, 0]
        def scored(user: str) -> bool:  # its update is in the scored model
            return participants.get(user, rounds) < rounds

        in_sum = np.zeros(2 * s.canaries, dtype=bool)
        for j in self.gradient:
            in_sum[j] = scored(f"{CANARY_PREFIX}g{j:04d}")
        out = CanaryScores(scores, self.inserted.copy(), null, in_sum, scored_rounds=rounds,
                           round_scores=cos[:, 1:].max(axis=1), round_null=null_cos[:, 1:].max(axis=1),
                           text_in_sum=sum(scored(f"{CANARY_PREFIX}t{k:02d}")
                                           for k in range(s.text_canaries)))
        if s.text_canaries:
            out.exposure, out.null_exposure = self._exposures()
            if not out.exposure:
                out.exposure_note = "the scored model's log-perplexities are not finite (it diverged)"
        return out

    def scored_model(self) -> tuple[int, np.ndarray]:
        """(rounds in it, model): the final release, or, when a broken run diverged, the last
        finite one (every release is public in DP-FTRL, so any of them may be scored)."""
        theta = self.engine.server.theta
        if np.isfinite(theta).all() or self.last_finite is None:
            return self.engine.next_round, theta
        return self.last_finite

    def _exposures(self) -> tuple[list[float], list[float]]:
        from dpfleet.coordinator.audit.estimators import exposure_bits

        s, model = self.settings, self.engine.model
        set_flat(model, self.scored_model()[1])
        refs = self._rng("references").choice(self.alphabet, (s.references, s.secret_tokens))
        ref_scores = log_perplexity(model, self.prefix, refs)
        mine = log_perplexity(model, self.prefix, np.array(self.secret_ids))
        if not (np.isfinite(ref_scores).all() and np.isfinite(mine).all()):
            return [], []
        bits = [float(exposure_bits(float(x), ref_scores)) for x in mine]
        return bits[:s.text_canaries], bits[s.text_canaries:]


def log_perplexity(model: torch.nn.Module, prefix: list[int], secrets: np.ndarray,
                   batch: int = 512) -> np.ndarray:
    """-log P(secret | BOS + prefix) under `model`, summed over the secret's tokens (nats), one
    per row of `secrets` [n, k]: the Secret Sharer's score (lower = more likely)."""
    from dpfleet.edge.tokenizer import BOS

    n, k = secrets.shape
    head = np.array([BOS, *prefix], dtype=np.int64)
    out = np.empty(n)
    model.eval()
    with torch.no_grad():
        for start in range(0, n, batch):
            part = secrets[start:start + batch].astype(np.int64)
            ids = torch.from_numpy(np.concatenate([np.tile(head, (len(part), 1)), part], axis=1))
            logp = torch.log_softmax(logits_of(model(ids[:, :-1])).double(), -1)
            targets = ids[:, len(head):]
            picked = logp[:, len(head) - 1:, :].gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            out[start:start + len(part)] = -picked.sum(1).numpy()
    return out


def participants(run_dir: Path) -> dict[str, int]:
    """User id -> the last 0-based round in whose released sum its update was (participation.jsonl)."""
    path = run_dir / "participation.jsonl"
    return {d: entry["round"] for entry in map(json.loads, filter(str.strip, path.read_text().splitlines()))
            for d in entry["devices"]}


def summarise(runs: Sequence[CanaryScores], epsilon_accounted: float, cfg, settings: AuditSettings,
              privacy: dict) -> dict:
    """audit.json's figures from one or more audited runs (pooled: the canaries of independent
    runs are independent, so both estimators take them together).

    Two scores per direction (module docstring): the final model's (`epsilon_estimate`, the
    paper's one-shot estimate) and the all-iterates one (`all_rounds`). The lower bound tests both
    at (1 - confidence) / 2 each and reports the larger (Bonferroni), so an honest run passes its
    accounted epsilon with probability at most 1 - confidence over both scores together."""
    c, delta = settings.confidence, cfg.dp.delta
    final = _estimators(runs, delta, settings)
    every = _estimators([r.all_rounds() for r in runs], delta, settings)
    est, bound = final["estimate"], max((final["bound"], every["bound"]), key=lambda b: b["epsilon"])
    exposure = [x for r in runs for x in r.exposure]
    null_exposure = [x for r in runs for x in r.null_exposure]
    out = {
        "epsilon_accounted": float(epsilon_accounted),
        "delta": delta,
        "epsilon_estimate": float(est["epsilon"]),
        "epsilon_estimate_interval": [float(x) for x in est["interval"]],
        "estimate_confidence": est["confidence"],
        "epsilon_lower_bound": float(bound["epsilon"]),
        "lower_bound_confidence": c,
        "lower_bound_score": "final model" if bound is final["bound"] else "all rounds",
        "all_rounds": {
            "epsilon_estimate": float(every["estimate"]["epsilon"]),
            "epsilon_estimate_interval": [float(x) for x in every["estimate"]["interval"]],
            "epsilon_lower_bound": float(every["bound"]["epsilon"]),
            "final_model_lower_bound": float(final["bound"]["epsilon"]),
            "score": "max over rounds of the cosine of each released model change with the direction",
        },
        "lower_bound_guesses": bound["guesses"],
        "lower_bound_correct": bound["correct"],
        "estimate": {k: est[k] for k in ("mu_observed", "sigma_observed", "mu_unobserved",
                                         "sigma_unobserved") if k in est},
        "exposure": {
            "median_bits": float(np.median(exposure)) if exposure else None,
            "max_bits": float(np.max(exposure)) if exposure else None,
            "canaries": len(exposure),
            "null_median_bits": float(np.median(null_exposure)) if null_exposure else None,
            "null_max_bits": float(np.max(null_exposure)) if null_exposure else None,
            "reference_secrets": settings.references,
            **({"note": notes[0]} if (notes := [r.exposure_note for r in runs if r.exposure_note])
               else {}),
        },
        "canaries": {
            "directions": int(sum(r.scores.size for r in runs)),
            "inserted": int(sum(r.observed.size for r in runs)),
            "inserted_in_sum": int(sum(r.in_sum.sum() for r in runs)),
            "scored_rounds": [r.scored_rounds for r in runs],
            "unobserved": int(sum(r.unobserved.size for r in runs)),
            "text": len(exposure),
            "text_in_sum": int(sum(r.text_in_sum for r in runs)),
            "update_norm_in_clip_norms": CANARY_NORM,
        },
        "mechanism": cfg.dp.mechanism,
        "noise": privacy.get("noise_mechanism"),
        "aggregation": cfg.aggregation.kind,
        "participation": cfg.participation.mode,
        "runs": len(runs),
        "broken": (None if settings.broken is None else
                   {"mode": settings.broken, "what": BROKEN[settings.broken],
                    "warning": "DELIBERATELY BROKEN RUN: its model is not private; audit only"}),
    }
    out["verdict"] = verdict(out)
    return out


def _estimators(runs: Sequence[CanaryScores], delta: float, settings: AuditSettings) -> dict:
    """The one-shot estimate (at the confidence) and the one-run bound (at half its alpha) of the
    runs' pooled scores."""
    from dpfleet.coordinator.audit.estimators import one_run_lower_bound, one_shot_estimate

    c = settings.confidence
    est = one_shot_estimate(np.concatenate([r.observed for r in runs]),
                            np.concatenate([r.unobserved for r in runs]), delta, confidence=c,
                            bootstrap=settings.bootstrap, seed=0)
    bound = one_run_lower_bound(np.concatenate([r.scores for r in runs]),
                                np.concatenate([r.inserted for r in runs]), delta,
                                confidence=1 - (1 - c) / 2)
    return {"estimate": est, "bound": bound}


def verdict(a: dict) -> str:
    """One line on what the figures show (and, when nothing is found, what that does not show)."""
    acc, lo = a["epsilon_accounted"], a["epsilon_estimate_interval"][0]
    if a["epsilon_lower_bound"] > acc:
        return (f"FAIL: the lower bound {a['epsilon_lower_bound']:.3g} (confidence "
                f"{a['lower_bound_confidence']:g}) is above the accounted eps {acc:.3g}: the run "
                f"leaks more than its accounting says (a false alarm has probability <= "
                f"{1 - a['lower_bound_confidence']:.2g})")
    every = a.get("all_rounds") or {}
    for name, low in (("one-shot (final model)", lo),
                      ("all-rounds", every.get("epsilon_estimate_interval", [0.0])[0])):
        if low > acc:
            return (f"FAIL: the {name} estimate's interval [{low:.3g}, ...] lies above the accounted "
                    f"eps {acc:.3g}")
    for name, point in (("one-shot (final model)", a["epsilon_estimate"]),
                        ("all-rounds", every.get("epsilon_estimate", 0.0))):
        if point > acc:
            return (f"SUSPICIOUS: the {name} estimate {point:.3g} is above the accounted eps "
                    f"{acc:.3g} (its interval reaches below it)")
    return ("consistent: no estimate or bound above the accounted eps (an estimate is not a proof, "
            "and a bound below the accounted eps is consistent with it, not a certificate)")


def run_audit(cfg, out: Path, settings: AuditSettings, *, seeds: int = 1, overwrite: bool = False,
              progress: bool = True, log: Callable[[str], None] = print, pretrain=None,
              plan=None) -> dict:
    """Run `cfg` with canaries `seeds` times (seeds cfg.seed, cfg.seed + 1, ...; one run
    directory each under `out`, or `out` itself for one seed), write each run's audit.json and
    its audit into privacy.json and the report (rendered again, with its audit section), and
    with several seeds `out/audit.json` pooling them. `pretrain`:
    the public pretraining step of `[pretrain]` (`coordinator.run.run`); `plan`: what the config
    states beside its settings (`config_plan.read_run_config`)."""
    from dpfleet.coordinator.run import run

    settings.check()
    if seeds < 1:
        raise DpfleetError(f"--seeds must be >= 1, got {seeds}")
    entries, pooled, accounted = [], [], []
    for s in range(seeds):
        # no resume point: a resumed run would lose its canaries' key
        run_cfg = with_values(cfg, {"seed": cfg.seed + s, "checkpoint_every": 0})
        run_dir = out if seeds == 1 else out / f"seed-{run_cfg.seed}"
        canaries = CanaryRun(settings)
        result = run(run_cfg, run_dir, overwrite=overwrite, progress=progress, log=log, audit=canaries,
                     pretrain=pretrain, plan=plan)
        scores = canaries.score(participants(result.run_dir))
        # a broken run states no eps (caveats.py): the audit compares against what was accounted
        epsilon = result.privacy.get("accounted_not_a_guarantee", {}).get("epsilon", result.epsilon)
        # the config the run ran: the planner's choice when the config states dp.target_epsilon
        ran = canaries.engine.cfg
        entry = summarise([scores], epsilon, ran, settings, result.privacy)
        entry.update(seed=run_cfg.seed, run_dir=str(result.run_dir),
                     accuracy=result.accuracy, stopped_early=result.stopped_early)
        write_json(result.run_dir / "audit.json", entry, indent=2)
        privacy = {**result.privacy, "audit": entry}  # the report renders its audit section
        write_json(result.run_dir / "privacy.json", privacy, indent=2)
        atomic_write(result.run_dir / "privacy_report.md", render_privacy_report(privacy))
        entries.append(entry)
        pooled.append(scores)
        accounted.append(epsilon)
    if seeds == 1:
        return entries[0]
    top = summarise(pooled, max(accounted), ran, settings, {"noise_mechanism": entries[0]["noise"]})
    top["seeds"] = entries
    private_mkdir(out)
    write_json(out / "audit.json", top, indent=2)
    return top
