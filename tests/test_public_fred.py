"""FreD (paper 003): Frechet distance, the DP moments, their calibration and accounting."""

import math

import numpy as np
import pytest
import scipy.linalg
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from dpfleet.coordinator.accounting.zcdp import epsilon_from_zcdp
from dpfleet.errors import DpfleetError
from dpfleet.public.fred import frechet_distance, gaussian_loglik, moments, psd_projection
from dpfleet.public.fred_privacy import calibrate, gaussians_epsilon, privacy_figures, render_privacy
from dpfleet.public.fred_stats import (
    cov_contribution,
    covariance_noise_to_signal,
    mean_contribution,
    pack_upper,
    private_moments,
    supported_dim,
    unpack_upper,
)


def _random_psd(rng, d, rank=None):
    a = rng.normal(size=(d, rank or d))
    return a @ a.T / d


# --- Frechet distance -------------------------------------------------------------------------

def test_fd_matches_closed_form_for_random_gaussians():
    rng = np.random.default_rng(0)
    for d in (1, 3, 10):
        m1, m2 = rng.normal(size=d), rng.normal(size=d)
        c1, c2 = _random_psd(rng, d), _random_psd(rng, d)
        ref = (np.sum((m1 - m2) ** 2) + np.trace(c1) + np.trace(c2)
               - 2 * np.trace(scipy.linalg.sqrtm(c1 @ c2)).real)
        assert frechet_distance(m1, c1, m2, c2) == pytest.approx(ref, rel=1e-6, abs=1e-9)
        # commuting (diagonal) case: sum (sqrt a - sqrt b)^2 exactly
        a, b = rng.uniform(0.1, 3, d), rng.uniform(0.1, 3, d)
        q, _ = np.linalg.qr(rng.normal(size=(d, d)))
        got = frechet_distance(m1, q @ np.diag(a) @ q.T, m1, q @ np.diag(b) @ q.T)
        assert got == pytest.approx(np.sum((np.sqrt(a) - np.sqrt(b)) ** 2), rel=1e-7)
        assert frechet_distance(m1, c1, m1, c1) == pytest.approx(0, abs=1e-8)


def test_fd_of_samples_converges_to_the_population_value():
    rng = np.random.default_rng(1)
    d = 4
    c1, c2 = _random_psd(rng, d), _random_psd(rng, d)
    m1, m2 = np.zeros(d), np.ones(d)
    truth = frechet_distance(m1, c1, m2, c2)
    x = rng.multivariate_normal(m1, c1, 200_000)
    y = rng.multivariate_normal(m2, c2, 200_000)
    assert frechet_distance(*moments(x), *moments(y)) == pytest.approx(truth, rel=0.02)


def test_fd_on_rank_deficient_and_indefinite_inputs_is_finite():
    rng = np.random.default_rng(2)
    c1 = _random_psd(rng, 6, rank=2)
    noisy = c1 + rng.normal(scale=0.5, size=(6, 6))  # what a DP release looks like
    value = frechet_distance(np.zeros(6), c1, np.zeros(6), noisy)
    assert math.isfinite(value) and value >= 0


def test_fd_refuses_mismatched_dimensions():
    with pytest.raises(DpfleetError, match="mismatched"):
        frechet_distance(np.zeros(3), np.eye(3), np.zeros(4), np.eye(4))


# --- PSD projection ---------------------------------------------------------------------------

@settings(max_examples=50, deadline=None)
@given(arrays(np.float64, (5, 5), elements=st.floats(-10, 10)), st.integers(0, 2 ** 32 - 1))
def test_psd_projection_is_psd_and_nearest(a, seed):
    p = psd_projection(a)
    assert np.allclose(p, p.T)
    assert np.linalg.eigvalsh(p).min() >= -1e-9
    sym = (a + a.T) / 2
    other = _random_psd(np.random.default_rng(seed), 5)  # any PSD competitor is no closer
    assert np.linalg.norm(sym - p) <= np.linalg.norm(sym - other) + 1e-9
    assert np.allclose(psd_projection(p), p, atol=1e-8)  # idempotent on PSD input


# --- the mechanism ----------------------------------------------------------------------------

