"""Gather a drifting expert weight with CIERA; print bytes saved and the bitwise check.

A quick look at the library without a model: each step perturbs a bf16 expert tensor the way
an optimizer step does (every mantissa moves, a small fraction of exponents change), gathers it
with the compressed all-gather, and checks the result bit for bit against the input. The
command is :mod:`ciera_jax.cli.demo`; :func:`gather_step` and :func:`drift` also serve the
benchmarks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ciera_jax
from ciera_jax.fsdp import AXIS


def demo(mesh, shape: tuple[int, ...], steps: int, churn: float, seed: int = 0,
         out=print) -> bool:
    """Run ``steps`` drifting gathers of a bf16 tensor of ``shape`` on ``mesh``, printing one
    row per step; True when every rank's gathered tensor equalled the input bit for bit."""
    n = mesh.devices.size
    if shape[0] % n:
        raise ValueError(f"--shape {','.join(map(str, shape))}: first dimension must divide by "
                         f"{n} devices")
    step = gather_step(mesh)
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * 0.02).astype(jnp.bfloat16)
    cache = ciera_jax.init_cache(shape, jnp.bfloat16)
    out(f"{n} devices, tensor {shape} bf16 ({w.nbytes / 2**20:.1f} MiB), "
        f"churn {churn:.2%} of exponents per step")
    out(f"{'step':>4} {'path':>10} {'sent MiB':>9} {'plain MiB':>9} {'ratio':>6} "
        f"{'changed':>8} {'bitwise':>8}")
    total_sent = total_plain = 0
    all_exact = True
    for t in range(steps):
        placed = jax.device_put(w, NamedSharding(mesh, P(AXIS)))
        full, cache, stats = step(placed, cache)
        stats = jax.tree.map(np.asarray, stats)
        want = w.view(np.uint16)
        exact = all(np.array_equal(np.asarray(s.data)[0].view(np.uint16), want)
                    for s in full.addressable_shards)
        all_exact &= exact
        sent, plain = int(stats["sent_bytes"].sum()), int(stats["plain_bytes"].sum())
        total_sent, total_plain = total_sent + sent, total_plain + plain
        path = "plain" if bool(stats["fallback"][0]) else f"rung {int(stats['rung'][0])}"
        out(f"{t:>4} {path:>10} {sent / 2**20:>9.2f} {plain / 2**20:>9.2f} "
            f"{sent / plain:>6.3f} {int(stats['changed'].sum()):>8} "
            f"{'exact' if exact else 'DIFFERS':>8}")
        w = drift(rng, w, churn)
    out(f"total: sent {total_sent / 2**20:.2f} MiB of {total_plain / 2**20:.2f} MiB "
        f"({total_sent / total_plain:.3f}), bitwise exact on every rank: {all_exact}")
    return all_exact


def gather_step(mesh):
    """jit(shard_map) of one CIERA gather on axis 0 over ``fsdp``: (w, cache) -> (every rank's
    full tensor stacked, new cache, every rank's stats stacked)."""

    def body(w, cache):
        full, cache, stats = ciera_jax.all_gather(w, cache, AXIS)
        return full[None], cache, jax.tree.map(lambda v: v[None], stats)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), P()),
                                 out_specs=(P(AXIS), P(), P(AXIS))))


def drift(rng, w, churn):
    """Move every mantissa; change the exponent of a ``churn`` fraction of elements by +-1."""
    bits = w.view(np.uint16).copy().reshape(-1)
    bits ^= rng.integers(0, 0x80, size=bits.size, dtype=np.uint16)
    pos = rng.random(bits.size) < churn
    exp = (bits[pos] >> 7) & 0xFF
    exp = np.where(exp >= 0xFE, exp - 1, exp + 1).astype(np.uint16)
    bits[pos] = (bits[pos] & 0x807F) | (exp << 7)
    return bits.reshape(w.shape).view(w.dtype)
