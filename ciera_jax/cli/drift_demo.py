"""Gather a drifting expert weight with CIERA; print bytes saved and the bitwise check.

A quick look at the library without a model: each step moves a bf16 expert tensor the way an
optimizer step does, gathers it with the compressed all-gather, and checks the result bit for
bit against the input. Word mode (the default, what ``ciera train`` uses where the memory
allows): every word moves by a few units in the last place, drawn from the moves measured at
steady state, and travels as a short code of its move. Exponent mode: every mantissa moves and
a small fraction of exponents change; sign and mantissa travel whole. The command is
:mod:`ciera_jax.cli.demo`; :func:`gather_step` and :func:`drift` also serve the benchmarks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ciera_jax
from ciera_jax.calibrate.kit import RAW_MAX, STEADY_CDF
from ciera_jax.collective.gather import MODE_EXPONENT, MODE_WORD
from ciera_jax.fsdp import AXIS

MODES = ("word", "exponent")
# What the "sent as" column says for ``stats["mode"]``; a plain gather also says why.
SENT_AS = {MODE_WORD: "words", MODE_EXPONENT: "exponents"}


def demo(mesh, shape: tuple[int, ...], steps: int, churn: float, seed: int = 0,
         out=print, mode: str = "word") -> bool:
    """Run ``steps`` drifting gathers of a bf16 tensor of ``shape`` on ``mesh`` with a
    ``mode`` cache, printing one row per step; True when every rank's gathered tensor equalled
    the input bit for bit. ``churn``: exponent mode's fraction of exponents changed per
    step."""
    n = mesh.devices.size
    if shape[0] % n:
        raise ValueError(f"--shape {','.join(map(str, shape))}: first dimension must divide by "
                         f"{n} devices")
    if mode not in MODES:
        raise ValueError(f"--mode {mode}: choose one of {', '.join(MODES)}")
    step = gather_step(mesh)
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * 0.02).astype(jnp.bfloat16)
    cache = ciera_jax.init_cache(shape, jnp.bfloat16, mode=mode)
    moves = ("every word moves a few units in the last place per step, as at steady state"
             if mode == "word" else f"{churn:.2%} of exponents change per step")
    out(f"{mode} mode: {n} devices, tensor {shape} bf16 ({w.nbytes / 2**20:.1f} MiB); {moves}")
    out(f"{'step':>4}  {'sent as':<24}{'sent MiB':>9}{'plain MiB':>10}{'of plain':>9}"
        f"{'exponents changed':>18}  every rank")
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
        out(f"{t:>4}  {_sent_as(stats, t):<24}{sent / 2**20:>9.2f}{plain / 2**20:>10.2f}"
            f"{sent / plain:>9.3f}{int(stats['changed'].sum()):>18}  "
            f"{'exact' if exact else 'DIFFERS'}")
        w = drift(rng, w, churn) if mode == "exponent" else word_drift(rng, w)
    out(f"total: sent {total_sent / 2**20:.2f} MiB of {total_plain / 2**20:.2f} MiB "
        f"({total_sent / total_plain:.3f} of plain), bitwise exact on every rank: {all_exact}")
    return all_exact


def _sent_as(stats, t: int) -> str:
    """The "sent as" cell: words or exponents, or plainly and why."""
    if not bool(stats["fallback"][0]):
        return SENT_AS.get(int(stats["mode"][0]), "plain")
    return "plain (fills the cache)" if t == 0 else "plain (too many moves)"


def gather_step(mesh):
    """jit(shard_map) of one CIERA gather on axis 0 over ``fsdp``: (w, cache) -> (every rank's
    full tensor stacked, new cache, every rank's stats stacked)."""

    def body(w, cache):
        full, cache, stats = ciera_jax.all_gather(w, cache, AXIS)
        return full[None], cache, jax.tree.map(lambda v: v[None], stats)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), P()),
                                 out_specs=(P(AXIS), P(), P(AXIS))))


def word_drift(rng, w):
    """Move every word by ``d`` units in the last place (in the order of the values), ``|d|``
    drawn from the steady-state moves :data:`~ciera_jax.calibrate.kit.STEADY_CDF`, random
    sign."""
    edges = [0] + [k for k, _ in STEADY_CDF] + [RAW_MAX]
    cdf = np.asarray([p for _, p in STEADY_CDF] + [1.0])
    band = np.searchsorted(cdf, rng.random(w.size))
    lo = np.asarray([0] + [e + 1 for e in edges[1:-1]])[band]
    hi = np.asarray([0] + edges[2:])[band]
    d = lo + np.floor(rng.random(w.size) * (hi - lo + 1)).astype(np.int64)
    d = np.where(rng.random(w.size) < 0.5, d, -d)
    bits = w.view(np.uint16).reshape(-1).astype(np.int64)
    # bf16 bits -> a monotone integer (negatives below zero), moved, and back
    order = np.where(bits & 0x8000, -(bits & 0x7FFF), bits) + d
    order = np.clip(order, -0x7F7F, 0x7F7F)  # stay finite
    out = np.where(order < 0, 0x8000 | -order, order).astype(np.uint16)
    return out.reshape(w.shape).view(w.dtype)


def drift(rng, w, churn):
    """Move every mantissa; change the exponent of a ``churn`` fraction of elements by +-1."""
    bits = w.view(np.uint16).copy().reshape(-1)
    bits ^= rng.integers(0, 0x80, size=bits.size, dtype=np.uint16)
    pos = rng.random(bits.size) < churn
    exp = (bits[pos] >> 7) & 0xFF
    exp = np.where(exp >= 0xFE, exp - 1, exp + 1).astype(np.uint16)
    bits[pos] = (bits[pos] & 0x807F) | (exp << 7)
    return bits.reshape(w.shape).view(w.dtype)
