"""The calibrate -> simulate pipeline predicts held-out gathers, checked without timing anything.

Timing on a shared 2-core machine cannot fail CI, so the measured version of this check (calibrate
this machine, time held-out gathers, compare with the simulator's predictions) is the benchmark
``benchmarks/sim_validation.py``. Here the "measurements" come from a known ring model with
multiplicative noise: the calibration fit must recover it from one set of sizes, and the
simulator, configured by the fitted profile, must predict other sizes and mesh sizes.
"""

from __future__ import annotations

import numpy as np
import pytest

from ciera_jax.planning import costmodel as cm
from ciera_jax.planning import links
from ciera_jax.calibrate.fit import fit_alpha_beta
from ciera_jax.sim.step import compare_to_measurements

TRUE = links.Profile("true", alpha_s=2e-4, beta_Bps=8e8, codec_Bps=5e8, agreement_s=3e-4)


def _records(sizes, meshes, noise, rng):
    out = []
    for N in meshes:
        for n_bytes in sizes:
            t = cm.ring_allgather_time(n_bytes, N, TRUE.alpha_s, TRUE.beta_Bps)
            out.append({"N": N, "n_bytes": n_bytes, "method": "plain",
                        "seconds": t * float(np.exp(rng.normal(0, noise)))})
    return out


@pytest.mark.parametrize("noise", [0.0, 0.1])
def test_fit_then_predict_held_out(noise):
    rng = np.random.default_rng(0)
    calib = _records([16 << 10, 256 << 10, 4 << 20], [2, 8], noise, rng)
    alpha, beta = fit_alpha_beta(calib)
    prof = links.Profile("fit", alpha_s=alpha, beta_Bps=beta, codec_Bps=TRUE.codec_Bps,
                         agreement_s=TRUE.agreement_s)
    held = _records([1 << 20, 2 << 20], [4, 8], 0.0, rng)  # other sizes, another mesh size
    assert not {r["n_bytes"] for r in calib} & {r["n_bytes"] for r in held}
    rows = compare_to_measurements(held, prof)
    tol = 1e-6 if noise == 0 else 0.35
    for r in rows:
        assert abs(np.log(r["ratio"])) <= tol, r


def test_a_wrong_profile_is_caught():
    """The comparison can fail: a profile 4x off in bandwidth predicts 4x off at large sizes."""
    held = _records([64 << 20], [8], 0.0, np.random.default_rng(0))
    slow = links.Profile("slow", alpha_s=TRUE.alpha_s, beta_Bps=TRUE.beta_Bps / 4,
                         codec_Bps=1e9, agreement_s=1e-4)
    assert compare_to_measurements(held, slow)[0]["ratio"] > 3.5
