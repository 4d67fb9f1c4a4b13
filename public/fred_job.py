"""The FreD jobs: the private statistics query (once) and the free ranking of candidates.

`run_fred_stats` embeds the private users' text, optionally projects it with a PCA fitted on a
public pool, runs the two DP rounds of `fred_stats` over a cohort of exactly K users and writes
`fred_stats.npz` (the release, the projection, the embedder's name) with `fred_privacy.md` /
`fred_privacy.json`. It also says what d the cohort supports: the covariance's expected
noise-to-signal ratio per d on the public pool's spectrum (free) and the largest d below
`max_noise_to_signal`. `rank_candidates` scores any number of public sets against a release.

Config (TOML, strict):

    [fred]  embedder, private, private_path, cohort_size, level, epsilon, delta, mean_share,
            clip, max_samples, aggregation, pca_dim, pca_sources, pca_records,
            max_noise_to_signal, seed, noise_seed, dpftrl_run
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dpfleet.coordinator.config import build_section, read_toml
from dpfleet.edge.wheel_cache import cache_dir
from dpfleet.errors import DpfleetError
from dpfleet.io import atomic_write
from dpfleet.jsonio import dumps, write_json
from dpfleet.public.embedders import Embedder, Projection, load_embedder
from dpfleet.public.fred import frechet_distance, moments
from dpfleet.public.fred_privacy import (
    FRED_HONEST_ONLY,
    calibrate,
    dpftrl_zcdp,
    privacy_figures,
    render_privacy,
)
from dpfleet.public.fred_stats import (
    LEVELS,
    FredRelease,
    covariance_noise_to_signal,
    private_moments,
    supported_dim,
)

STATS_FILE = "fred_stats.npz"


@dataclass
class FredSection:
    embedder: str = "minilm"  # minilm | glove | teacher[:NAME] | device:PATH
    private: str = "shakespeare-solo"  # dataset name (edge.datasets) of the users' text
    private_path: str = ""  # the file, for private = "jsonl"
    cohort_size: int = 1000  # K: users in the query, the public denominator
    level: str = "user"  # "user" (default) | "sample" (paper 003's notion, labelled)
    epsilon: float = 0.6
    delta: float = 2e-6
    mean_share: float = 0.5  # share of the zCDP budget spent on the mean round
    clip: float = 1.0  # c: L2 clip of an embedding (and of a centred one)
    max_samples: int = 256  # embeddings per user, at most (a public bound)
    aggregation: str = "plain"  # "plain" | "secagg"
    pca_dim: int = 0  # 0 = the embedder's d; else a public PCA to this d
    pca_sources: list[str] = field(default_factory=lambda: ["wikitext2", "kjv", "shakespeare-collab"])
    pca_records: int = 1000  # records per pca source (also the spectrum for the d advice)
    max_noise_to_signal: float = 0.5  # the d advice: largest d with E||noise||_F / ||C||_F below
    seed: int = 0  # cohort selection and public subsampling
    noise_seed: int = -1  # -1: OS entropy (real queries); >= 0 reproducible noise (benchmarks)
    dpftrl_run: str = ""  # a finished simulate run of the same users: compose with its zCDP


@dataclass
class FredConfig:
    fred: FredSection = field(default_factory=FredSection)


def parse_fred(values: dict) -> FredConfig:
    cfg = build_section(FredConfig, values, "")
    f = cfg.fred
    checks = [
        (f.level in LEVELS, f"fred.level must be one of {LEVELS}"),
        (f.aggregation in ("plain", "secagg"), "fred.aggregation must be 'plain' or 'secagg'"),
        (f.cohort_size >= 2, "fred.cohort_size must be >= 2"),
        (f.epsilon > 0 and 0 < f.delta < 1, "fred.epsilon must be > 0 and fred.delta in (0, 1)"),
        (0 < f.mean_share < 1, "fred.mean_share must be in (0, 1)"),
        (f.clip > 0 and f.max_samples >= 1, "fred.clip must be > 0 and fred.max_samples >= 1"),
        (f.pca_dim >= 0 and f.pca_records >= 2, "fred.pca_dim must be >= 0, fred.pca_records >= 2"),
        (f.max_noise_to_signal > 0, "fred.max_noise_to_signal must be > 0"),
        (f.private != "jsonl" or bool(f.private_path), "fred.private = 'jsonl' needs fred.private_path"),
        (not (f.dpftrl_run and f.level == "sample"),
         "fred.dpftrl_run composes a device-level guarantee: it needs fred.level = 'user'"),
    ]
    for ok, message in checks:
        if not ok:
            raise DpfleetError(message)
    return cfg


def load_fred_config(path: Path) -> FredConfig:
    return parse_fred(read_toml(path, "FreD config"))


def embed_cached(embedder: Embedder, texts: Sequence[str]) -> np.ndarray:
    """Embeddings of `texts`, cached on disk by embedder and content (device LMs: never cached)."""
    if embedder.name.startswith("device:"):
        return embedder.embed(texts)
    digest = hashlib.sha256(embedder.name.encode())
    for t in texts:
        digest.update(t.encode("utf-8") + b"\0")
    path = cache_dir() / "embeddings" / f"{embedder.name.replace(':', '_')}-{digest.hexdigest()[:20]}.npy"
    if path.is_file():
        return np.load(path)
    x = embedder.embed(texts).astype(np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: np.save(f, x))
    return x


def candidate_texts(spec: str, max_records: int, seed: int = 0) -> list[str]:
    """Up to max_records random records of a candidate: a dataset name or `jsonl:PATH`."""
    from dpfleet.edge.datasets import load_records

    name, _, path = spec.partition(":")
    if name == "jsonl" and not path:
        raise DpfleetError("candidate 'jsonl' needs a file: jsonl:PATH")
    records = load_records(name, "train", Path(path) if path else None)
    texts = [r.text for r in records if r.text.strip()]
    random.Random(f"{seed}/{spec}").shuffle(texts)
    return texts[:max_records]


def public_pool_texts(f: FredSection) -> list[str]:
    return [t for s in f.pca_sources for t in candidate_texts(s, f.pca_records, f.seed)]


def cohort_texts(f: FredSection) -> list[list[str]]:
    from dpfleet.edge.datasets import load_records

    by_user: dict[str, list[str]] = {}
    for r in load_records(f.private, "train", Path(f.private_path) if f.private_path else None):
        if r.text.strip():
            by_user.setdefault(r.user, []).append(r.text)
    if len(by_user) < f.cohort_size:
        raise DpfleetError(f"{f.private} has {len(by_user)} users with text; fred.cohort_size = "
                           f"{f.cohort_size} needs at least that many")
    users = sorted(by_user)
    chosen = np.random.default_rng(f.seed).choice(len(users), f.cohort_size, replace=False)
    return [by_user[users[i]][: f.max_samples] for i in sorted(chosen)]


def _aggregator_for(f: FredSection) -> Callable[[float], object] | None:
    if f.aggregation == "plain":
        return None
    from dpfleet.secagg.aggregator import SecAggAggregator

    return lambda bound: SecAggAggregator(clip_norm=bound)


def run_fred_stats(cfg: FredConfig, out: Path, *, progress: bool = True,
                   log: Callable[[str], None] = print, embedder: Embedder | None = None) -> dict:
    """The private query: writes out/fred_stats.npz and the privacy report; returns the summary."""
    f = cfg.fred
    out = Path(out)
    rho_ftrl, ftrl_discrete = dpftrl_zcdp(Path(f.dpftrl_run)) if f.dpftrl_run else (None, False)
    embedder = embedder or load_embedder(f.embedder, progress=progress)
    cohort = cohort_texts(f)
    public = embed_cached(embedder, public_pool_texts(f))
    dim = f.pca_dim or embedder.dim
    if dim > embedder.dim:
        raise DpfleetError(f"fred.pca_dim = {dim} exceeds the embedder's d = {embedder.dim}")
    projection = Projection.fit(public, dim)
    counts = [len(t) for t in cohort]
    flat = embed_cached(embedder, [t for texts in cohort for t in texts])
    users = np.split(flat, np.cumsum(counts)[:-1])
    if f.pca_dim:
        users = [projection.apply(u) for u in users]
        public_view = projection.apply(public)
    else:
        public_view = np.asarray(public, np.float64)
    z1, z2 = calibrate(f.epsilon, f.delta, f.mean_share)
    if f.noise_seed >= 0:
        log(f"warning: fred.noise_seed = {f.noise_seed} makes the noise reproducible; "
            "for benchmarks only, never for a real query")
    log(f"FreD query over {len(users)} users ({sum(counts)} texts), d = {dim}, {f.level} level, "
        f"z1 = {z1:.3g}, z2 = {z2:.3g}")
    release = private_moments(users, clip=f.clip, z_mean=z1, z_cov=z2, level=f.level,
                              secure=f.aggregation == "secagg", aggregator_for=_aggregator_for(f),
                              noise_seed=None if f.noise_seed < 0 else f.noise_seed,
                              round_seed=f.seed, progress=progress, max_samples=f.max_samples)
    spectrum = np.linalg.eigvalsh(moments(public_view)[1])[::-1]
    full_spectrum = projection.eigenvalues  # the embedder's whole d, for the PCA advice
    nsr_denominator = release.cohort
    nsr = covariance_noise_to_signal(spectrum, nsr_denominator, z2, f.clip)
    advice = supported_dim(full_spectrum, nsr_denominator, z2, f.clip, f.max_noise_to_signal)
    public_clipped = float(np.mean(np.linalg.norm(public_view, axis=1) > f.clip))
    fig = privacy_figures(z1, z2, f.delta, f.level, rho_ftrl, dpftrl_discrete=ftrl_discrete)
    if f.aggregation == "secagg":
        fig["honest_participants_only"] = True
        log(f"WARNING: {FRED_HONEST_ONLY}")
    summary = {
        "embedder": embedder.name, "d": dim, "pca_dim": f.pca_dim, "level": f.level,
        "cohort": release.cohort, "survivors": release.survivors, "texts": sum(counts),
        "noise_std_mean": release.noise_std_mean, "noise_std_cov_diag": release.noise_std_cov_diag,
        "covariance_noise_to_signal": float(nsr[-1]),
        "noise_to_signal_by_d": {int(d): float(covariance_noise_to_signal(
            full_spectrum, nsr_denominator, z2, f.clip)[d - 1])
            for d in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if d <= len(full_spectrum)},
        "recommended_pca_dim": advice,
        "public_share_clipped": public_clipped,
        "privacy": fig, "config": dataclasses.asdict(f),
    }
    out.mkdir(parents=True, exist_ok=True)
    save_release(out / STATS_FILE, release, projection if f.pca_dim else None, summary)
    atomic_write(out / "fred_privacy.md", render_privacy(fig, release.cohort, f.clip,
                                                         f.aggregation == "secagg"))
    write_json(out / "fred_privacy.json", summary, indent=2, default=float)
    if advice < dim:
        log(f"warning: at K = {release.cohort} the covariance noise-to-signal at d = {dim} is "
            f"{nsr[-1]:.2f}; this cohort supports about d = {advice} (set fred.pca_dim)")
    return summary


def save_release(path: Path, r: FredRelease, projection: Projection | None, summary: dict) -> None:
    arrays = {"mean": r.mean, "cov": r.cov, "cov_raw": r.cov_raw,
              "summary": np.array(dumps(summary, default=float))}
    if projection is not None:
        arrays.update(pca_mean=projection.mean, pca_components=projection.components,
                      pca_eigenvalues=projection.eigenvalues)
    atomic_write(path, lambda f: np.savez(f, **arrays))


@dataclass
class LoadedRelease:
    mean: np.ndarray
    cov: np.ndarray
    projection: Projection | None
    summary: dict

    def view(self, embeddings: np.ndarray) -> np.ndarray:
        """Public embeddings in the release's space (its PCA, when it had one)."""
        if self.projection is not None:
            return self.projection.apply(embeddings)
        if embeddings.shape[1] != self.mean.size:
            raise DpfleetError(f"embeddings have d = {embeddings.shape[1]}, the release {self.mean.size}")
        return np.asarray(embeddings, np.float64)


