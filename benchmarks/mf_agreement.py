"""dpfleet's matrix-factorization sensitivities and strategies against jax-privacy's, on a grid.

Installs jax-privacy (>= 2.0, `jax_privacy.matrix_factorization`) into its own venv
(default /tmp/jaxpriv-venv; dpfleet's environment is untouched) and runs this same file there
as a worker (`--worker in.json out.json`: top-level imports are stdlib + numpy only). Compared:
- `toeplitz.minsep_sensitivity_squared` vs `mf_sensitivity.toeplitz_minsep_sensitivity_squared`
  (monotone coefficients: exact; random-sign coefficients: both are the majorant bound; BLTs);
- `sensitivity.get_sensitivity_banded` (dense banded C) vs `mf_sensitivity.banded_sensitivity_squared`;
- `BufferedToeplitz.toeplitz_coefs` and `.inverse().toeplitz_coefs` vs `blt.BLT`;
- optimised strategies: jax-privacy's `buffered_toeplitz.optimize` and `toeplitz.optimize_banded_toeplitz`
  scored with dpfleet's loss, next to dpfleet's `mf_optimize` results (ratio of losses).
Writes benchmarks/results/mf_agreement.json. Run: OMP_NUM_THREADS=1 python benchmarks/mf_agreement.py
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

VENV = Path(os.environ.get("JAXPRIV_VENV", "/tmp/jaxpriv-venv"))
OUT = Path(__file__).resolve().parent / "results" / "mf_agreement.json"
OPT_GRID = [(60, 3, 15), (60, 3, 20), (120, 10, 12), (2000, 10, 200), (2000, 10, 20), (2000, 100, 5)]


def majorant(coef: list[float]) -> np.ndarray:
    return np.maximum.accumulate(np.abs(np.asarray(coef))[::-1])[::-1]


def worker(inp: str, out: str) -> None:
    """Runs in the jax-privacy venv: compute jax-privacy's numbers for every case in `inp`."""
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import jax_privacy
    from jax_privacy.matrix_factorization import buffered_toeplitz, sensitivity, toeplitz

    cases = json.loads(Path(inp).read_text())
    res: dict = {"jax_privacy_version": getattr(jax_privacy, "__version__", "?"),
                 "jax_version": jax.__version__}
    # release 2.0.0 refuses non-monotone coefficients; its main branch projects them onto the
    # monotone majorant first (an upper bound), so the "signed" cases get that projection here
    res["toeplitz"] = [float(toeplitz.minsep_sensitivity_squared(
        jnp.asarray(majorant(c["coef"]) if c["kind"] == "signed" else c["coef"]), min_sep=c["gap"],
        n=c["n"], max_participations=c["k"])) for c in cases["toeplitz"]]
    res["banded"] = [float(sensitivity.get_sensitivity_banded(
        jnp.asarray(c["matrix"]), c["gap"], c["k"]) ** 2) for c in cases["banded"]]
    res["blt"] = []
    for c in cases["blt"]:
        b = buffered_toeplitz.BufferedToeplitz.build(buf_decay=c["theta"], output_scale=c["omega"])
        res["blt"].append({"coefs": np.asarray(b.toeplitz_coefs(c["n"])).tolist(),
                           "inverse_coefs": np.asarray(b.inverse().toeplitz_coefs(c["n"])).tolist()})
    res["opt"] = []
    for n, gap, k in cases["opt"]:
        t0 = time.perf_counter()
        b = buffered_toeplitz.optimize(n=n, min_sep=gap, max_participations=k, error="max",
                                       max_buffers=6)
        t_blt = time.perf_counter() - t0
        t0 = time.perf_counter()
        band = toeplitz.optimize_banded_toeplitz(n, min(gap, n), reduction_fn=jnp.max)
        res["opt"].append({"n": n, "gap": gap, "k": k,
                           "blt_theta": np.asarray(b.buf_decay).tolist(),
                           "blt_omega": np.asarray(b.output_scale).tolist(), "blt_seconds": t_blt,
                           "banded_coef": np.asarray(band).tolist(),
                           "banded_seconds": time.perf_counter() - t0})
    Path(out).write_text(json.dumps(res))


