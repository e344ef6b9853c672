"""Does the simulator, configured by a calibration of this machine, predict held-out gathers?

    python benchmarks/sim_validation.py [--out results/sim_validation.json] [--reps 7]

Calibrates a profile on one set of sizes (``ciera_jax.calibrate``: plain-bits gathers at 16 KB,
256 KB, 4 MB on 2 and 8 emulated devices; CIERA's extra work from gathers at 256 KB and 4 MB),
then times *other* gathers on 8 emulated devices (plain bits at 1 and 2 MB; CIERA at 1 MB with 0
and 1 % exponent churn and at 2 MB with none) and prints the simulator's prediction next to each
median (``ratio`` = predicted / measured). On a shared machine the ratios spread wide: timings
of one call swing with load, and the emulated devices share one memory system. It is a
benchmark, not a test, because a loaded machine could fail any tolerance on time (the
timing-free check of the same pipeline is tests/test_sim_validation.py).
"""

from __future__ import annotations

import sys

from common import parser, write_results  # benchmarks/common.py, beside this script


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, "sim_validation")
    p.add_argument("--reps", type=int, default=7, help="repetitions per timing (median)")
    args = p.parse_args(argv)
    from ciera_jax.runtime.devices import setup_devices

    setup_devices(8)
    from ciera_jax import calibrate as C
    from ciera_jax.sim.step import compare_to_measurements

    prof, details = C.calibrate(mesh_sizes=[2, 8], sizes=["16K", "256K", "4M"],
                                codec_sizes=["256K", "4M"], reps=5, log=lambda *a: None)
    mesh = C.make_mesh(8)
    cases = [((512, 1024), 0.0, ("plain", "ciera")),  # 1 MB
             ((512, 1024), 0.01, ("ciera",)),
             ((1024, 1024), 0.0, ("plain", "ciera"))]  # 2 MB
    recs = []
    for shape, churn, methods in cases:
        recs += C.measure_gathers(mesh, shape, 0, churn, methods, reps=args.reps)
    rows = compare_to_measurements(recs, prof)
    print(f"{'method':>6} {'MB':>4} {'churn':>6} {'measured ms':>12} {'predicted ms':>13} ratio")
    for r in rows:
        print(f"{r['method']:>6} {r['n_bytes'] / 2**20:4.1f} {r['change_rate']:6.3f} "
              f"{r['seconds'] * 1e3:12.2f} {r['predicted_s'] * 1e3:13.2f} {r['ratio']:.2f}")
    write_results(args.out, {"profile": {k: v for k, v in vars(prof).items() if k != "sources"},
                             "calibrated_sizes": sorted({r["n_bytes"] for r in details["gathers"]}),
                             "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
