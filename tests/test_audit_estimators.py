"""The audit estimators (issue 25) against mechanisms whose true epsilon is known.

Each guarantee is checked on the value: the Gaussian-pair epsilon against the analytic Gaussian
and a numerical hockey-stick integral, the one-shot interval's coverage over seeds, the one-run
bound's false-alarm rate on randomized response (the worst case of eps-DP) and on pure noise, its
power when the leak is large, and exposure's rank arithmetic.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate
from scipy.stats import binom

from dpfleet.coordinator.accounting.analytic_gaussian import analytic_gaussian_epsilon
from dpfleet.coordinator.audit.estimators import (
    exposure_bits,
    gaussian_pair_epsilon,
    one_run_lower_bound,
    one_run_p_value,
    one_shot_estimate,
)
from dpfleet.errors import DpfleetError

# ------------------------------------------------------------------ Gaussian pair


@settings(max_examples=60, deadline=None)
@given(mu=st.floats(0.05, 60), sigma=st.floats(1e-3, 1e3), shift=st.floats(-10, 10),
       log10_delta=st.floats(-12, -0.5), flip=st.booleans())
def test_equal_variances_give_the_analytic_gaussian(mu, sigma, shift, log10_delta, flip):
    delta = 10**log10_delta
    a, b = shift + mu * sigma, shift
    if flip:
        a, b = b, a
    got = gaussian_pair_epsilon(a, sigma, b, sigma, delta)
    want = analytic_gaussian_epsilon(mu * mu / 2, delta)
    assert got == pytest.approx(want, rel=1e-7, abs=1e-9)


def _hockey(eps, mp, sp, mq, sq):
    """H_eps(P||Q) = integral of (p - e^eps q)_+ by Simpson's rule on a fine grid: the definition,
    independent of the estimator's root algebra."""
    x = np.linspace(min(mp - 40 * sp, mq - 40 * sq), max(mp + 40 * sp, mq + 40 * sq), 200_001)
    log_p = -0.5 * ((x - mp) / sp) ** 2 - math.log(sp * math.sqrt(2 * math.pi))
    log_q = -0.5 * ((x - mq) / sq) ** 2 - math.log(sq * math.sqrt(2 * math.pi))
    scaled_q = np.exp(np.minimum(eps + log_q, 700.0))  # capped where it dwarfs p anyway
    return float(integrate.simpson(np.maximum(np.exp(log_p) - scaled_q, 0.0), x=x))


@settings(max_examples=15, deadline=None)
@given(mp=st.floats(-2, 2), sp=st.floats(0.3, 3), sq=st.floats(0.3, 3), log10_delta=st.floats(-6, -1))
def test_unequal_variances_match_the_hockey_stick_both_ways(mp, sp, sq, log10_delta):
    delta = 10**log10_delta
    eps = gaussian_pair_epsilon(mp, sp, 0.0, sq, delta)
    assert eps == pytest.approx(gaussian_pair_epsilon(0.0, sq, mp, sp, delta), rel=1e-9, abs=1e-9)
    worst = max(_hockey(eps, mp, sp, 0.0, sq), _hockey(eps, 0.0, sq, mp, sp))
    if eps == 0:
        assert worst <= delta * (1 + 1e-4)
        return
    assert worst == pytest.approx(delta, rel=2e-3)  # eps is where the curve crosses delta ...
    below = 0.98 * eps  # ... and no smaller eps would do
    assert max(_hockey(below, mp, sp, 0.0, sq), _hockey(below, 0.0, sq, mp, sp)) > delta


def test_a_wider_spread_costs_epsilon_even_with_equal_means():
    # the quadratic privacy loss: N(0, 1.1^2) vs N(0, 1) is far from (0, 1e-5)
    assert gaussian_pair_epsilon(0, 1.1, 0, 1, 1e-5) > 1.0
    assert gaussian_pair_epsilon(0, 1, 0, 1, 1e-5) == 0.0


# ------------------------------------------------------------------ one-shot estimate


