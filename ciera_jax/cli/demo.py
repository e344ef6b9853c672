"""Gather a drifting weight with CIERA (word mode; --mode exponent): bytes saved, bitwise check.

The work is :func:`ciera_jax.cli.drift_demo.demo`; this module only reads the command line.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=8, help="emulated CPU devices (default 8)")
    p.add_argument("--steps", type=int, default=8, help="gathers to run (default 8)")
    p.add_argument("--shape", default="64,256,128", help="full tensor shape, e.g. E,D,F")
    p.add_argument("--mode", choices=("word", "exponent"), default="word",
                   help="word: each word travels as a short code of its move since the "
                   "cache (what `ciera train` uses where memory allows); exponent: sign and "
                   "mantissa travel, exponents only where they changed (default word)")
    p.add_argument("--churn", type=float, default=0.001,
                   help="exponent mode: fraction of exponents changed per step (default 0.001)")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    if args.devices < 1:
        raise ValueError(f"--devices {args.devices}: use a positive device count")
    try:
        shape = tuple(int(s) for s in args.shape.split(","))
    except ValueError:
        raise ValueError(f"--shape {args.shape}: write integers separated by commas, "
                         "e.g. 64,256,128") from None
    # Imported here, not at the top: the device count must be set before JAX starts, and
    # building the `ciera` parser must not pay for JAX.
    from ciera_jax.runtime.devices import setup_devices

    setup_devices(args.devices)
    import jax

    from ciera_jax.cli.drift_demo import demo
    from ciera_jax.runtime.devices import make_mesh

    devs = jax.devices()  # --devices counts emulated CPU devices; accelerators are all used
    n = min(args.devices, len(devs)) if devs[0].platform == "cpu" else len(devs)
    return 0 if demo(make_mesh(n), shape, args.steps, args.churn, args.seed,
                     mode=args.mode) else 1
