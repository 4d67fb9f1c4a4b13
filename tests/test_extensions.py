"""Extension points (`dpfleet.extensions`): the example of each runs; the built-in objects are
the run's own path (passing them explicitly changes nothing, bit for bit); and the attacks: a
clipping rule that overshoots its bound, a participation policy that picks a device twice or one
the guard refuses, a noise mechanism that declares no accounting. Each is caught before the round
is released, or said plainly in the privacy report, checked on the values."""

import importlib.util
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_api import CONFIG, USERS, TinyLM, WordIds

import dpfleet
from dpfleet.coordinator.accounting.zcdp import epsilon_from_zcdp
from dpfleet.coordinator.engine.extensions import check_clipped
from dpfleet.coordinator.engine.participation import check_selection
from dpfleet.errors import DpfleetError
from dpfleet.extensions import (
    ClippingRule,
    LocalSGD,
    LocalUpdate,
    Mechanism,
    ParticipationPolicy,
    TreeMechanism,
    UniformPolicy,
    clip_l2,
)

ROOT = Path(__file__).resolve().parents[1]
UNIFORM = {**CONFIG, "rounds": 3, "dp": {**CONFIG["dp"], "noise_seed": 7},
           "participation": {"mode": "uniform", "min_separation": 1}}


def _example():
    spec = importlib.util.spec_from_file_location("extensions_example", ROOT / "examples" / "extensions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path, name="run", config=UNIFORM, **kw):
    torch.manual_seed(0)
    return dpfleet.simulate(config, model=TinyLM(), users=USERS, tokenizer=WordIds(), progress=False,
                            run_dir=tmp_path / name, **kw)


def _released(run_dir: Path) -> list[dict]:
    path = run_dir / "releases.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


@pytest.mark.slow
def test_example_runs_all_four_and_its_epsilon_is_the_declared_one(tmp_path):
    ex = _example()
    model = ex.custom_model.GRULanguageModel(64)
    assert isinstance(ex.LocalAdam(), LocalUpdate) and isinstance(ex.PerLayerClip(model), ClippingRule)
    assert isinstance(ex.DenseStrategy(ex.STRATEGY), Mechanism)
    assert isinstance(ex.CyclicPolicy(4), ParticipationPolicy)
    result = ex.main(tmp_path / "ext", progress=False)
    privacy = json.loads((result.run_dir / "privacy.json").read_text())
    log = [json.loads(x) for x in (result.run_dir / "participation.jsonl").read_text().splitlines()]
    seen: dict[str, list[int]] = {}
    for entry in log:
        for d in entry["devices"]:
            seen.setdefault(d, []).append(entry["round"])
    maxp = max(len(r) for r in seen.values())
    gaps = [b - a - 1 for r in seen.values() for a, b in zip(r, r[1:], strict=False)]
    # cyclic: a device comes back only every 4th round; the declared sens^2 is the square of the
    # sum of the MaxP largest column norms of the strategy, converted by RDP
    assert gaps and min(gaps) >= 3 and privacy["min_separation"] == min(gaps)
    norms = sorted(np.linalg.norm(ex.STRATEGY, axis=0), reverse=True)
    rho = sum(norms[:maxp]) ** 2 / (2 * ex.CONFIG["dp"]["noise_multiplier"] ** 2)
    assert privacy["zcdp"] == pytest.approx(rho, rel=1e-12) and privacy["mechanism"] == "dense"
    assert privacy["epsilon"] == epsilon_from_zcdp(privacy["zcdp"], privacy["delta"], "rdp")
    assert privacy["accounted_by_dpfleet"] is False and privacy["method"] == "rdp"
    assert "AS DECLARED" in (result.run_dir / "privacy_report.md").read_text()
    assert result.epsilon == privacy["epsilon"] < math.inf
    assert "LocalAdam" in json.loads((result.run_dir / "summary.json").read_text())["client_trainer_note"]


def test_built_in_parts_passed_explicitly_are_the_same_run(tmp_path):
    """LocalSGD, clip_l2, UniformPolicy and TreeMechanism are what the config's run uses: passed
    through the protocols they give the same model and the same per-round zCDP, bit for bit."""
    base = _run(tmp_path, "base")
    same = _run(tmp_path, "same", client_update=LocalSGD(), clipping=clip_l2, noise=TreeMechanism(),
                participation=UniformPolicy(UNIFORM["seed"]))
    for a, b in zip(base.model.state_dict().values(), same.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert [m["zcdp"] for m in base.metrics] == [m["zcdp"] for m in same.metrics]
    assert [m["accuracy"] for m in base.metrics] == [m["accuracy"] for m in same.metrics]
    assert same.privacy == base.privacy and same.privacy["accounted_by_dpfleet"] is True
    report = "privacy_report.md"
    assert (same.run_dir / report).read_text() == (base.run_dir / report).read_text()


def test_a_custom_local_update_changes_the_training(tmp_path):
    base = _run(tmp_path, "base")
    adam = _run(tmp_path, "adam", client_update=_example().LocalAdam(lr=0.05))
    assert not torch.equal(base.model.head.weight, adam.model.head.weight)


@pytest.mark.parametrize("factor", [2.0, 1 + 1e-6])
def test_attack_a_clipping_rule_above_its_bound_is_stopped_before_release(tmp_path, factor):
    """The rule returns norm factor x bound (2x, and a subtle 1e-6 overshoot): the run stops with
    one error naming the rule and the norm it measured, and no round is released."""

    def overshoot(delta, bound):  # every delta scaled to norm factor x bound
        v = delta.astype(np.float64)
        norm = float(np.linalg.norm(v))
        return (v * (factor * bound / norm)).astype(np.float32), norm

    with pytest.raises(DpfleetError, match=r"clipping rule .*overshoot") as err:
        _run(tmp_path, clipping=overshoot)
    measured = float(re.search(r"L2 norm ([0-9.e+-]+)", str(err.value)).group(1))
    bound = CONFIG["dp"]["clip_norm"]
    assert measured > bound and measured == pytest.approx(bound * factor, rel=1e-6)
    assert _released(tmp_path / "run") == []


def test_a_clipping_rule_returning_nan_is_stopped(tmp_path):
    with pytest.raises(DpfleetError, match="L2 norm nan"):
        _run(tmp_path, clipping=lambda d, b: (np.full_like(d, np.nan), 0.0))
    assert _released(tmp_path / "run") == []


def test_attack_a_length_one_delta_is_refused_not_broadcast(tmp_path):
    """The rule clips the round's first device properly and returns `[C]` for the others: norm C
    passes the norm check, but added into the model-sized total it is broadcast to every
    coordinate (each such device moving the sum by C * sqrt(D)). The run stops with one error
    naming the rule, the shape and the model's length; nothing is released."""
    calls = []

    def one_number(delta, bound):
        calls.append(1)
        if len(calls) == 1:
            return clip_l2(delta, bound)
        return np.array([bound], np.float32), float(np.linalg.norm(delta))

    dim = sum(p.numel() for p in TinyLM().parameters())
    with pytest.raises(DpfleetError, match=r"one_number") as err:
        _run(tmp_path, clipping=one_number)
    assert re.search(rf"shape \(1,\).*\({dim},\)", str(err.value)), str(err.value)
    assert "\n" not in str(err.value)
    assert _released(tmp_path / "run") == []


@settings(max_examples=150, deadline=None)
@given(dim=st.integers(1, 12), shape=st.lists(st.integers(0, 12), max_size=3), scale=st.floats(0, 0.999),
       data=st.data())
def test_check_clipped_takes_exactly_one_model_sized_vector(dim, shape, scale, data):
    """Any shape but (D,) is refused whatever its norm; (D,) float32 with norm <= C is accepted."""
    shape = tuple(shape) if data.draw(st.booleans()) else (dim,)
    rng = np.random.default_rng(len(shape) * 100 + dim)
    delta = rng.normal(size=shape).astype(np.float32)
    norm = float(np.linalg.norm(delta.astype(np.float64)))
    if norm > 0:
        delta = (delta * np.float32(scale / norm)).astype(np.float32)
    update = type("U", (), {"delta": delta})
    if shape == (dim,):
        check_clipped([update], 1.0, dim)
    else:
        with pytest.raises(DpfleetError, match=rf"shape {re.escape(str(shape))}.*\({dim},\)"):
            check_clipped([update], 1.0, dim)


class Twice:
    def select(self, round_idx, eligible, count):
        devices = eligible.at(np.arange(count - 1))
        return np.concatenate([devices, devices[:1]])  # device counted twice in the sum


class Same:
    def select(self, round_idx, eligible, count):
        return np.arange(count)  # the same devices every round: round 2 breaks MinS 1


def test_attack_a_policy_that_counts_a_device_twice_is_refused(tmp_path):
    with pytest.raises(DpfleetError, match=r"round 1: .* chose device 0 more than once"):
        _run(tmp_path, participation=Twice())
    assert _released(tmp_path / "run") == []


def test_attack_a_policy_that_picks_a_refused_device_is_refused(tmp_path):
    with pytest.raises(DpfleetError, match=r"round 2: .* chose device 0, which the guard refuses"):
        _run(tmp_path, participation=Same())
    assert [r["round"] for r in _released(tmp_path / "run")] == [1]  # round 1 only


class ByName:
    """Chooses the eligible users whose keys sort first, and keeps the keys it was shown."""

    def __init__(self):
        self.shown: list[list[str]] = []

    def select(self, round_idx, eligible, count):
        devices = eligible.at(np.arange(eligible.count))
        keys = eligible.keys(devices)
        self.shown.append(keys)
        return devices[sorted(range(len(keys)), key=keys.__getitem__)[:count]]


def test_a_policy_sees_the_users_keys_and_may_choose_by_them(tmp_path):
    policy = ByName()
    result = _run(tmp_path, participation=policy)
    log = [json.loads(x) for x in (result.run_dir / "participation.jsonl").read_text().splitlines()]
    assert len(policy.shown) == len(log) == UNIFORM["rounds"]
    for keys, entry in zip(policy.shown, log, strict=True):
        assert set(keys) <= set(USERS) and len(keys) > UNIFORM["dp"]["report_goal"]  # the caller's keys
        # who took part (the accountant's record) is who the policy chose by name
        assert sorted(entry["devices"]) == sorted(keys)[: UNIFORM["dp"]["report_goal"]]
    assert set(policy.shown[1]).isdisjoint(log[0]["devices"])  # the guard's MinS 1 still applies
    from dpfleet.extensions import Eligible

    assert Eligible(4, np.array([1]), users=None).keys([0, 2]) == ["0", "2"]  # no keys: the index


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 40), data=st.data())
def test_check_selection_accepts_exactly_the_valid_choices(size, data):
    blocked = np.array(sorted(data.draw(st.sets(st.integers(0, size - 1)))), dtype=np.int64)
    chosen = data.draw(st.lists(st.integers(-2, size + 1), max_size=12))
    count = data.draw(st.integers(0, 12))
    valid = (len(chosen) == count and len(set(chosen)) == len(chosen)
             and all(0 <= d < size and d not in blocked for d in chosen))
    if valid:
        got = check_selection(np.array(chosen, dtype=np.int64), count, size, blocked, None, 0)
        assert got == sorted(chosen)
    else:
        with pytest.raises(DpfleetError):
            check_selection(np.array(chosen, dtype=np.int64), count, size, blocked, None, 0)


