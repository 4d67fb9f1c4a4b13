"""The run's guarantee digest: everything its (eps, delta) depends on, hashed once and bound to
every release record and to the resume point.

Why: a resume reads its config from the run directory (config.json, or the state store's copy),
so comparing that config with itself proved nothing. An edit of `dp.noise_multiplier` from 0.5 to
5 before `simulate --resume` was accepted, and the accountant then priced the rounds already
released at z = 5: eps 2.58 claimed where those rounds alone cost 16.86. Now each release
records the digest of the inputs it was released under (`guarantee`), the resume point records
it too, and a resume recomputes it from what it would run with: any difference is refused in one
line naming the fields (`check_guarantee`), before anything in the run directory is written.

The inputs (`guarantee_inputs`, flat dotted keys, plain JSON values): rounds; every `dp`,
`participation`, `data` and `tokenizer` setting except the ones that only post-process or
evaluate (`NOT_INPUTS`); the noise actually drawn (z after the planner's choice, the model's z
under adaptive clipping, the restart rounds, the noise kind, secure aggregation's bits and the
round size); the mechanism's name, fingerprint and whether dpfleet accounts it; the population;
the DP vocabulary's zCDP; whether un-noised telemetry is written. The research noise seed is
bound as a yes/no only: the records may be published, and the seed is the noise. The digest is
SHA-256 of the canonical JSON (sorted keys, no spaces) of the inputs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from dpfleet.coordinator.config import SimulationConfig, resolve_noise, round_size
from dpfleet.coordinator.mechanisms.base import Mechanism
from dpfleet.coordinator.mechanisms.registry import is_built_in
from dpfleet.errors import DpfleetError
from dpfleet.jsonio import canonical_bytes, canonical_sha256, dumps, finite

SECTIONS = ("dp", "participation", "data", "tokenizer")  # bound whole, but for NOT_INPUTS
# settings of those sections that touch no noise, no sensitivity and no accounting: the server's
# step (post-processing), when the summary warns, the held-out evaluation; the noise seed is a
# secret (bound as `dp.noise_seeded`)
NOT_INPUTS = {"dp": {"server_lr", "momentum", "warn_epsilon", "noise_seed"},
              "data": {"eval_examples"}}
SHOWN = 4  # differing fields named in the refusal (then "and N more")


def guarantee_inputs(cfg: SimulationConfig, *, mechanism: Mechanism, population: int,
                     restarts: Sequence[int], model_noise_multiplier: float,
                     vocabulary: dict | None) -> dict:
    """The plain values the run's guarantee depends on (module docstring), from the config the
    engine runs (the planner's choices already in it) and what the engine derived from it."""
    resolved = json.loads(dumps(cfg.resolved()))  # like with like: tuples as lists, inf as null
    inputs = {"rounds": resolved["rounds"], "debug_nonprivate": resolved["debug_nonprivate"]}
    for section in SECTIONS:
        skip = NOT_INPUTS.get(section, set())
        inputs.update({f"{section}.{k}": v for k, v in resolved[section].items() if k not in skip})
    inputs.update({
        "dp.noise_seeded": cfg.dp.noise_seed >= 0,
        "dp.model_noise_multiplier": float(model_noise_multiplier),
        "dp.restarts": sorted(int(r) for r in restarts),
        "noise": resolve_noise(cfg),
        "aggregation.kind": cfg.aggregation.kind,
        "aggregation.bits": cfg.aggregation.bits if cfg.aggregation.kind != "plain" else None,
        "round_size": round_size(cfg),
        "mechanism.name": mechanism.name,
        "mechanism.sha256": mechanism.fingerprint(),
        "mechanism.accounted_by_dpfleet": is_built_in(mechanism),
        "population": int(population),
        "vocabulary.zcdp": (vocabulary or {}).get("zcdp"),
    })
    return json.loads(dumps(inputs))  # as a record reads back


def digest(inputs: dict) -> str:
    """SHA-256 of the canonical JSON of `inputs`."""
    return canonical_sha256(finite(inputs)).hexdigest()


def guarantee(inputs: dict) -> dict:
    """What a release record and the resume point keep: {"sha256": digest, "inputs": values}."""
    return {"sha256": digest(inputs), "inputs": inputs}


_MISSING = object()


def _canonical(value: object) -> str | None:
    return None if value is _MISSING else canonical_bytes(finite(value)).decode()


def _shown(value: object) -> str:
    return "unset" if value is _MISSING else json.dumps(value)


def check_guarantee(current: dict, bound: object, where: str) -> None:
    """One line unless `bound` (a record's or the resume point's `guarantee`) is `current`.

    No digest (a run of a dpfleet before the binding, or a stripped file) is refused: what its
    rounds were released under cannot be known. A digest that does not match its own plain values
    (an edited record) is refused too: the values are only there to name what changed."""
    if not isinstance(bound, dict) or not isinstance(bound.get("inputs"), dict) or "sha256" not in bound:
        raise DpfleetError(f"{where} has no guarantee digest (a run of a dpfleet before the binding, "
                           "or an edited file): its releases cannot be checked, so it cannot be "
                           "resumed; start it again")
    if bound["sha256"] == current["sha256"]:
        return
    saved, now = bound["inputs"], current["inputs"]
    changed = [k for k in sorted(set(saved) | set(now))  # as JSON: false is not 0, 1.0 is not 1
               if _canonical(saved.get(k, _MISSING)) != _canonical(now.get(k, _MISSING))]
    if digest(saved) != bound["sha256"] or not changed:
        raise DpfleetError(f"{where}: its guarantee digest does not match its own values (an edited "
                           "record): it cannot be resumed")
    named = "; ".join(f"{k} ({_shown(saved.get(k, _MISSING))} -> {_shown(now.get(k, _MISSING))})"
                      for k in changed[:SHOWN])
    more = f" and {len(changed) - SHOWN} more" if len(changed) > SHOWN else ""
    raise DpfleetError(f"{where} was released under another guarantee than this resume would run "
                       f"with: {named}{more}; resume with the config, data and mechanism the run "
                       "was started with")
