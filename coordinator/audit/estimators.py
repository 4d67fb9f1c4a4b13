"""Empirical privacy of one training run, from canaries: pure estimators.

The accountant proves an epsilon from arithmetic; these functions measure what a finished run
actually leaks, so a bug in clipping, noise or participation shows up as an estimate or bound
above the accounted epsilon. Three published methods, each a pure function of canary scores:

* `one_shot_estimate` (Andrew et al., ICLR 2024): an *estimate*, not a bound. Cosines of the
  final model delta with inserted vs never-inserted canary directions are fitted by Gaussians and
  epsilon is that of the pair of Gaussians (`gaussian_pair_epsilon`), with a bootstrap interval.
* `one_run_lower_bound` (Steinke, Nasr, Jagielski, NeurIPS 2023): a *lower bound* that holds at
  the stated confidence for any (eps, delta)-DP mechanism; a bound under the accounted epsilon is
  consistent with it, never a certificate.
* `exposure_bits` (Carlini et al., USENIX Security 2019): how many bits of a text canary the
  model gives away, from the canary's log-perplexity rank among sampled references.

Bad input (empty or mismatched arrays, non-finite scores, delta or confidence outside (0, 1)) is
a `DpfleetError` with one line saying what is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.optimize import brentq
from scipy.special import log_ndtr
from scipy.stats import binom

from dpfleet.errors import DpfleetError

__all__ = [
    "exposure_bits",
    "gaussian_pair_epsilon",
    "one_run_lower_bound",
    "one_run_p_value",
    "one_shot_estimate",
]


# ---------------------------------------------------------------- input checks


def _scores(name: str, values: Sequence[float], minimum: int = 1) -> np.ndarray:
    """A finite 1-D float array with at least `minimum` entries, or one clear error."""
    try:
        arr = np.asarray(values, dtype=float)
    except (TypeError, ValueError):
        raise DpfleetError(f"{name} must be a sequence of numbers") from None
    if arr.ndim != 1 or arr.size < minimum:
        raise DpfleetError(f"{name} needs at least {minimum} score(s) in a flat list, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise DpfleetError(f"{name} holds a NaN or infinite score")
    return arr


def _number(name: str, value: float) -> float:
    """A finite real number (numpy scalars included), or one clear error."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise DpfleetError(f"{name} must be a number, got {value!r}") from None
    if isinstance(value, (str, bytes)) or not math.isfinite(x):
        raise DpfleetError(f"{name} must be a finite number, got {value!r}")
    return x


def _unit_open(name: str, value: float) -> float:
    """A number strictly inside (0, 1) (delta, confidence), or one clear error."""
    x = _number(name, value)
    if not 0 < x < 1:
        raise DpfleetError(f"{name} must be in (0, 1), got {value!r}")
    return x


def _is_int(value: object) -> bool:
    """An integer count (numpy integers too), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


# ---------------------------------------------------------------- one-shot (Andrew et al. 2024)


def _logdiffexp(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """log(e^a - e^b), -inf where b >= a (the difference is zero or below resolution)."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        out = a + np.log1p(-np.exp(b - a))
    return np.where(b < a, out, -np.inf)


def _log_mass(mean: np.ndarray, std: np.ndarray, lo: np.ndarray, hi: np.ndarray,
              inside: np.ndarray) -> np.ndarray:
    """log N(mean, std^2) mass of (lo, hi) where `inside`, else of its complement. Upper-tail
    intervals are measured from the right so tiny masses keep their digits (log_ndtr)."""
    with np.errstate(over="ignore"):  # a root near +-1e308 (nearly equal variances) is +-inf here
        z1, z2 = (lo - mean) / std, (hi - mean) / std
    in_mass = np.where(z1 > 0, _logdiffexp(log_ndtr(-z1), log_ndtr(-z2)),
                       _logdiffexp(log_ndtr(z2), log_ndtr(z1)))
    out_mass = np.logaddexp(log_ndtr(z1), log_ndtr(-z2))
    return np.where(inside, in_mass, out_mass)