def _gaussian_canaries(mu, n, seed):
    rng = np.random.default_rng(seed)
    return rng.normal(mu, 1.0, n), rng.normal(0.0, 1.0, n)


def test_one_shot_estimate_tracks_the_gaussian_mechanism_and_its_interval_covers():
    """Cosines of a Gaussian mechanism are N(mu, 1) in vs N(0, 1) out (units of the noise std);
    the true epsilon is the analytic Gaussian with mu. 40 seeds: the 95 % interval must cover at a
    rate binomially consistent with 95 % (P[<= 33 of 40 | 0.95] < 0.5 %), and the point estimate
    must be near the truth on average (it is biased upward by a few %, see the docstring)."""
    mu, delta = 2.0, 1e-5
    truth = analytic_gaussian_epsilon(mu * mu / 2, delta)
    covered, estimates = 0, []
    for seed in range(40):
        obs, null = _gaussian_canaries(mu, 1000, seed)
        r = one_shot_estimate(obs, null, delta, bootstrap=300, seed=seed)
        lo, hi = r["interval"]
        assert lo <= r["epsilon"] <= hi
        covered += lo <= truth <= hi
        estimates.append(r["epsilon"])
        assert r["canaries"] == 1000 and r["confidence"] == 0.95
        assert r["mu_observed"] == pytest.approx(obs.mean()) and r["sigma_unobserved"] == pytest.approx(
            null.std(ddof=1))
    assert covered >= 34, covered
    assert truth * 0.97 <= np.mean(estimates) <= truth * 1.12, (np.mean(estimates), truth)


def test_one_shot_estimate_of_no_signal_is_small_and_of_no_noise_is_huge():
    small = [one_shot_estimate(*_gaussian_canaries(0.0, 4000, s), 1e-5, bootstrap=1)["epsilon"]
             for s in range(10)]
    assert max(small) < 1.0, small
    # noise switched off: the observed cosines sit 50 noise-stds away from the null
    loud = one_shot_estimate(*_gaussian_canaries(50.0, 200, 0), 1e-5, bootstrap=50)
    assert loud["epsilon"] > 1000 and loud["interval"][0] > 500


def test_one_shot_bootstrap_is_seeded():
    obs, null = _gaussian_canaries(1.0, 300, 7)
    a = one_shot_estimate(obs, null, 1e-5, bootstrap=200, seed=3)
    assert a == one_shot_estimate(obs, null, 1e-5, bootstrap=200, seed=3)
    assert a["interval"] != one_shot_estimate(obs, null, 1e-5, bootstrap=200, seed=4)["interval"]
    assert a["epsilon"] == one_shot_estimate(obs, null, 1e-5, bootstrap=200, seed=4)["epsilon"]


def test_one_shot_percentile_interval_is_the_bootstrap_quantiles():
    obs, null = _gaussian_canaries(1.0, 500, 1)
    basic = one_shot_estimate(obs, null, 1e-5, bootstrap=400, seed=0)
    pct = one_shot_estimate(obs, null, 1e-5, bootstrap=400, seed=0, interval="percentile")
    eps = basic["epsilon"]
    assert basic["interval"][0] == pytest.approx(max(0.0, 2 * eps - pct["interval"][1]))
    assert basic["interval"][1] == pytest.approx(2 * eps - pct["interval"][0])


def test_point_masses_give_infinite_or_zero_epsilon():
    assert math.isinf(one_shot_estimate([1.0, 1.0], [0.0, 0.5], 1e-5, bootstrap=5)["epsilon"])
    assert one_shot_estimate([1.0, 1.0], [1.0, 1.0], 1e-5, bootstrap=5)["epsilon"] == 0.0


# ------------------------------------------------------------------ one-run lower bound


def _randomized_response(eps0, m, seed):
    """Each canary's score reveals its coin through eps0-randomized response (plus independent
    jitter, post-processing): exactly eps0-DP per canary, the worst case the theorem covers."""
    rng = np.random.default_rng(seed)
    coin = rng.random(m) < 0.5
    flipped = rng.random(m) < 1 / (1 + math.exp(eps0))
    return (coin ^ flipped) + 0.1 * rng.random(m), coin


