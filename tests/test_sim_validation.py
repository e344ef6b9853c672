"""The simulator, configured by a calibration of this machine, predicts held-out gathers.

Issue 6's validation: calibrate a profile on one set of sizes (``ciera_jax.calibrate``: plain
bits gathers at 16 KB, 256 KB, 4 MB on 2 and 8 emulated devices; CIERA's extra work from gathers
at 256 KB and 4 MB), then time *other* gathers on 8 emulated devices (plain bits at 1 and 2 MB;
CIERA at 1 MB with 0 and 1 % exponent churn and at 2 MB with none) and ask
``ciera_jax.sim.step.compare_to_measurements`` for its predictions.

Stated factor: every prediction within 3x of the measured median (ratio in [1/3, 3]). Why 3x:
XLA:CPU timings of one call on a shared 2-core machine swing by up to ~2x between runs when other
processes compete for the cores (calibration and measurement can fall in different load phases),
and the emulated "devices" share one memory system, so the ring model's per-link bandwidth is
only an effective figure whose value drifts with message size (cache effects) by a further
~1.5x inside the calibrated range. Typical ratios observed here are 0.55-1.8. The held-out sizes
lie inside the calibrated range (interpolation, not extrapolation); every figure is a median of
interleaved repetitions.
"""

from __future__ import annotations

from ciera_jax import calibrate as C
from ciera_jax.sim.step import compare_to_measurements

FACTOR = 3.0


def test_simulator_predicts_held_out_gathers_within_factor():
    """One retry: a load spike on the shared machine can spoil one calibration or timing."""
    for _ in range(2):
        report, ok = _calibrate_and_predict()
        print(report)
        if ok:
            return
    raise AssertionError(f"outside {FACTOR}x on both attempts:\n{report}")


def _calibrate_and_predict():
    prof, details = C.calibrate(mesh_sizes=[2, 8], sizes=["16K", "256K", "4M"],
                                codec_sizes=["256K", "4M"], reps=5, log=lambda *a: None)
    mesh = C.make_mesh(8)
    cases = [((512, 1024), 0.0, ("plain", "ciera")),  # 1 MB
             ((512, 1024), 0.01, ("ciera",)),
             ((1024, 1024), 0.0, ("plain", "ciera"))]  # 2 MB
    calibrated = {r["n_bytes"] for r in details["gathers"]}
    recs = []
    for shape, churn, methods in cases:
        recs += C.measure_gathers(mesh, shape, 0, churn, methods, reps=7)
    assert not calibrated & {r["n_bytes"] for r in recs}, "held-out sizes must differ"
    rows = compare_to_measurements(recs, prof)
    report = "\n".join(f"{r['method']:>5} {r['n_bytes'] / 2**20:4.1f} MB churn "
                       f"{r['change_rate']:.4f}: measured {r['seconds'] * 1e3:7.2f} ms, "
                       f"predicted {r['predicted_s'] * 1e3:7.2f} ms, ratio {r['ratio']:.2f}"
                       for r in rows)
    return report, all(1 / FACTOR <= r["ratio"] <= FACTOR for r in rows)
