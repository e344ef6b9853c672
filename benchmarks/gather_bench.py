"""Time per all-gather of expert weights: plain bits vs plain bf16 vs CIERA, and the checksum.

N devices on one ``fsdp`` mesh (default: 8 emulated CPU devices; on GPU every local device).
Tensors are OLMoE-1B-7B expert up-projections ``(E, 2048, 1024)`` bf16 gathered on the d_model
axis (as ``ciera_jax.fsdp.RULES`` shards ``w_up_ExDxF``), E experts per tensor. For each size
and exponent-churn level (share of exponents that change per step) it times, interleaved in the
same process, median of repetitions:

* ``plain bits``  ``ciera_jax.plain_all_gather`` (uint16 view; the lossless baseline),
* ``plain bf16``  ``lax.all_gather`` of the floats (shown; on CPU it is slow and quiets sNaNs),
* ``ciera``       ``ciera_jax.all_gather`` in steady state: the cache is primed once, then
                  carried while two weight versions that differ in ``churn`` of their exponents
                  alternate, so every timed gather sees that churn,
* ``checksum``    what a self-checking gather adds on every rank (``ciera_jax.codec.checksum``): the
                  sender's checksum of its own shard plus the receiver's per-rank checksums of
                  the rebuilt full tensor, as a separate call (``chk/ciera`` is its share of the
                  CIERA gather's time; the target is <= 10% on CPU),
* ``ciera checked`` the CIERA gather with both checksums in the same jit (``fused +``: what
                  checking adds to the gather's time). ``(min)`` repeats both checksum ratios
                  from the fastest repetitions, the steadier figure on a loaded machine.

Speedups are quoted against plain bits: ``time ciera/plain`` next to ``wire ciera/plain``
(bytes one rank sends, from the gather's stats, patches and agreement included). Above the top
patch rung CIERA falls back to a plain gather (``fb``).

    python benchmarks/gather_bench.py [--experts 1 4 8] [--churn 0 0.001 0.01 0.1]
                                      [--devices 8] [--reps 5] [--out PATH]
"""

from __future__ import annotations

import sys
import time

from common import parser, write_results  # benchmarks/common.py, beside this script

D_MODEL, D_FF = 2048, 1024  # OLMoE-1B-7B expert matrices
CPU_EXPERTS = (1, 4, 8)  # 4, 16, 32 MB per tensor
GPU_EXPERTS = (4, 16, 64)  # 16, 64, 256 MB per tensor
CHURN = (0.0, 0.001, 0.01, 0.1)
METHODS = ("plain", "plain_bf16", "ciera", "checksum", "ciera_checked")


def parse_args(argv=None):
    p = parser(__doc__, "gather_bench")
    p.add_argument("--experts", type=int, nargs="+", default=None,
                   help=f"experts per tensor (E in (E, {D_MODEL}, {D_FF}); default CPU "
                        f"{' '.join(map(str, CPU_EXPERTS))}, "
                        f"GPU {' '.join(map(str, GPU_EXPERTS))})")
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
    return p.parse_args(argv)


def checksum_fns(mesh, ndim: int, axis: int) -> dict:
    """The checksum work a self-checking gather adds, jitted two ways:

    ``checksum``       ``(shard, full_stack) -> per-rank sums`` alone: the sender's checksum of
                       its shard and the receiver's per-rank checksums of a rebuilt tensor
                       (``full_stack``: a gather's stacked output), a separate pass;
    ``ciera_checked``  the CIERA gather with both checksums in the same jit (the sums ride a
                       tiny extra all-gather here; integrated, they would ride the payload),
                       ``stats["verify_failed"]`` counting mismatching shards.
    """
    # Imported here: JAX must start after main() has set the device count.
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    import ciera_jax
    from ciera_jax.calibrate.kit import STAT_KEYS
    from ciera_jax.codec.checksum import checksum, checksum_shards
    from ciera_jax.fsdp import AXIS, spec_for

    N = mesh.devices.size
    spec = spec_for(axis, ndim)

    def alone(x, full_stack):
        sent = checksum(x, lax.axis_index(AXIS) * x.size, axis=axis)
        return (checksum_shards(full_stack[0], axis, N) ^ sent)[None]

    def checked(x, cache):
        full, c, s = ciera_jax.all_gather(x, cache, AXIS, axis=axis)
        sent_R = lax.all_gather(checksum(x, lax.axis_index(AXIS) * x.size, axis=axis), AXIS)
        stats = {k: s[k][None] for k in STAT_KEYS}
        stats["verify_failed"] = jnp.sum(checksum_shards(full, axis, N) != sent_R)[None]
        return full[None], c, stats

    def jit(fn, in_specs, out_specs):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))

    return {"checksum": jit(alone, (spec, P(AXIS)), P(AXIS)),
            "ciera_checked": jit(checked, (spec, P()), (P(AXIS), P(), P(AXIS)))}


