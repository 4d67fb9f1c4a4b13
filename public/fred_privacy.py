"""Privacy of a FreD release: two Gaussian mechanisms, alone and composed with DP-FTRL.

Both rounds are Gaussian sums with sensitivity 1 in units of c and c^2, noise multipliers z1
and z2. They are accounted with dp-accounting's PLD accountant, and, for the same users,
composed with the DP-FTRL run's Gaussian (the tree's rho-zCDP is one Gaussian mechanism with
noise multiplier 1 / sqrt(2 rho), see `coordinator.accounting`). Calibration splits a target
(eps, delta) between the rounds by zCDP (Gaussians compose exactly: rho adds), then the PLD
accountant confirms the composed eps. Both go through the run's privacy ledger
(`coordinator.accounting.ledger`): FreD is its `fred` entry, the DP-FTRL run is read from its
privacy.json's ledger (refused when the file's figures are not the ledger's).

Units: user-level FreD and device-level DP-FTRL both protect all of one device's data
(add/remove and zero-out give the same Gaussian sensitivity), so they compose. Sample-level
FreD (the paper's notion) protects one sentence only and is refused for composition.
"""

from __future__ import annotations

import math
from pathlib import Path

import dp_accounting

from dpfleet.coordinator.accounting.ledger import (
    FRED,
    TRAINING,
    Entry,
    Ledger,
    read_checked_privacy,
    release_entry,
)
from dpfleet.coordinator.accounting.zcdp import zcdp_for_epsilon
from dpfleet.errors import DpfleetError

FRED_HONEST_ONLY = (
    "PRIVATE ONLY AGAINST HONEST PARTICIPANTS: with fred.aggregation = \"secagg\" the noise is "
    "continuous Gaussian added after decoding the secure-aggregation sum, so a dishonest "
    "co-participant that parks the ring sum at its wrap makes one honest device move the release "
    "far beyond the sensitivity the noise covers. The statement below holds only if every "
    "participant is honest (DP-FTRL's default puts its noise in the ring instead).")


def calibrate(epsilon: float, delta: float, mean_share: float = 0.5) -> tuple[float, float]:
    """(z1, z2) whose two Gaussian rounds are together (epsilon, delta)-DP (PLD)."""
    if not 0 < mean_share < 1:
        raise DpfleetError(f"mean_share must be in (0, 1), got {mean_share}")
    rho = zcdp_for_epsilon(epsilon, delta, "pld")
    return 1.0 / math.sqrt(2 * mean_share * rho), 1.0 / math.sqrt(2 * (1 - mean_share) * rho)


def gaussians_epsilon(noise_multipliers: list[float], delta: float) -> float:
    """eps at delta of the composition of sensitivity-1 Gaussians (PLD accountant)."""
    if not noise_multipliers or any(not z > 0 for z in noise_multipliers):
        raise DpfleetError("noise multipliers must be > 0")
    return Ledger((gaussians_entry(FRED, noise_multipliers),)).pld_epsilon(delta)


def gaussians_entry(name: str, noise_multipliers: list[float], what: str = "") -> Entry:
    """A ledger entry of sensitivity-1 Gaussian sums: rho = sum of 1 / (2 z^2)."""
    return release_entry({"key": name, "name": what or name, "noise_multipliers": noise_multipliers,
                          "zcdp": sum(0.5 / z ** 2 for z in noise_multipliers)})


def dpftrl_zcdp(run_dir: Path) -> tuple[float, bool]:
    """rho-zCDP of a finished simulation run (its privacy.json), and whether its noise was the
    discrete Gaussian in the SecAgg ring (composition must then avoid the Gaussian PLD). The
    file's figures must be its ledger's (`ledger.check_ledger`): an edited privacy.json, e.g. one
    with a release dropped from its ledger, is refused rather than composed."""
    path = Path(run_dir) / "privacy.json"
    if not path.is_file():
        raise DpfleetError(f"{run_dir} holds no privacy.json (not a finished `dpfleet simulate` run)")
    privacy = read_checked_privacy(path)
    rho = privacy.get("zcdp")
    if not isinstance(rho, (int, float)) or rho < 0:
        raise DpfleetError(f"{path} has no usable zcdp figure")
    return float(rho), privacy.get("noise_kind", privacy.get("noise")) == "discrete"