class ClaimsZero(Mechanism):
    """Zero noise, zero sensitivity declared: the "eps 0, AS DECLARED" of issue 31's attack 5."""

    name = "claims-zero"

    def identity(self):
        return {}

    def sensitivity_squared(self, rounds, min_separation, max_participation, restarts=()):
        return 0.0

    def zcdp(self, noise_multiplier, rounds, min_separation, max_participation):
        return 0.0  # the same claim in the protocol of dpfleet before issue 31

    def stream(self, dim, std, key, segment=0, purpose="model"):
        return TreeMechanism().stream(dim, 0.0, key, segment, purpose)


class ClaimsNone(ClaimsZero):
    name = "claims-none"

    def sensitivity_squared(self, rounds, min_separation, max_participation, restarts=()):
        return None


class Short(ClaimsZero):
    name = "short"

    def sensitivity_squared(self, rounds, min_separation, max_participation, restarts=()):
        return float(max_participation)

    def stream(self, dim, std, key, segment=0, purpose="model"):
        return TreeMechanism().stream(dim - 1, std, key, segment, purpose)


@pytest.mark.parametrize("mechanism,value", [(ClaimsZero(), "0.0"), (ClaimsNone(), "None")])
def test_attack_a_mechanism_claiming_no_sensitivity_is_refused_before_release(tmp_path, mechanism, value):
    """Attack 5: zero noise with a declared zCDP of 0 ended with "eps 0, AS DECLARED". Now a
    sensitivity that is not a finite number > 0 once a device took part is refused at the round's
    accounting, before the round's release is recorded."""
    with pytest.raises(DpfleetError, match=rf"{mechanism.name}.*returned {value}; it must be a finite"):
        _run(tmp_path, noise=mechanism)
    assert _released(tmp_path / "run") == []
    assert not (tmp_path / "run" / "privacy.json").exists()