def measure_all(mesh, shape, axis: int, churn: float, fns: dict, methods, reps: int,
                warmup: int, sync=None) -> list[dict]:
    """``measure_gathers`` for ``methods``, the ``checksum`` one given the rebuilt tensor of the
    same weights the gathers move (what a receiver would check)."""
    import jax
    import jax.numpy as jnp

    from ciera_jax.calibrate.kit import measure_gathers, weight_pair

    fns = dict(fns)
    if "checksum" in methods:
        xa, _ = weight_pair(mesh, shape, axis, churn, jnp.bfloat16)  # measure_gathers' xa
        full_stack = jax.block_until_ready(fns["plain"](xa))
        check = fns["checksum"]
        fns["checksum"] = lambda x: check(x, full_stack)
    return measure_gathers(mesh, shape, axis, churn, methods, reps=reps, warmup=warmup,
                           dtype=jnp.bfloat16, fns=fns, sync=sync)


def main(argv=None) -> int:
    args = parse_args(argv)
    from ciera_jax.runtime.devices import setup_devices

    setup_devices(args.devices)
    # JAX and the library load after the device count is set.
    import jax

    from ciera_jax.calibrate.kit import gather_fns
    from ciera_jax.runtime.devices import make_mesh

    devs = jax.devices()
    on_cpu = devs[0].platform == "cpu"
    mesh = make_mesh(args.devices if on_cpu else None)
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
        # Compiled once per shape, reused per churn.
        fns = {**gather_fns(mesh, len(shape), axis), **checksum_fns(mesh, len(shape), axis)}
        for churn in args.churn:
            recs = measure_all(mesh, shape, axis, churn, fns, METHODS, args.reps, args.warmup)
            rows.append(_row(recs, shape, axis, N, churn))
            _print_row(rows[-1], header=len(rows) == 1)
    elapsed = time.perf_counter() - t_start
    write_results(args.out, dict(
        rows=rows, reps=args.reps, warmup=args.warmup, seconds=elapsed,
        notes=["time_ratio = ciera / plain bits (speedup = 1/time_ratio)",
               "wire_ratio = bytes one rank sends, ciera / plain (patches + agreement included)",
               "plain_bf16 is lax.all_gather of bf16: shown, not the baseline",
               "checksum_s: own shard + every rank's shard of the rebuilt tensor, one call; "
               "checksum_vs_ciera = checksum_s / ciera_s",
               "ciera_checked_s: the gather with both checksums in one jit; checked_vs_ciera = "
               "ciera_checked_s / ciera_s - 1 (what checking adds to the gather)",
               "*_min: the same ratios from each method's fastest repetition"]))
    return 0


def _row(recs: list[dict], shape, axis: int, N: int, churn: float) -> dict:
    by = {r["method"]: r for r in recs}
    st = by["ciera"]["stats"]
    return dict(shape=list(shape), axis=axis, N=N, mb=by["plain"]["n_bytes"] / 2**20,
                churn=churn, measured_churn=by["ciera"]["change_rate"],
                plain_bits_s=by["plain"]["seconds"], plain_bf16_s=by["plain_bf16"]["seconds"],
                ciera_s=by["ciera"]["seconds"], checksum_s=by["checksum"]["seconds"],
                ciera_checked_s=by["ciera_checked"]["seconds"],
                verify_failed=by["ciera_checked"]["stats"]["verify_failed"],
                time_ratio=by["ciera"]["seconds"] / by["plain"]["seconds"],
                checksum_vs_ciera=by["checksum"]["seconds"] / by["ciera"]["seconds"],
                checked_vs_ciera=by["ciera_checked"]["seconds"] / by["ciera"]["seconds"] - 1,
                # The same ratios from the fastest repetition: on a loaded machine the least
                # disturbed estimate of what the work itself costs.
                checksum_vs_ciera_min=min(by["checksum"]["times"]) / min(by["ciera"]["times"]),
                checked_vs_ciera_min=(min(by["ciera_checked"]["times"])
                                      / min(by["ciera"]["times"]) - 1),
                wire_ratio=by["ciera"]["wire_ratio"], rung=st["rung"],
                fallback=bool(st["fallback"]), times={m: r["times"] for m, r in by.items()})


def _print_row(r: dict, header: bool) -> None:
    if header:
        print(f"{'shape':>16} {'MB':>5} {'churn':>6} {'meas':>7} {'bits ms':>9} {'bf16 ms':>9} "
              f"{'ciera ms':>9} {'chk ms':>8} {'t ciera/bits':>12} {'chk/ciera':>9} "
              f"{'fused +':>8} {'(min)':>13} "
              f"{'wire c/p':>8} {'rung':>4} {'fb':>3}")
    print(f"{'x'.join(map(str, r['shape'])):>16} {r['mb']:5.0f} {r['churn']:6.2%} "
          f"{r['measured_churn']:7.3%} {r['plain_bits_s'] * 1e3:9.2f} "
          f"{r['plain_bf16_s'] * 1e3:9.2f} {r['ciera_s'] * 1e3:9.2f} "
          f"{r['checksum_s'] * 1e3:8.2f} {r['time_ratio']:12.2f} {r['checksum_vs_ciera']:9.1%} "
          f"{r['checked_vs_ciera']:8.1%} "
          f"{r['checksum_vs_ciera_min']:6.0%}/{r['checked_vs_ciera_min']:<6.0%} "
          f"{r['wire_ratio']:8.3f} {r['rung']:>4} {'y' if r['fallback'] else '-':>3}",
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