def _log_hockey_stick(eps: np.ndarray, mp: np.ndarray, sp: np.ndarray, mq: np.ndarray,
                      sq: np.ndarray) -> np.ndarray:
    """log of H_eps(P || Q) = sup_S P(S) - e^eps Q(S) for P = N(mp, sp^2), Q = N(mq, sq^2).

    Exact, not a grid: the optimal S = {x : log p(x) - log q(x) > eps} is where the quadratic
    a x^2 + b x + c is positive, i.e. an interval (a < 0), the complement of one (a > 0) or a
    half-line (equal variances). Roots by the cancellation-free quadratic formula, so nearly
    equal variances give one huge root and the linear root to full precision."""
    a = 0.5 / sq**2 - 0.5 / sp**2
    b = mp / sp**2 - mq / sq**2
    c = np.log(sq / sp) - 0.5 * mp**2 / sp**2 + 0.5 * mq**2 / sq**2 - eps
    disc = b * b - 4 * a * c
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # huge roots become +-inf
        root = np.sqrt(np.maximum(disc, 0.0))
        qq = -0.5 * (b + np.where(b >= 0, root, -root))
        r1 = np.where(qq != 0, qq / a, 0.0)
        r2 = np.where(qq != 0, c / qq, 0.0)
        linear_root = -c / b
    lo, hi = np.minimum(r1, r2), np.maximum(r1, r2)
    inside = a < 0  # a < 0: between the roots; a > 0: outside them
    # a == 0 (equal variances): the half-line b x + c > 0, as an "inside" interval
    flat = a == 0
    lo = np.where(flat & (b > 0), linear_root, np.where(flat, -np.inf, lo))
    hi = np.where(flat & (b < 0), linear_root, np.where(flat, np.inf, hi))
    inside = np.where(flat, True, inside)
    log_p, log_q = _log_mass(mp, sp, lo, hi, inside), _log_mass(mq, sq, lo, hi, inside)
    h = _logdiffexp(log_p, eps + log_q)
    # no real roots: S is empty (a < 0) or everything (a > 0, then H = 1 - e^eps <= 0); a == b == 0
    # with c <= 0 is P == Q. All three have H = 0 for eps >= 0.
    empty = (~flat & (disc <= 0)) | (flat & (b == 0))
    return np.where(empty, -np.inf, h)


def _pair_epsilons(mp: np.ndarray, sp: np.ndarray, mq: np.ndarray, sq: np.ndarray,
                   delta: float) -> np.ndarray:
    """Vectorised `gaussian_pair_epsilon`: bisection on eps of max(H(P||Q), H(Q||P)) <= delta,
    which decreases in eps. A zero std is a point mass: eps is inf unless both are the same point."""
    mp, sp, mq, sq = np.broadcast_arrays(*(np.asarray(x, dtype=float) for x in (mp, sp, mq, sq)))
    degenerate = (sp == 0) | (sq == 0)
    same_point = (sp == 0) & (sq == 0) & (mp == mq)
    sp, sq = np.where(degenerate, 1.0, sp), np.where(degenerate, 1.0, sq)
    target = math.log(delta)

    def ok(eps: np.ndarray) -> np.ndarray:
        worst = np.maximum(_log_hockey_stick(eps, mp, sp, mq, sq), _log_hockey_stick(eps, mq, sq, mp, sp))
        return worst <= target

    zero = ok(np.zeros_like(mp))
    hi = np.ones_like(mp)
    for _ in range(64):  # double until delta(hi) <= delta; eps ~ 1e19 never happens for finite fits
        need = ~ok(hi) & ~zero
        if not need.any():
            break
        hi = np.where(need, 2 * hi, hi)
    unbounded = ~ok(hi) & ~zero
    lo = np.where(zero, 0.0, hi / 2)
    lo = np.where(hi == 1.0, 0.0, lo)
    for _ in range(60):  # relative precision ~ 2^-60 of the bracket
        mid = (lo + hi) / 2
        good = ok(mid)
        hi, lo = np.where(good, mid, hi), np.where(good, lo, mid)
    eps = np.where(zero, 0.0, np.where(unbounded, np.inf, hi))
    return np.where(degenerate, np.where(same_point, 0.0, np.inf), eps)