def test_custom_noise_refuses_what_it_cannot_honour(tmp_path):
    secagg = {**UNIFORM, "aggregation": {"kind": "secagg"}}
    with pytest.raises(DpfleetError, match="short.* cannot run with ring noise .*no ring_stream"):
        _run(tmp_path, config=secagg, noise=Short())
    with pytest.raises(DpfleetError, match="must be a dpfleet.extensions.Mechanism"):
        _run(tmp_path, "b", noise=object())
    with pytest.raises(DpfleetError, match=r"round 1's noise must be a finite float vector of shape"):
        _run(tmp_path, "c", noise=Short())
    assert _released(tmp_path / "c") == []


class FromTheDocs(Mechanism):
    """A mechanism written from docs/extending.md alone: `identity`, `sensitivity_squared` and a
    `stream` whose `state_dict()` is its position ({"t", "tree_id"}, nothing else); no `resume`
    (the default replays the stream from the key). `stop_at`: round whose noise is interrupted
    by Ctrl-C, as a user pressing it mid-round."""

    name = "from-the-docs"
    stop_at = 0

    def identity(self):
        return {"kind": "fresh noise every round"}

    def sensitivity_squared(self, rounds, min_separation, max_participation, restarts=()):
        return float(max_participation)

    def stream(self, dim, std, key, segment=0, purpose="model"):
        from dpfleet.coordinator.mechanisms.noise_stream import GaussianNodes

        nodes, mechanism = GaussianNodes(key, std, dim, b"from-the-docs-" + purpose.encode()), self

        class Stream:
            def __init__(self):
                self.t, self.tree_id = 0, segment

            def next_residual(self):
                if self.t + 1 == mechanism.stop_at:
                    raise KeyboardInterrupt
                self.t += 1
                return nodes(self.tree_id, 0, self.t)

            def state_dict(self):
                return {"t": self.t, "tree_id": self.tree_id}

        return Stream()