@settings(max_examples=40, deadline=None)
@given(r=st.integers(1, 300), data=st.data(), eps=st.floats(0, 8), log10_delta=st.floats(-10, -2))
def test_p_value_is_the_binomial_tail_plus_the_delta_term(r, data, eps, log10_delta):
    v = data.draw(st.integers(0, r))
    m = data.draw(st.integers(r, 2 * r))
    delta = 10**log10_delta
    q = 1 / (1 + math.exp(-eps))
    tail = binom.sf(v - 1, r, q)
    assert one_run_p_value(m, r, v, eps, 0.0) == pytest.approx(min(tail, 1.0), rel=1e-9, abs=1e-300)
    cdf = binom.cdf
    slack = max(((cdf(v - 1, r, q) - cdf(v - 1 - i, r, q)) / i for i in range(1, v + 1)), default=0)
    assert one_run_p_value(m, r, v, eps, delta) == pytest.approx(min(tail + 2 * m * delta * slack, 1.0),
                                                                 rel=1e-6, abs=1e-12)
    assert one_run_p_value(m, r, v, eps + 0.5, delta) >= one_run_p_value(m, r, v, eps, delta) - 1e-12


def test_one_run_bound_false_alarm_rate_on_randomized_response():
    """eps0-RR is eps0-DP, so the bound may exceed eps0 with probability <= 5 %. With all guesses
    fixed (no Bonferroni) RR makes the test nearly exact, so the rate must also be well above 0: a
    bound that were needlessly loose would fail that side. 400 seeds; the allowances are binomial
    (P[> 34 of 400 | 0.05] < 0.3 %; rate 0.05 gives >= 6 with probability > 99.9 %)."""
    eps0, m = 1.0, 200
    fixed = [one_run_lower_bound(*_randomized_response(eps0, m, s), 1e-5, guesses=m)["epsilon"]
             for s in range(400)]
    alarms = sum(e > eps0 for e in fixed)
    assert 4 <= alarms <= 34, alarms
    chosen = [one_run_lower_bound(*_randomized_response(eps0, m, s), 1e-5)["epsilon"] for s in range(100)]
    assert sum(e > eps0 for e in chosen) <= 11  # P[> 11 of 100 | 0.05] < 0.5 %
    assert np.median(chosen) > 0.2  # and it still sees a real leak


def test_one_run_bound_on_pure_noise_rarely_rejects():
    alarms = 0
    for seed in range(300):
        rng = np.random.default_rng(seed)
        r = one_run_lower_bound(rng.normal(size=200), rng.random(200) < 0.5, 1e-5)
        alarms += r["epsilon"] > 0
    assert alarms <= 26, alarms  # alpha 0.05: P[> 26 of 300] < 0.3 %


def test_one_run_bound_has_power_on_a_large_leak():
    for seed in range(3):
        r = one_run_lower_bound(*_randomized_response(4.0, 1000, seed), 1e-5)
        assert 2.5 < r["epsilon"] <= 4.0, r
        assert r["canaries"] == 1000 and r["correct"] <= r["guesses"] <= 1000
        assert r["guesses"] in r["guess_counts_tried"]


def test_one_run_counts_correct_guesses_at_both_ends():
    scores = [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]
    inserted = [1, 1, 0, 1, 0, 0, 1, 0, 0, 1]
    # 2 guesses: "in" on score 9 (right), "out" on score 0 (wrong)
    assert one_run_lower_bound(scores, inserted, 1e-5, guesses=2)["correct"] == 1
    # 5 guesses: "in" on 9, 8, 7 (2 right), "out" on 1, 0 (1 right)
    assert one_run_lower_bound(scores, inserted, 1e-5, guesses=5)["correct"] == 3
    assert one_run_lower_bound(scores, [True] * 5 + [False] * 5, 1e-5, guesses=10)["correct"] == 10


