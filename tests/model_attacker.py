"""A coordinator that hands one device a crafted model (model inconsistency, Pasquini et al.,
CCS 2022), run as the REAL service over loopback with real devices, real signed SecAgg and real
training; shared by tests/test_model_inconsistency.py and benchmarks/adversarial/.

The attacker patches the service's round opening (`HttpCollector._publish`): the device at
position 0 gets another model blob (the honest theta plus a perturbation) and a SecAgg setup
whose terms are what that device would compute for the crafted model (the smartest setup the
attacker can give it; `round_terms.bind_round`), everyone else the honest model and setup.
It then reports on the values: the committed sum minus the honest-model devices' updates, and
the victim's own update (recomputed exactly as its device trains it).

`bind=False` is the positive control: the model hash is left out of the terms on both sides
(the server's and every device's `bind_round` sees one fixed hash), so the same attack shows
what happens when nothing binds the model. On old main (no `round_terms`) nothing is bound
either way. Works against both trees: `/work/basevenv/bin/python` imports old main's dpfleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
from service_fleet import capture_sums, device_keys, fleet_data, run_devices, tiny_cfg

from dpfleet.coordinator.engine.backends import SequentialTrainer
from dpfleet.fleet.participant import local_policy, runtime_for
from dpfleet.service import rounds
from dpfleet.service.server import shutdown, start

try:  # absent on old main: there nothing binds the model
    from dpfleet.secagg import round_terms
except ImportError:  # pragma: no cover - old main only
    round_terms = None

ATTACK_CFG = {"rounds": 1, "aggregation": {"kind": "secagg", "signed": True, "graph": "harary"},
              "service": {"overselect": 0.6, "report_deadline_s": 30.0,
                          "secagg_phase_deadline_s": 3.0}}
VICTIM = 0  # the position handed the crafted model


@contextlib.contextmanager
def _patched(owner, name: str, value):
    real = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield real
    finally:
        setattr(owner, name, real)


def _crafting(seen: dict):
    """A `_publish` that hands position VICTIM a crafted model and a setup binding it."""
    real = rounds.HttpCollector._publish

    async def publish(self, plan):
        cur = await real(self, plan)
        theta = plan.theta.astype(np.float32)
        crafted = theta + np.random.default_rng(1).normal(0, 0.3, theta.shape).astype(np.float32)
        model = crafted.astype("<f4").tobytes()
        sha = self.b.blobs.put(model, pinned=True)
        job = cur.assignments[VICTIM]
        device_plan = {**json.loads(self.b.blobs.get(job["plan_sha256"])),  # as the device reads it
                       "client_seed": job["client_seed"]}
        secagg = dict(job["secagg"])
        if round_terms is not None:  # give it the setup its own check expects for this model
            from dpfleet.secagg.count_bit import terms_digest
            from dpfleet.secagg.setup_wire import decode_setup, encode_setup

            setup = decode_setup(bytes.fromhex(secagg["setup"]))
            terms = round_terms.bind_round(terms_digest(cur.disc, secagg["count_threshold"]),
                                           hashlib.sha256(model).digest(), device_plan)
            secagg["setup"] = encode_setup(dataclasses.replace(setup, terms=terms)).hex()
        cur.assignments[VICTIM] = {**job, "model_sha256": sha, "secagg": secagg}
        seen.update(victim=self.b.users[plan.devices[VICTIM]], theta=crafted, plan=device_plan,
                    honest_sha=job["model_sha256"])
        return cur

    return publish


def _unbound():
    """`bind_round` with one fixed model hash, on both sides: nothing binds the model."""
    real = round_terms.bind_round
    return lambda terms, model_sha256, plan: real(terms, bytes(32), plan)


def crafted_model_round(root: Path, bind: bool = True) -> dict:
    """Run the attack once; the values that show whether the victim's update is in the sum."""
    cfg = tiny_cfg(**ATTACK_CFG)
    users, examples = fleet_data(cfg, root / "fleet")
    keys = device_keys(users)
    pinned = {u: k.public_key().public_bytes_raw() for u, k in keys.items()}
    policy = lambda n: local_policy(cfg.dp.report_goal, cfg.aggregation.graph,  # noqa: E731
                                    cfg.aggregation.corruption, n)
    seen: dict = {}

    async def main():
        running = await start(cfg, root / "state", log=lambda s: None, poll_s=2.0)
        sums = capture_sums(running.driver.engine)
        devices = asyncio.create_task(run_devices(running.url, keys, examples, pinned=pinned,
                                                  policy=policy))
        await asyncio.wait_for(asyncio.shield(running.task), 180)
        outcomes = await asyncio.wait_for(devices, 60)
        history = running.driver.history
        await shutdown(running)
        return sums, outcomes, history

    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(rounds.HttpCollector, "_publish", _crafting(seen)))
        if not bind and round_terms is not None:
            stack.enter_context(_patched(round_terms, "bind_round", _unbound()))
        sums, outcomes, history = asyncio.run(main())
    return _values(cfg, examples, seen, sums, outcomes, history)


def victim_update(plan: dict, theta: np.ndarray, examples) -> np.ndarray:
    """The clipped update the victim's device computes from the crafted model (the same
    trainer call as `participant.train`, the plan's seed: deterministic on one thread)."""
    runtime, _ = runtime_for(plan)
    return SequentialTrainer(runtime).train_round(
        theta, [examples], [int(plan["client_seed"])], lr=plan["lr"],
        batch_size=plan["batch_size"], clip_norm=plan["clip_norm"])[0].delta


def _values(cfg, examples, seen, sums, outcomes, history) -> dict:
    victim = seen["victim"]
    mine = victim_update(seen["plan"], seen["theta"], examples[victim]).astype(np.float64)
    kinds = {d: [o.kind for r, a, o in outs] for d, outs in outcomes.items()}
    out = {"victim": victim, "victim_outcomes": kinds[victim],
           "rounds": [h["status"] for h in history], "committed": bool(sums),
           "victim_norm": float(np.linalg.norm(mine))}
    if not sums:
        return out
    (plan, agg), = sums
    survivors = [plan.device_ids[u] for u in agg.survivors]
    done = {d: o.update for d, outs in outcomes.items() for r, a, o in outs
            if r == plan.round + 1 and o.kind == "secagg_done"}
    honest = [d for d in survivors if d != victim]
    residual = agg.total - np.sum([done[d].delta.astype(np.float64) for d in honest], axis=0)
    out.update(
        victim_in_survivors=victim in survivors, survivors=len(survivors),
        bound=float(agg.ring.decode.__self__.quantization_bound(len(survivors))),
        residual_norm=float(np.linalg.norm(residual)),
        residual_minus_victim_norm=float(np.linalg.norm(residual - mine)),
        honest_sum_norm=float(np.linalg.norm(agg.total - residual)))
    if victim in done:  # it finished SecAgg: its own update must be what we recomputed
        out["recomputed_error"] = float(np.linalg.norm(done[victim].delta - mine))
    return out