def load_release(path: Path) -> LoadedRelease:
    path = Path(path)
    if not path.is_file():
        raise DpfleetError(f"FreD statistics not found: {path} (run `dpfleet public fred-stats`)")
    try:
        with np.load(path) as z:
            data = {k: z[k] for k in z.files}
        summary = json.loads(str(data["summary"]))
        projection = (Projection(data["pca_mean"], data["pca_components"], data["pca_eigenvalues"])
                      if "pca_mean" in data else None)
        return LoadedRelease(data["mean"], data["cov"], projection, summary)
    except (OSError, ValueError, KeyError) as exc:
        raise DpfleetError(f"{path} is not a FreD statistics file ({exc})") from exc


def rank_candidates(release: LoadedRelease, candidates: Sequence[str], embedder: Embedder,
                    max_records: int = 2000, seed: int = 0) -> list[dict]:
    """FreD of each candidate against the release, smallest (closest) first. Free."""
    rows = []
    for spec in candidates:
        texts = candidate_texts(spec, max_records, seed)
        if len(texts) < 2:
            raise DpfleetError(f"candidate {spec!r} has fewer than 2 records")
        m, c = moments(release.view(embed_cached(embedder, texts)))
        rows.append({"candidate": spec, "records": len(texts),
                     "fred": frechet_distance(m, c, release.mean, release.cov)})
    return sorted(rows, key=lambda r: r["fred"])


