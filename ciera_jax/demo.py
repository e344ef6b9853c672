"""Gather a drifting expert weight with CIERA on emulated devices; print bytes saved and the check.

A quick look at the library without a model: each step perturbs a bf16 expert tensor the way
an optimizer step does (every mantissa moves, a small fraction of exponents change), gathers it
with the compressed all-gather, and checks the result bit for bit against the input.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=8, help="emulated CPU devices (default 8)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--shape", default="64,256,128", help="full tensor shape, e.g. E,D,F")
    p.add_argument("--churn", type=float, default=0.001,
                   help="fraction of exponents changed per step (default 0.001)")
    p.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    from ciera_jax.devices import setup_devices

    setup_devices(args.devices)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import ciera_jax

    shape = tuple(int(s) for s in args.shape.split(","))
    n = jax.device_count()
    if shape[0] % n:
        raise ValueError(f"--shape {args.shape}: first dimension must divide by {n} devices")
    mesh = jax.make_mesh((n,), ("fsdp",))
    step = gather_step(mesh)
    rng = np.random.default_rng(args.seed)
    w = (rng.standard_normal(shape) * 0.02).astype(jnp.bfloat16)
    cache = ciera_jax.init_cache(shape, jnp.bfloat16)
    print(f"{n} devices, tensor {shape} bf16 ({w.nbytes / 2**20:.1f} MiB), "
          f"churn {args.churn:.2%} of exponents per step")
    print(f"{'step':>4} {'path':>10} {'sent MiB':>9} {'plain MiB':>9} {'ratio':>6} "
          f"{'changed':>8} {'bitwise':>8}")
    total_sent = total_plain = 0
    all_exact = True
    for t in range(args.steps):
        placed = jax.device_put(w, NamedSharding(mesh, P("fsdp")))
        full, cache, stats = step(placed, cache)
        stats = jax.tree.map(np.asarray, stats)
        want = w.view(np.uint16)
        exact = all(np.array_equal(np.asarray(s.data)[0].view(np.uint16), want)
                    for s in full.addressable_shards)
        all_exact &= exact
        sent, plain = int(stats["sent_bytes"].sum()), int(stats["plain_bytes"].sum())
        total_sent, total_plain = total_sent + sent, total_plain + plain
        path = "plain" if bool(stats["fallback"][0]) else f"tier {int(stats['tier'][0])}"
        print(f"{t:>4} {path:>10} {sent / 2**20:>9.2f} {plain / 2**20:>9.2f} "
              f"{sent / plain:>6.3f} {int(stats['changed'].sum()):>8} "
              f"{'exact' if exact else 'DIFFERS':>8}")
        w = drift(rng, w, args.churn)
    print(f"total: sent {total_sent / 2**20:.2f} MiB of {total_plain / 2**20:.2f} MiB "
          f"({total_sent / total_plain:.3f}), bitwise exact on every rank: {all_exact}")
    return 0 if all_exact else 1


def gather_step(mesh):
    """jit(shard_map) of one CIERA gather on axis 0 over ``fsdp``: (w, cache) -> (every rank's
    full tensor stacked, new cache, every rank's stats stacked)."""
    import jax
    from jax.sharding import PartitionSpec as P

    import ciera_jax

    def body(w, cache):
        full, cache, stats = ciera_jax.all_gather(w, cache, "fsdp")
        return full[None], cache, jax.tree.map(lambda v: v[None], stats)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P()),
                                 out_specs=(P("fsdp"), P(), P("fsdp"))))


def drift(rng, w, churn):
    """Move every mantissa; change the exponent of a ``churn`` fraction of elements by +-1."""
    import numpy as np

    bits = w.view(np.uint16).copy().reshape(-1)
    bits ^= rng.integers(0, 0x80, size=bits.size, dtype=np.uint16)
    pos = rng.random(bits.size) < churn
    exp = (bits[pos] >> 7) & 0xFF
    exp = np.where(exp >= 0xFE, exp - 1, exp + 1).astype(np.uint16)
    bits[pos] = (bits[pos] & 0x807F) | (exp << 7)
    return bits.reshape(w.shape).view(w.dtype)