def ensure_venv() -> Path | str:
    """The venv's python with jax-privacy importable, or a sentence saying why not."""
    py = VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    ok = subprocess.run([str(py), "-c", "import jax_privacy.matrix_factorization"],
                        capture_output=True)
    if ok.returncode != 0:
        pip = subprocess.run([str(py), "-m", "pip", "install", "-q", "jax-privacy>=2.0"],
                             capture_output=True, text=True)
        if pip.returncode != 0:
            return "pip could not install jax-privacy: " + pip.stderr.strip().splitlines()[-1]
    return py


def rel_err(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-300)


def main() -> None:
    from dpfleet.coordinator.mechanisms.blt import BLT, banded_toeplitz_matrix
    from dpfleet.coordinator.mechanisms.mf_optimize import (
        banded_loss,
        blt_loss,
        optimize_banded,
        optimize_blt,
    )
    from dpfleet.coordinator.mechanisms.mf_sensitivity import (
        banded_sensitivity_squared,
        toeplitz_minsep_sensitivity_squared,
        true_max_participations,
    )

    rng = np.random.default_rng(0)
    toeplitz_cases, banded_cases, blt_cases = [], [], []
    for n in (16, 60, 120, 2000):
        for gap in (1, 3, 10):
            kmax = true_max_participations(n, gap)
            for k in sorted({1, 2, max(1, kmax // 2), kmax}):
                monotone = np.cumprod(rng.uniform(0.5, 1.0, n))
                monotone /= monotone[0]
                signed = rng.normal(size=n) / np.sqrt(1 + np.arange(n))
                blt = BLT(rng.uniform(0.05, 0.99, 3), rng.dirichlet(np.ones(3)) * 0.9)
                for name, coef in (("monotone", monotone), ("signed", signed),
                                   ("blt", blt.coefs(n))):
                    toeplitz_cases.append({"kind": name, "n": n, "gap": gap, "k": k,
                                           "coef": coef.tolist()})
                if n <= 120:
                    bands = int(rng.integers(1, gap + 1))
                    mask = np.subtract.outer(np.arange(n), np.arange(n)) < bands
                    banded_cases.append({"n": n, "gap": gap, "k": k, "bands": bands,
                                         "matrix": (np.tril(rng.normal(size=(n, n))) * mask).tolist()})
                    blt_cases.append({"n": n, "theta": blt.theta.tolist(), "omega": blt.omega.tolist()})

    py = ensure_venv()
    result: dict = {"threads": os.environ.get("OMP_NUM_THREADS"), "load_before": os.getloadavg()}
    if isinstance(py, str):
        result["jax_privacy"] = py
        print(py)
    else:
        inp, outp = Path("/tmp/mf_agreement_in.json"), Path("/tmp/mf_agreement_out.json")
        inp.write_text(json.dumps({"toeplitz": toeplitz_cases, "banded": banded_cases,
                                   "blt": blt_cases, "opt": OPT_GRID}))
        t0 = time.perf_counter()
        subprocess.run([str(py), __file__, "--worker", str(inp), str(outp)], check=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
        result["jax_worker_seconds"] = time.perf_counter() - t0
        jp = json.loads(outp.read_text())
        result["jax_privacy_version"], result["jax_version"] = jp["jax_privacy_version"], jp["jax_version"]
        rows = []
        for case, theirs in zip(toeplitz_cases, jp["toeplitz"], strict=True):
            ours = toeplitz_minsep_sensitivity_squared(np.array(case["coef"]), case["n"], case["gap"],
                                                       case["k"])
            rows.append({k: case[k] for k in ("kind", "n", "gap", "k")} |
                        {"dpfleet": ours, "jax_privacy": theirs, "rel_err": rel_err(ours, theirs)})
        result["toeplitz_minsep"] = {"cases": len(rows),
                                     "max_rel_err": max(r["rel_err"] for r in rows), "rows": rows}
        rows = []
        for case, theirs in zip(banded_cases, jp["banded"], strict=True):
            ours = banded_sensitivity_squared(np.array(case["matrix"]), case["gap"], case["k"])
            rows.append({k: case[k] for k in ("n", "gap", "k", "bands")} |
                        {"dpfleet": ours, "jax_privacy": theirs, "rel_err": rel_err(ours, theirs)})
        result["banded"] = {"cases": len(rows), "max_rel_err": max(r["rel_err"] for r in rows),
                            "rows": rows}
        worst_c = worst_inv = 0.0
        for case, theirs in zip(blt_cases, jp["blt"], strict=True):
            b = BLT(np.array(case["theta"]), np.array(case["omega"]))
            worst_c = max(worst_c, float(np.max(np.abs(b.coefs(case["n"]) - theirs["coefs"]))))
            worst_inv = max(worst_inv, float(np.max(np.abs(b.inverse().coefs(case["n"])
                                                            - theirs["inverse_coefs"]))))
        result["blt_coefs"] = {"cases": len(blt_cases), "max_abs_err_coefs": worst_c,
                               "max_abs_err_inverse_coefs": worst_inv}
        rows = []
        for o in jp["opt"]:
            n, gap, k = o["n"], o["gap"], o["k"]
            t0 = time.perf_counter()
            ours_blt = min((optimize_blt(n, gap, k, buffers=d) for d in (1, 2, 3, 4)),
                           key=lambda r: r.loss)
            t_ours_blt = time.perf_counter() - t0
            t0 = time.perf_counter()
            ours_band = optimize_banded(n, gap, k)
            t_ours_band = time.perf_counter() - t0
            theirs_blt = blt_loss(BLT(np.array(o["blt_theta"]), np.array(o["blt_omega"])), n, gap, k)
            theirs_band = banded_loss(np.array(o["banded_coef"]), n, gap, k)
            # cross-check the banded loss's sensitivity on their coefficients with the dense DP
            dense_band = banded_sensitivity_squared(banded_toeplitz_matrix(np.array(o["banded_coef"]),
                                                                           n), gap, k)
            rows.append({"n": n, "gap": gap, "k": k,
                         "blt_loss_dpfleet": ours_blt.loss, "blt_loss_jax_privacy": theirs_blt,
                         "blt_ratio": ours_blt.loss / theirs_blt,
                         "blt_buffers_dpfleet": len(ours_blt.params["theta"]),
                         "blt_buffers_jax_privacy": len(o["blt_theta"]),
                         "banded_loss_dpfleet": ours_band.loss, "banded_loss_jax_privacy": theirs_band,
                         "banded_ratio": ours_band.loss / theirs_band,
                         "banded_sens2_dense_check": dense_band,
                         "seconds": {"dpfleet_blt": t_ours_blt, "dpfleet_banded": t_ours_band,
                                     "jax_privacy_blt": o["blt_seconds"],
                                     "jax_privacy_banded": o["banded_seconds"]}})
        result["optimised"] = rows
        print(f"toeplitz minsep: {result['toeplitz_minsep']['cases']} cases, max rel err "
              f"{result['toeplitz_minsep']['max_rel_err']:.2e}")
        print(f"banded: {result['banded']['cases']} cases, max rel err {result['banded']['max_rel_err']:.2e}")
        print(f"BLT coefs: max abs err {worst_c:.2e}, inverse {worst_inv:.2e}")
        for r in rows:
            print(f"n={r['n']} gap={r['gap']} k={r['k']}: BLT loss dpfleet/jax-privacy "
                  f"{r['blt_ratio']:.4f} ({r['blt_buffers_dpfleet']} vs {r['blt_buffers_jax_privacy']} "
                  f"buffers), banded {r['banded_ratio']:.4f}")
    result["load_after"] = os.getloadavg()
    OUT.write_text(json.dumps(result, indent=1, allow_nan=False))
    print(f"wrote {OUT}")
    if not math.isfinite(result.get("toeplitz_minsep", {}).get("max_rel_err", 0.0)):
        sys.exit(1)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