def test_pack_upper_is_an_isometry_and_inverts():
    rng = np.random.default_rng(3)
    m = _random_psd(rng, 7)
    v = pack_upper(m)
    assert np.linalg.norm(v) == pytest.approx(np.linalg.norm(m))
    assert np.allclose(unpack_upper(v, 7), m)


user_data = st.lists(
    arrays(np.float64, st.tuples(st.integers(1, 6), st.just(4)),
           elements=st.floats(-1e3, 1e3)), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(user_data, arrays(np.float64, (4,), elements=st.floats(-10, 10)),
       st.floats(0.05, 5), st.sampled_from(["user", "sample"]))
def test_adding_or_removing_one_user_moves_the_sums_by_at_most_c_and_c2(users, centre, c, level):
    first = sum(mean_contribution(u, c, level) for u in users)
    second = sum(cov_contribution(u, centre, c, level) for u in users)
    removed = users[-1]
    first_without = sum((mean_contribution(u, c, level) for u in users[:-1]), np.zeros_like(first))
    second_without = sum((cov_contribution(u, centre, c, level) for u in users[:-1]),
                         np.zeros_like(second))
    # at sample level the unit is one sentence: one user's sum holds len(removed) of them
    units = 1 if level == "user" else len(removed)
    assert np.linalg.norm(first - first_without) <= units * c * (1 + 1e-9)
    assert np.linalg.norm(second - second_without) <= units * c * c * (1 + 1e-9)
    if level == "sample":  # one sentence added to a user moves them by at most c, c^2
        grown = np.vstack([removed, removed[:1] * 7])
        step1 = mean_contribution(grown, c, level) - mean_contribution(removed, c, level)
        step2 = cov_contribution(grown, centre, c, level) - cov_contribution(removed, centre, c, level)
        assert np.linalg.norm(step1) <= c * (1 + 1e-9)
        assert np.linalg.norm(step2) <= c * c * (1 + 1e-9)


def test_a_non_finite_embedding_cannot_poison_the_release():
    rng = np.random.default_rng(9)
    users = [rng.normal(size=(4, 3)) for _ in range(10)]
    users[0] = users[0].copy()
    users[0][1] = [np.nan, 1.0, np.inf]
    r = private_moments(users, clip=1.0, z_mean=1.0, z_cov=1.0, noise_seed=0)
    assert np.isfinite(r.mean).all() and np.isfinite(r.cov_raw).all()
    assert np.linalg.norm(mean_contribution(users[0], 1.0, "user")) <= 1.0


def _cohort(rng, k, d=3, per_user=5):
    return [rng.normal(size=(per_user, d)) * 0.3 for _ in range(k)]


def test_released_noise_has_the_calibrated_std_not_the_papers_per_sample_std():
    """Many releases of the same cohort: the empirical std of the mean and of the covariance
    entries equals z1 c / K and z2 c^2 / K (off-diagonal / sqrt 2). Algorithm 1 as printed adds
    tau1 to each sample and averages, leaving tau1 / sqrt(n2): far below what is measured."""
    rng = np.random.default_rng(4)
    k, d, c = 40, 3, 1.0
    users = _cohort(rng, k, d)
    z1, z2 = calibrate(0.6, 2e-6)
    draws = [private_moments(users, clip=c, z_mean=z1, z_cov=z2, noise_seed=s) for s in range(600)]
    means = np.array([r.mean for r in draws])
    covs = np.array([r.cov_raw for r in draws])
    sd_mean = means.std(axis=0, ddof=1)
    # the covariance is centred on each draw's own noisy mean: look at its noise around its mean
    sd_diag = np.array([covs[:, i, i].std(ddof=1) for i in range(d)])
    sd_off = np.array([covs[:, i, j].std(ddof=1) for i in range(d) for j in range(i + 1, d)])
    # 600 draws: the sample sd is within ~3 * 2.9% of the truth
    assert sd_mean == pytest.approx(np.full(d, z1 * c / k), rel=0.1)
    assert sd_diag == pytest.approx(np.full(d, z2 * c * c / k), rel=0.15)
    assert sd_off == pytest.approx(np.full(sd_off.size, z2 * c * c / k / math.sqrt(2)), rel=0.1)
    assert draws[0].noise_std_mean == pytest.approx(z1 * c / k)
    # the paper's tau1 = (2c / n2) sqrt(2 log(1.25 / delta)) / eps added per sample, then averaged
    n2 = sum(len(u) for u in users)
    tau1 = 2 * c / n2 * math.sqrt(2 * math.log(1.25 / 2e-6)) / 0.6
    assert sd_mean.min() > 20 * tau1 / math.sqrt(n2)


def test_difference_attack_fails_on_the_value():
    """An adversary who knows every other user's data subtracts their sum from the release to
    recover the target user's mean embedding. With calibrated noise the recovered vector is off by
    far more than the vector itself; with the paper's per-sample noise it is recovered closely."""
    rng = np.random.default_rng(5)
    k, d, c = 30, 8, 1.0
    users = _cohort(rng, k, d, per_user=20)
    target = users[0] + 0.5  # a distinctive user
    users[0] = target
    truth = mean_contribution(target, c, "user")
    others = sum(mean_contribution(u, c, "user") for u in users[1:])
    z1, z2 = calibrate(0.6, 2e-6)
    errors = []
    for s in range(20):
        release = private_moments(users, clip=c, z_mean=z1, z_cov=z2, noise_seed=s)
        errors.append(np.linalg.norm(release.mean * k - others - truth))
    assert np.median(errors) > 5 * np.linalg.norm(truth)
    n2 = sum(len(u) for u in users)
    tau1 = 2 * c / n2 * math.sqrt(2 * math.log(1.25 / 2e-6)) / 0.6
    paper = [rng.normal(scale=tau1, size=(n2, d)).mean(axis=0) * k for _ in range(20)]
    assert np.median([np.linalg.norm(p) for p in paper]) < 0.2 * np.linalg.norm(truth)


def test_sample_level_releases_its_count_and_is_labelled():
    rng = np.random.default_rng(6)
    users = _cohort(rng, 20, 3, per_user=50)
    z1, z2 = calibrate(0.6, 2e-6)
    r = private_moments(users, clip=1.0, z_mean=z1, z_cov=z2, level="sample", noise_seed=0)
    assert abs(r.cohort - 1000) < 10 * z1 * math.sqrt(2)
    x = np.vstack(users)
    assert np.linalg.norm(r.mean - x.mean(axis=0)) < 0.1
    fig = privacy_figures(z1, z2, 2e-6, "sample")
    assert "SAMPLE-LEVEL" in fig["accounting"]
    with pytest.raises(DpfleetError, match="sample-level"):
        privacy_figures(z1, z2, 2e-6, "sample", dpftrl_rho=0.1)


def test_secure_aggregation_inflates_the_noise_by_the_discretization():
    from dpfleet.secagg.aggregator import SecAggAggregator

    rng = np.random.default_rng(7)
    users = _cohort(rng, 8, 2, per_user=3)
    plain = private_moments(users, clip=1.0, z_mean=1e-4, z_cov=1e-4, noise_seed=0)
    secure = private_moments(users, clip=1.0, z_mean=1e-4, z_cov=1e-4, noise_seed=0, secure=True,
                             aggregator_for=lambda bound: SecAggAggregator(clip_norm=bound))
    assert secure.info["norm_inflation_mean"] >= 1 and secure.info["norm_inflation_cov"] >= 1
    assert secure.noise_std_mean >= plain.noise_std_mean
    assert np.allclose(secure.mean, plain.mean, atol=1e-3)
    assert np.allclose(secure.cov_raw, plain.cov_raw, atol=1e-3)


# --- accounting -------------------------------------------------------------------------------

@pytest.mark.parametrize("eps,delta,share", [(0.6, 2e-6, 0.5), (2.0, 1e-8, 0.3)])
def test_calibration_hits_the_target_epsilon_by_pld(eps, delta, share):
    z1, z2 = calibrate(eps, delta, share)
    assert gaussians_epsilon([z1, z2], delta) == pytest.approx(eps, rel=2e-3)
    assert 0.5 / z1 ** 2 == pytest.approx(share / (1 - share) * 0.5 / z2 ** 2)


def test_composition_with_dpftrl():
    z1, z2 = calibrate(0.6, 2e-6)
    rho_ftrl = 0.35
    fig = privacy_figures(z1, z2, 2e-6, "user", dpftrl_rho=rho_ftrl)
    rho_fred = 0.5 / z1 ** 2 + 0.5 / z2 ** 2
    assert fig["composed_zcdp"] == pytest.approx(rho_fred + rho_ftrl)
    # Gaussians compose to a Gaussian: the three-event PLD equals the one-Gaussian eps
    assert fig["composed_epsilon"] == pytest.approx(epsilon_from_zcdp(rho_fred + rho_ftrl, 2e-6),
                                                    rel=2e-3)
    alone = epsilon_from_zcdp(rho_ftrl, 2e-6)
    assert alone < fig["composed_epsilon"] < alone + fig["epsilon"]


def test_composition_with_a_ring_noise_dpftrl_run_goes_by_rdp_not_the_gaussian_pld():
    """A discrete-Gaussian DP-FTRL run is rho-zCDP but not a Gaussian: its composition must not use
    the Gaussian PLD (which gives a smaller, unproven eps here)."""
    z1, z2 = calibrate(0.6, 2e-6)
    rho_fred, rho_ftrl = 0.5 / z1 ** 2 + 0.5 / z2 ** 2, 0.35
    gaussian = privacy_figures(z1, z2, 2e-6, "user", dpftrl_rho=rho_ftrl)
    ring = privacy_figures(z1, z2, 2e-6, "user", dpftrl_rho=rho_ftrl, dpftrl_discrete=True)
    assert ring["composed_epsilon"] == pytest.approx(
        epsilon_from_zcdp(rho_fred + rho_ftrl, 2e-6, "rdp"), rel=1e-9)
    assert ring["composed_epsilon"] > gaussian["composed_epsilon"] * 1.01
    assert "RDP" in ring["composed_accounting"] and "PLD" in gaussian["composed_accounting"]


def test_the_report_of_a_secagg_query_says_it_holds_only_against_honest_participants():
    fig = privacy_figures(*calibrate(0.6, 2e-6), 2e-6, "user")
    secure, plain = (render_privacy(fig, 100, 1.0, secure) for secure in (True, False))
    assert secure.splitlines()[2].startswith("**PRIVATE ONLY AGAINST HONEST PARTICIPANTS")
    assert "HONEST PARTICIPANTS" not in plain


# --- what d the population supports, and ranking ----------------------------------------------

def test_noise_to_signal_grows_with_d_and_shrinks_with_k():
    lam = 0.05 / np.arange(1, 51) ** 1.5  # a unit-norm embedder's spectrum scale
    small = covariance_noise_to_signal(lam, 1000, 6.0, 1.0)
    large = covariance_noise_to_signal(lam, 100_000, 6.0, 1.0)
    assert np.all(np.diff(small) > 0) and np.all(large < small)
    assert supported_dim(lam, 1000, 6.0, 1.0) < supported_dim(lam, 100_000, 6.0, 1.0)


def test_planted_mixture_ranking_is_monotone():
    """Private data from A; candidates Y% A + (100 - Y)% B: DP FreD decreases with Y."""
    rng = np.random.default_rng(8)
    d = 6
    mu_a, mu_b = np.zeros(d), np.full(d, 0.25)
    ca, cb = np.eye(d) * 0.02, _random_psd(rng, d) * 0.05
    users = [rng.multivariate_normal(mu_a, ca, 10) for _ in range(2000)]
    z1, z2 = calibrate(0.6, 2e-6)
    release = private_moments(users, clip=1.0, z_mean=z1, z_cov=z2, noise_seed=1)
    scores = []
    for y in (0, 25, 50, 75, 100):
        n = 20_000
        na = n * y // 100
        cand = np.vstack([rng.multivariate_normal(mu_a, ca, na), rng.multivariate_normal(mu_b, cb, n - na)])
        scores.append(frechet_distance(*moments(cand), release.mean, release.cov))
    assert all(a > b for a, b in zip(scores, scores[1:], strict=False))
    # the record-level ranking puts A's records above B's
    ll_a = gaussian_loglik(rng.multivariate_normal(mu_a, ca, 500), release.mean, release.cov)
    ll_b = gaussian_loglik(rng.multivariate_normal(mu_b, cb, 500), release.mean, release.cov)
    assert np.median(ll_a) > np.median(ll_b)