def fred_releases(fig: dict | None) -> list[dict]:
    """The FreD statistics as releases the DP-FTRL run composes with its training
    (`run_accountant.run_privacy`): one entry for a user-level release, none for a sample-level
    one (it protects one sentence, not a device: never composed with device-level DP-FTRL)."""
    if not fig or fig.get("level") != "user":
        return []
    rho = 0.5 / fig["z_mean"] ** 2 + 0.5 / fig["z_cov"] ** 2
    return [{"key": FRED, "name": "FreD statistics (paper 003)", "zcdp": rho, "delta": 0.0,
             "noise_multipliers": [fig["z_mean"], fig["z_cov"]],
             "what": f"two Gaussian sums of the same users' embeddings, z1 = {fig['z_mean']:.4g}, "
                     f"z2 = {fig['z_cov']:.4g}"}]


def privacy_figures(z_mean: float, z_cov: float, delta: float, level: str,
                    dpftrl_rho: float | None = None, *, dpftrl_discrete: bool = False) -> dict:
    """The numbers of the report (and of fred_stats.npz). `dpftrl_discrete`: the DP-FTRL run put
    discrete Gaussian noise in the SecAgg ring; the Gaussian PLD is no proven bound for it, so
    the composition goes by zCDP -> RDP (the same conversion that run's own report used)."""
    rho = 0.5 / z_mean ** 2 + 0.5 / z_cov ** 2
    out = {"level": level, "delta": delta, "z_mean": z_mean, "z_cov": z_cov, "zcdp": rho,
           "epsilon": gaussians_epsilon([z_mean, z_cov], delta),
           "accounting": "PLD (dp-accounting) of two Gaussian sums, sensitivity c and c^2 "
                         + ("(add/remove one user)" if level == "user" else
                            "(add/remove one sample: SAMPLE-LEVEL, the paper's notion)")}
    if dpftrl_rho is not None:
        if level != "user":
            raise DpfleetError("sample-level FreD protects one sentence, not a device: it cannot be "
                               "composed with device-level DP-FTRL; use level = \"user\"")
        # FreD, then the run's DP-FTRL as one Gaussian of its rho (its ledger's training entry)
        training = ([Entry(TRAINING, dp_accounting.GaussianDpEvent(1 / math.sqrt(2 * dpftrl_rho)),
                           dpftrl_rho)] if dpftrl_rho > 0 else [])
        ledger = Ledger((gaussians_entry(FRED, [z_mean, z_cov]), *training))
        composed = ledger.epsilon(delta, "rdp") if dpftrl_discrete else ledger.pld_epsilon(delta)
        out.update(dpftrl_zcdp=dpftrl_rho, composed_zcdp=rho + dpftrl_rho, composed_epsilon=composed,
                   composed_accounting="zCDP -> RDP (the DP-FTRL noise is a discrete Gaussian)"
                   if dpftrl_discrete else "PLD of the three Gaussian mechanisms")
    return out


def render_privacy(fig: dict, cohort: int, clip: float, secure: bool) -> str:
    """fred_privacy.md: the formal statement, in the project's report style."""
    unit = ("User-level DP: adjacency adds or removes everything one user (device) of the cohort "
            "contributes." if fig["level"] == "user" else
            "**Sample-level DP (paper 003's notion)**: adjacency adds or removes one sentence; a "
            "user with many sentences is protected far less. Not dpfleet's default guarantee.")
    denominator = ("fixed public K, the denominator" if fig["level"] == "user"
                   else "released noisy sample count")
    summing = ("secure aggregation (noise calibrated to the discretized sensitivity, continuous "
               "Gaussian added after decoding)" if secure else "plain sum")
    lines = ["# FreD privacy report", ""]
    if secure:
        lines += [f"**{FRED_HONEST_ONLY}**", ""]
    lines += [
        f"**Formal statement.** The FreD statistics (DP mean and DP covariance of the cohort's "
        f"embeddings) are ({fig['epsilon']:.4g}, {fig['delta']:g})-DP "
        f"(rho-zCDP {fig['zcdp']:.4g}).", "", unit, "",
        f"- mechanism: two Gaussian sums, noise std z1*c = {fig['z_mean']:.4g}*{clip:g} (mean) and "
        f"z2*c^2 = {fig['z_cov']:.4g}*{clip:g}^2 (covariance, upper triangle, off-diagonals x sqrt 2)",
        f"- cohort: {cohort} ({denominator})",
        f"- aggregation: {summing}",
        f"- accounting: {fig['accounting']}",
    ]
    if "composed_epsilon" in fig:
        lines += ["", f"**Composed with the same users' DP-FTRL** (rho-zCDP {fig['dpftrl_zcdp']:.4g}): "
                  f"({fig['composed_epsilon']:.4g}, {fig['delta']:g})-DP, rho-zCDP "
                  f"{fig['composed_zcdp']:.4g} ({fig['composed_accounting']})."]
    lines += ["", "Ranking candidates against this release is post-processing: no further cost.", ""]
    return "\n".join(lines)