def test_a_mechanism_written_from_the_docs_checkpoints_and_resumes_bit_for_bit(tmp_path):
    """Its first resume point crashed with KeyError: 'noise' (the resume point wanted the tree's
    node lists); now the point stores what `state_dict()` returns and the resumed run releases
    the uninterrupted run's models, round for round."""
    config = {**UNIFORM, "rounds": 6, "checkpoint_every": 2}
    _run(tmp_path, "whole", config=config, noise=FromTheDocs())
    interrupted = FromTheDocs()
    interrupted.stop_at = 5  # after the resume points of rounds 2 and 4
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, "cut", config=config, noise=interrupted)
    point = json.loads((tmp_path / "cut" / "resume" / "server_state.json").read_text())
    assert point["rounds_done"] == 4 and point["tree"] == {"t": 4, "tree_id": 0}
    torch.manual_seed(0)
    from dpfleet.api import run
    from dpfleet.coordinator.config import parse_config

    run(parse_config(config), tmp_path / "cut", resume=True, model=TinyLM(), users=USERS,
        tokenizer=WordIds(), progress=False, log=lambda s: None, noise=FromTheDocs())
    released = [[r["released"] for r in _released(tmp_path / name)] for name in ("whole", "cut")]
    assert len(released[0]) == 6 and released[1] == released[0]
    assert ((tmp_path / "cut" / "checkpoint" / "model.safetensors").read_bytes()
            == (tmp_path / "whole" / "checkpoint" / "model.safetensors").read_bytes())


def test_a_stream_state_that_is_not_json_is_refused_in_one_line(tmp_path):
    class Leaky(FromTheDocs):
        name = "leaky"

        def stream(self, dim, std, key, segment=0, purpose="model"):
            inner = super().stream(dim, std, key, segment, purpose)
            inner.state_dict = lambda: {"t": inner.t, "tree_id": 0, "noise": [np.zeros(dim)]}
            return inner

    with pytest.raises(DpfleetError, match="'leaky': its stream's state_dict\\(\\) must be a JSON object"):
        _run(tmp_path, config={**UNIFORM, "rounds": 4, "checkpoint_every": 2}, noise=Leaky())