def test_one_run_bound_is_where_the_p_value_crosses_alpha():
    scores, coin = _randomized_response(3.0, 500, 11)
    r = one_run_lower_bound(scores, coin, 1e-6, guesses=500, confidence=0.9)
    assert r["epsilon"] > 0
    assert one_run_p_value(500, 500, r["correct"], r["epsilon"], 1e-6) <= 0.1
    assert one_run_p_value(500, 500, r["correct"], r["epsilon"] + 1e-6, 1e-6) > 0.1


# ------------------------------------------------------------------ exposure


@pytest.mark.parametrize("k", [4, 8, 12])
def test_exposure_of_a_canary_better_than_every_reference(k):
    refs = np.random.default_rng(k).normal(5.0, 1.0, 2**k)
    assert exposure_bits(float(refs.min()) - 1.0, refs) == pytest.approx(math.log2(2**k + 1))
    assert exposure_bits(float(refs.max()) + 1.0, refs) == 0.0


def test_exposure_of_a_median_canary_is_about_one_bit():
    refs = np.random.default_rng(0).normal(size=4096)
    assert exposure_bits(float(np.median(refs)), refs) == pytest.approx(1.0, abs=0.01)
    assert exposure_bits(0.0, [0.0] * 100) == pytest.approx(math.log2(101 / 51))  # all tied


@settings(max_examples=80, deadline=None)
@given(refs=st.lists(st.floats(-50, 50), min_size=1, max_size=60), a=st.floats(-60, 60), b=st.floats(-60, 60))
def test_exposure_is_monotone_and_bounded(refs, a, b):
    lo, hi = min(a, b), max(a, b)
    assert exposure_bits(lo, refs) >= exposure_bits(hi, refs)  # lower log-perplexity: more exposed
    assert 0.0 <= exposure_bits(lo, refs) <= math.log2(len(refs) + 1)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("call, message", [
    (lambda: one_shot_estimate([], [0.1, 0.2], 1e-5), "observed needs at least 2"),
    (lambda: one_shot_estimate([0.1, 0.2], [0.3], 1e-5), "unobserved needs at least 2"),
    (lambda: one_shot_estimate([0.1, math.nan], [0.3, 0.4], 1e-5), "NaN or infinite"),
    (lambda: one_shot_estimate([0.1, 0.2], [0.3, 0.4], 0.0), r"delta must be in \(0, 1\)"),
    (lambda: one_shot_estimate([0.1, 0.2], [0.3, 0.4], 1e-5, confidence=1.0), "confidence"),
    (lambda: one_shot_estimate([0.1, 0.2], [0.3, 0.4], 1e-5, bootstrap=0), "bootstrap"),
    (lambda: one_shot_estimate([0.1, 0.2], [0.3, 0.4], 1e-5, interval="bca"), "interval"),
    (lambda: one_run_lower_bound([], [], 1e-5), "scores needs at least 1"),
    (lambda: one_run_lower_bound([1.0, 2.0], [True], 1e-5), "one coin per canary"),
    (lambda: one_run_lower_bound([1.0, 2.0], [True, False], 1.5), r"delta must be in \(0, 1\)"),
    (lambda: one_run_lower_bound([1.0, 2.0], [2, 0], 1e-5), "booleans"),
    (lambda: one_run_lower_bound([1.0, 2.0], [True, False], 1e-5, guesses=3), "guesses"),
    (lambda: one_run_p_value(10, 5, 6, 1.0, 1e-5), "correct <= guesses"),
    (lambda: exposure_bits(1.0, []), "reference_scores needs at least 1"),
    (lambda: exposure_bits(math.inf, [1.0]), "canary_score must be a finite number"),
    (lambda: exposure_bits("x", [1.0]), "canary_score must be a number"),
    (lambda: gaussian_pair_epsilon(0, -1, 0, 1, 1e-5), "sigmas must be >= 0"),
])
def test_bad_input_is_one_clear_error(call, message):
    with pytest.raises(DpfleetError, match=message):
        call()