def gaussian_pair_epsilon(mu_p: float, sigma_p: float, mu_q: float, sigma_q: float, delta: float) -> float:
    """The smallest eps >= 0 with H_eps(P||Q) <= delta and H_eps(Q||P) <= delta, P = N(mu_p, sigma_p^2),
    Q = N(mu_q, sigma_q^2): the (eps, delta) of a mechanism whose two neighbouring outputs are these
    Gaussians. With equal variances it is the analytic Gaussian mechanism (Balle & Wang 2018) with
    mu = |mu_p - mu_q| / sigma; with unequal ones the privacy loss is quadratic and both directions
    matter, hence the max."""
    delta = _unit_open("delta", delta)
    mu_p, mu_q = _number("mu_p", mu_p), _number("mu_q", mu_q)
    sigma_p, sigma_q = _number("sigma_p", sigma_p), _number("sigma_q", sigma_q)
    if sigma_p < 0 or sigma_q < 0:
        raise DpfleetError(f"sigmas must be >= 0, got {sigma_p!r} and {sigma_q!r}")
    return float(_pair_epsilons(np.array([mu_p]), np.array([sigma_p]), np.array([mu_q]),
                                np.array([sigma_q]), delta)[0])


def _bootstrap_epsilons(obs: np.ndarray, null: np.ndarray, delta: float, replicates: int,
                        rng: np.random.Generator) -> np.ndarray:
    """Epsilons of `replicates` bootstrap resamples (observed and null resampled independently),
    in chunks of ~2 M drawn scores so thousands of canaries do not need gigabytes."""
    out = []
    chunk = max(1, 2_000_000 // max(obs.size, null.size))
    for start in range(0, replicates, chunk):
        n = min(chunk, replicates - start)
        bo = obs[rng.integers(0, obs.size, size=(n, obs.size))]
        bu = null[rng.integers(0, null.size, size=(n, null.size))]
        out.append(_pair_epsilons(bo.mean(axis=1), bo.std(axis=1, ddof=1), bu.mean(axis=1),
                                  bu.std(axis=1, ddof=1), delta))
    return np.concatenate(out)


def one_shot_estimate(observed: Sequence[float], unobserved: Sequence[float], delta: float, *,
                      confidence: float = 0.95, bootstrap: int = 1000, seed: int = 0,
                      interval: str = "basic") -> dict:
    """One-shot empirical epsilon (Andrew, Kairouz, Oh, Oprea, McMahan, Suriyakumar, ICLR 2024).

    `observed`: cosine of the final model delta with each *inserted* canary's random direction;
    `unobserved`: cosine with random directions never inserted (the null). In high dimension the
    cosines are close to Gaussian, so the paper fits N(mu_o, s_o^2) and N(mu_u, s_u^2) (sample mean,
    std with ddof=1) and reports the eps at `delta` of that pair (`gaussian_pair_epsilon`): what a
    Gaussian mechanism separating "canary in" from "canary out" that well would have to spend.
    It is an estimate for the run's final model only (the adversary sees theta_T, not the rounds),
    so it sits below the accounted epsilon on a correct run and above it when noise is missing.

    The estimate is biased upward: any sampling difference between the two fitted stds makes the
    privacy loss quadratic, which at small delta costs epsilon (1000 + 1000 canaries drawn from
    N(2, 1) and N(0, 1), delta 1e-5: truth 10.0, estimate 10.7 +- 0.6 over seeds; mu = 0 gives
    0.4 +- 0.3, never exactly 0). Hence the default interval is the *basic* (reverse percentile)
    bootstrap at `confidence`, [2 eps - q_hi, 2 eps - q_lo] clipped at 0, which subtracts that bias
    and covers the truth at the stated rate (measured 0.96-0.99 at 95 %), where the plain
    `interval="percentile"` [q_lo, q_hi] inherits the bias (0.66-0.78 at 95 %). Observed and
    unobserved canaries are resampled independently (`bootstrap` replicates, numpy Generator seeded
    with `seed`). The interval reflects the sampling of canaries, not the Gaussian-fit assumption;
    a true epsilon of 0 sits at the edge and is covered only by intervals reaching 0. A zero fitted
    std (a point mass) gives eps = inf (JSON null) unless both sides are the same point.
    """
    obs = _scores("observed", observed, minimum=2)
    null = _scores("unobserved", unobserved, minimum=2)
    delta = _unit_open("delta", delta)
    confidence = _unit_open("confidence", confidence)
    if not (_is_int(bootstrap) and bootstrap >= 1):
        raise DpfleetError(f"bootstrap must be a positive number of replicates, got {bootstrap!r}")
    if interval not in ("basic", "percentile"):
        raise DpfleetError(f"interval must be 'basic' or 'percentile', got {interval!r}")
    mo, so, mu, su = obs.mean(), obs.std(ddof=1), null.mean(), null.std(ddof=1)
    eps = float(_pair_epsilons(np.array([mo]), np.array([so]), np.array([mu]), np.array([su]), delta)[0])
    reps = _bootstrap_epsilons(obs, null, delta, bootstrap, np.random.default_rng(seed))
    tail = 100 * (1 - confidence) / 2
    # no interpolation between order statistics (inf - inf), rounded outward: never narrower
    q_lo = float(np.percentile(reps, tail, method="lower"))
    q_hi = float(np.percentile(reps, 100 - tail, method="higher"))
    if interval == "percentile":
        lo, hi = q_lo, q_hi
    elif math.isinf(eps):  # a point-mass fit: no bias to subtract from an infinite estimate
        lo = hi = math.inf
    else:
        lo, hi = max(0.0, 2 * eps - q_hi), max(0.0, 2 * eps - q_lo)
    return {"epsilon": eps, "interval": [lo, hi], "confidence": confidence, "interval_method": interval,
            "mu_observed": float(mo), "sigma_observed": float(so), "mu_unobserved": float(mu),
            "sigma_unobserved": float(su), "canaries": int(obs.size), "bootstrap": int(bootstrap)}


# ---------------------------------------------------------------- one run (Steinke et al. 2023)


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Upper bound on P[>= v of r guesses correct] for an (epsilon, delta)-DP mechanism whose m
    canaries were each inserted with probability 1/2 (Steinke, Nasr, Jagielski 2023, Thm. 5.2 and
    App. D). With f(w) = P[Binomial(r, q) >= w], q = e^eps / (1 + e^eps) (the accuracy of eps-DP
    randomized response, the worst case when delta = 0), the bound is
        f(v) + 2 m delta * max_{i=1..v} (f(v - i) - f(v)) / i,
    the second term paying for the delta slack each of the m canaries may use."""
    if not 0 <= v <= r <= m:
        raise DpfleetError(f"need 0 <= correct <= guesses <= canaries, got {v}, {r}, {m}")
    q = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(binom.sf(v - 1, r, q))
    if v == 0 or delta == 0:
        return min(tail, 1.0)
    # (f(v - i) - f(v)) = P[v - i <= B < v]: cumulative pmf from w = v-1 downward
    below = np.cumsum(binom.pmf(np.arange(v - 1, -1, -1), r, q))
    slack = float(np.max(below / np.arange(1, v + 1)))
    return min(tail + 2 * m * delta * slack, 1.0)


def _largest_rejected_epsilon(m: int, r: int, v: int, delta: float, alpha: float) -> float:
    """sup{eps : one_run_p_value(eps) <= alpha} (the p-value grows with eps), 0 if none."""
    if r == 0 or one_run_p_value(m, r, v, 0.0, delta) > alpha:
        return 0.0
    lo, hi = 0.0, 1.0
    while one_run_p_value(m, r, v, hi, delta) <= alpha:
        lo, hi = hi, 2 * hi
        if hi > 1e3:  # v == r with tiny alpha: the bound grows like log(1/alpha) only; never here
            return lo
    # p-value - alpha is continuous and increasing in eps, <= 0 at lo and > 0 at hi
    root = brentq(lambda e: one_run_p_value(m, r, v, e, delta) - alpha, lo, hi, xtol=1e-9, rtol=1e-12)
    for eps in (root, root - 1e-8):  # brentq may land either side of the root: keep the rejected side
        if eps >= lo and one_run_p_value(m, r, v, eps, delta) <= alpha:
            return eps
    return lo


def _guess_counts(m: int) -> list[int]:
    """The guess totals tried when the caller gives none: m, m/2, m/4, ... down to 10 (or m if
    smaller). Few, because each costs a Bonferroni share of 1 - confidence."""
    counts, r = [], m
    while r >= min(10, m) and r > 0:
        counts.append(r)
        r //= 2
    return counts


def one_run_lower_bound(scores: Sequence[float], inserted: Sequence[bool], delta: float, *,
                        confidence: float = 0.95, guesses: int | None = None) -> dict:
    """Lower bound on epsilon from one run (Steinke, Nasr, Jagielski, NeurIPS 2023).

    Each of the m canaries was inserted independently with probability 1/2 (`inserted` is that
    coin, drawn before training); a higher score means "more likely inserted". With r guesses the
    auditor guesses "inserted" on the ceil(r/2) highest scores and "not inserted" on the floor(r/2)
    lowest and abstains on the rest; v counts correct guesses. The result is the largest epsilon
    for which an (epsilon, delta)-DP training run would get >= v right with probability at most
    alpha = 1 - confidence (`one_run_p_value`, their Thm. 5.2 with the delta term), i.e. the run
    is *not* (epsilon, delta)-DP, at that confidence. 0.0 when nothing is rejected.

    `guesses=None`: the paper tries several guess counts and keeps the best. Picking the best after
    looking would inflate the false-alarm rate, so each r in m, m/2, m/4, ... (down to 10) is tested
    at alpha / (number tried) (Bonferroni) and the largest bound is reported; `guesses` then names the
    winning r. A given `guesses` is one test at alpha. Ties in score are broken by canary position,
    which is valid as long as the positions were fixed before the coins were drawn.
    """
    s = _scores("scores", scores)
    coin = np.asarray(inserted)
    if coin.shape != s.shape:
        raise DpfleetError(f"inserted has {coin.size} entries but scores has {s.size}: one coin per canary")
    if coin.dtype != bool and not np.isin(coin, (0, 1)).all():
        raise DpfleetError("inserted must hold booleans (the coin of each canary)")
    coin = coin.astype(bool)
    delta = _unit_open("delta", delta)
    confidence = _unit_open("confidence", confidence)
    m = s.size
    if guesses is None:
        tried = _guess_counts(m)
    elif _is_int(guesses) and 1 <= guesses <= m:
        tried = [int(guesses)]
    else:
        raise DpfleetError(f"guesses must be an integer in 1..{m} (the number of canaries), got {guesses!r}")
    alpha = (1 - confidence) / len(tried)
    order = np.argsort(-s, kind="stable")  # highest score first; ties by position
    ranked = coin[order]
    best: dict = {}
    for r in tried:
        k_plus, k_minus = (r + 1) // 2, r // 2  # ranked[m - 0:] is empty: no "out" guesses
        v = int(ranked[:k_plus].sum()) + int((~ranked[m - k_minus:]).sum())
        eps = _largest_rejected_epsilon(m, r, v, delta, alpha)
        if not best or eps > best["epsilon"]:
            best = {"epsilon": eps, "guesses": r, "correct": v}
    return {"epsilon": float(best["epsilon"]), "confidence": confidence, "guesses": best["guesses"],
            "correct": best["correct"], "canaries": int(m), "delta": delta, "guess_counts_tried": tried}


# ---------------------------------------------------------------- exposure (Carlini et al. 2019)


def exposure_bits(canary_score: float, reference_scores: Sequence[float]) -> float:
    """Exposure of a text canary (Carlini, Liu, Erlingsson, Kos, Song, 'The Secret Sharer', 2019).

    Exposure = log2 |R| - log2 rank(canary), rank 1 = the most likely candidate, with scores being
    log-perplexity (LOWER = more likely). |R| is far too large to enumerate, so this is their
    estimate by sampling: the canary's rank among n sampled references plus itself, i.e.
        log2(n + 1) - log2(1 + #better + #tied / 2),
    a tie counting as half: a canary in the middle of its references, or tied with all of them,
    gets ~1 bit; the worst of them gets 0. Counting the canary among the candidates keeps the
    result finite: a canary better than every reference gets log2(n + 1), the most n samples
    can show. Larger exposures need more references (the paper's skew-normal extrapolation is not
    used: its tail is a model, not a measurement).
    """
    canary_score = _number("canary_score", canary_score)
    ref = _scores("reference_scores", reference_scores)
    better = int(np.count_nonzero(ref < canary_score))
    tied = int(np.count_nonzero(ref == canary_score))
    return math.log2(ref.size + 1) - math.log2(1 + better + tied / 2)