def plot_ranking(rows: list[dict], title: str, out: Path) -> Path:
    from matplotlib.figure import Figure  # not pyplot: the caller's backend is left alone

    fig = Figure(figsize=(6, 0.5 + 0.45 * len(rows)))
    ax = fig.subplots()
    ax.barh([r["candidate"] for r in rows][::-1], [r["fred"] for r in rows][::-1], color="tab:blue")
    ax.set_xlabel("FreD to the private data (lower = closer)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


def fred_select(stats_file: Path, texts: Sequence[str], sources: Sequence[str],
                fraction: float) -> tuple[np.ndarray, dict]:
    """The pipeline's `selection = "fred"`: the pool mixture FreD prefers (free post-processing).

    Sources are ordered by their FreD to the DP statistics; the top `fraction` of the pool is
    filled with the closest source's records first (pool order), then the next source's. Paper
    003 chooses among datasets; ranking single records by their Gaussian likelihood under the
    DP moments (`fred.gaussian_loglik`) was no better than chance on real text at small K and d."""
    from dpfleet.public.matching import selection_size

    release = load_release(stats_file)
    x = release.view(embed_cached(load_embedder(release.summary["embedder"]), list(texts)))
    by_source = {}
    for source in sorted(set(sources)):
        rows = x[[i for i, s in enumerate(sources) if s == source]]
        by_source[source] = (frechet_distance(*moments(rows), release.mean, release.cov)
                             if len(rows) >= 2 else float("inf"))
    order = sorted(range(len(sources)), key=lambda i: (by_source[sources[i]], i))
    chosen = np.asarray(order[: selection_size(len(order), fraction)], dtype=np.int64)
    return chosen, {"fred_by_source": by_source, "fred_privacy": release.summary["privacy"]}
