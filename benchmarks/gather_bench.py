"""Time per all-gather of expert weights: plain bits vs plain bf16 vs CIERA, one process.

N devices on one ``fsdp`` mesh (default: 8 emulated CPU devices; on GPU every local device).
Tensors are OLMoE-1B-7B expert up-projections ``(E, 2048, 1024)`` bf16 gathered on the d_model
axis (as ``ciera_jax.fsdp.RULES`` shards ``w_up_ExDxF``), E experts per tensor. For each size
and exponent-churn level (share of exponents that change per step) it times, interleaved in the
same process, median of repetitions:

* ``plain bits``  ``ciera_jax.plain_all_gather`` (uint16 view; the lossless baseline),
* ``plain bf16``  ``lax.all_gather`` of the floats (shown; on CPU it is slow and quiets sNaNs),
* ``ciera``       ``ciera_jax.all_gather`` in steady state: the cache is primed once, then
                  carried while two weight versions that differ in ``churn`` of their exponents
                  alternate, so every timed gather sees that churn.

Speedups are quoted against plain bits: ``time ciera/plain`` next to ``wire ciera/plain``
(bytes one rank sends, from the gather's stats, patches and agreement included). Above 1/16 of
a shard's exponents changing, CIERA falls back to a plain gather (``fb``).

    python benchmarks/gather_bench.py [--experts 1 4 8] [--churn 0 0.001 0.01 0.1]
                                      [--devices 8] [--reps 5] [--out results/gather_bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

D_MODEL, D_FF = 2048, 1024  # OLMoE-1B-7B expert matrices
CPU_EXPERTS = (1, 4, 8)  # 4, 16, 32 MB per tensor
GPU_EXPERTS = (4, 16, 64)  # 16, 64, 256 MB per tensor
CHURN = (0.0, 0.001, 0.01, 0.1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--experts", type=int, nargs="+", default=None,
                   help=f"experts per tensor (E in (E, {D_MODEL}, {D_FF}); default CPU "
                        f"{' '.join(map(str, CPU_EXPERTS))}, GPU {' '.join(map(str, GPU_EXPERTS))})")
    p.add_argument("--shape", type=int, nargs="+", default=None,
                   help="full tensor shape instead of --experts, e.g. 8192 1024 (one size)")
    p.add_argument("--axis", type=int, default=None,
                   help="gather axis (default 1 for the expert shape, 0 for --shape)")
    p.add_argument("--churn", type=float, nargs="+", default=list(CHURN),
                   help="exponent change rates per step (default 0 0.001 0.01 0.1)")
    p.add_argument("--devices", type=int, default=None,
                   help="emulated CPU devices (default 8; on GPU all local devices are used)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="results/gather_bench.json", help="JSON output")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from ciera_jax.devices import setup_devices

    setup_devices(args.devices)
    import jax
    import jax.numpy as jnp

    from ciera_jax import calibrate as C

    devs = jax.devices()
    on_cpu = devs[0].platform == "cpu"
    mesh = C.make_mesh(None if not on_cpu or args.devices is None else args.devices)
    N = mesh.devices.size
    if args.shape:
        shapes = [tuple(args.shape)]
        axis = 0 if args.axis is None else args.axis
    else:
        experts = args.experts or (CPU_EXPERTS if on_cpu else GPU_EXPERTS)
        shapes = [(e, D_MODEL, D_FF) for e in experts]
        axis = 1 if args.axis is None else args.axis
    for s in shapes:
        if s[axis] % N:
            raise SystemExit(f"shape {s}: axis {axis} (size {s[axis]}) is not divisible by "
                             f"{N} devices")
    print(f"gather_bench: {N} x {devs[0].platform} ({devs[0].device_kind}), jax "
          f"{jax.__version__}, bf16, gather axis {axis}, median of {args.reps}", flush=True)
    if N == 1:
        print("note: one device: the gathers move no bytes; times show the codec's cost only")

    rows = []
    t_start = time.perf_counter()
    for shape in shapes:
        fns = C.gather_fns(mesh, len(shape), axis)  # compiled once per shape, reused per churn
        for churn in args.churn:
            recs = C.measure_gathers(mesh, shape, axis, churn, ("plain", "plain_bf16", "ciera"),
                                     reps=args.reps, warmup=args.warmup, dtype=jnp.bfloat16,
                                     fns=fns)
            by = {r["method"]: r for r in recs}
            st = by["ciera"]["stats"]
            row = dict(shape=list(shape), axis=axis, N=N, mb=by["plain"]["n_bytes"] / 2**20,
                       churn=churn, measured_churn=by["ciera"]["change_rate"],
                       plain_bits_s=by["plain"]["seconds"], plain_bf16_s=by["plain_bf16"]["seconds"],
                       ciera_s=by["ciera"]["seconds"],
                       time_ratio=by["ciera"]["seconds"] / by["plain"]["seconds"],
                       wire_ratio=by["ciera"]["wire_ratio"], tier=st["tier"],
                       fallback=bool(st["fallback"]),
                       times={m: r["times"] for m, r in by.items()})
            rows.append(row)
            _print_row(row, header=len(rows) == 1)
    elapsed = time.perf_counter() - t_start
    env = dict(platform=devs[0].platform, device_kind=devs[0].device_kind, devices=N,
               jax=jax.__version__, host=platform.node(), python=platform.python_version(),
               reps=args.reps, warmup=args.warmup, seconds=elapsed)
    out = dict(benchmark="gather_bench", env=env, rows=rows,
               notes=["time_ratio = ciera / plain bits (speedup = 1/time_ratio)",
                      "wire_ratio = bytes one rank sends, ciera / plain (patches + agreement "
                      "included)",
                      "plain_bf16 is lax.all_gather of bf16: shown, not the baseline"])
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.out} ({elapsed:.0f} s)")
    return 0


def _print_row(r: dict, header: bool) -> None:
    if header:
        print(f"{'shape':>16} {'MB':>5} {'churn':>6} {'meas':>7} {'bits ms':>9} {'bf16 ms':>9} "
              f"{'ciera ms':>9} {'t ciera/bits':>12} {'wire c/p':>8} {'tier':>4} {'fb':>3}")
    print(f"{'x'.join(map(str, r['shape'])):>16} {r['mb']:5.0f} {r['churn']:6.2%} "
          f"{r['measured_churn']:7.3%} {r['plain_bits_s'] * 1e3:9.2f} {r['plain_bf16_s'] * 1e3:9.2f} "
          f"{r['ciera_s'] * 1e3:9.2f} {r['time_ratio']:12.2f} {r['wire_ratio']:8.3f} "
          f"{r['tier']:>4} {'y' if r['fallback'] else '-':>3}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
