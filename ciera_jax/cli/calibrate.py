"""Measure alpha, beta, codec rate and agreement on this mesh and write a cost-model profile.

    ciera calibrate --out profile.json [--devices 8] [--sizes 4K 64K 1M 8M] [--reps 7]
        [--fault-sizes 8M 16M 24M 32M 48M]

What is measured and how: :mod:`ciera_jax.calibrate`.
"""

from __future__ import annotations

import argparse
import sys
import time

from ciera_jax.calibrate.defaults import (CPU_CODEC_SIZES, CPU_FAULT_SIZES, CPU_SIZES,
                                          GPU_CODEC_SIZES, GPU_SIZES, mesh_sizes_for)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="profile.json", help="profile JSON to write")
    p.add_argument("--devices", type=int, default=None,
                   help="emulated CPU devices (default 8; ignored on GPU, where all local "
                        "devices are used)")
    p.add_argument("--sizes", nargs="+", default=None,
                   help="full-tensor sizes for the gather fit, e.g. 4K 64K 1M 8M "
                        f"(default CPU {' '.join(CPU_SIZES)}; GPU {' '.join(GPU_SIZES)})")
    p.add_argument("--codec-sizes", nargs="+", default=None,
                   help=f"sizes for the codec fit (default CPU {' '.join(CPU_CODEC_SIZES)}; "
                        f"GPU {' '.join(GPU_CODEC_SIZES)})")
    p.add_argument("--fault-sizes", nargs="*", default=None,
                   help="sizes of the plain gathers that fit the host's fresh-memory faults "
                        "and its copies beyond the last-level cache "
                        f"on the full mesh (default CPU {' '.join(CPU_FAULT_SIZES)}; none on GPU; "
                        "give the flag alone to skip)")
    p.add_argument("--mesh-sizes", type=int, nargs="+", default=None,
                   help="device counts to time gathers on (default 2, 4, 8, ... up to all)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per point (median)")
    p.add_argument("--name", default=None, help="profile name (default calibrated-<platform>-<N>)")


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: the device count must be set before JAX starts, and
    # building the `ciera` parser must not pay for JAX.
    from ciera_jax.runtime.devices import setup_devices
    from ciera_jax.runtime.outputs import check_output_file

    check_output_file(args.out, "--out")  # before minutes of measuring, not after
    if args.devices is not None and args.devices < 1:
        raise ValueError(f"--devices {args.devices}: use a positive device count")
    if "jax" not in sys.modules or not _backends_ready():
        setup_devices(args.devices)
    import jax

    from ciera_jax.calibrate import calibrate, profile_table

    if args.reps < 1:
        raise ValueError("--reps must be at least 1")
    n_dev = len(jax.devices())
    mesh_sizes = args.mesh_sizes
    if args.devices is not None and jax.devices()[0].platform == "cpu":
        if args.devices > n_dev:
            raise ValueError(f"--devices {args.devices}: JAX already started with {n_dev} CPU "
                             "devices in this process")
        mesh_sizes = mesh_sizes or mesh_sizes_for(args.devices)
    if mesh_sizes and max(mesh_sizes) > n_dev:
        raise ValueError(f"--mesh-sizes {mesh_sizes}: only {n_dev} devices")
    t0 = time.perf_counter()
    prof, _ = calibrate(mesh_sizes, args.sizes, args.codec_sizes, args.reps, args.name,
                        fault_sizes=args.fault_sizes)
    prof.save(args.out)
    print(profile_table(prof))
    print(f"wrote {args.out} ({time.perf_counter() - t0:.1f} s)")
    return 0


def _backends_ready() -> bool:
    """Whether JAX has started its backends (then the device count is fixed)."""
    try:
        from jax._src import xla_bridge  # JAX's own private state: no public query exists

        return bool(xla_bridge._backends)
    except Exception:  # noqa: BLE001 - private API moved: assume started, keep the flags alone
        return True
