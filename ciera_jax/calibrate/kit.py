"""The gather timing kit: weight pairs with controlled exponent churn or steady-state word moves,
jitted gathers of them, and interleaved timing. Calibration, the gather benchmarks and the simulator tests share it, so
every figure they quote is timed the same way."""

from __future__ import annotations

import functools
import math
import resource
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ciera_jax.codec import bitfields, wordcodec
from ciera_jax.collective.cache import init_cache
from ciera_jax.collective.gather import all_gather, plain_all_gather
from ciera_jax.runtime.partition import AXIS, spec_for

STAT_KEYS = ("sent_bytes", "plain_bytes", "changed", "agreed_changed", "rung", "fallback")


def weight_pair(mesh, shape, axis: int, change_rate: float, dtype=None, seed: int = 0):
    """Two weight-like tensors ``(xa, xb)`` sharded on ``axis``, built on the devices.

    ``xa`` is normal(0, 0.02) in ``dtype`` (bf16 by default); ``xb`` differs from it in every
    mantissa's lowest bit and, with probability ``change_rate`` per element, in the exponent's
    lowest bit. Gathering them alternately with a carried cache changes a ``change_rate`` share
    of exponents every step: CIERA's steady state at that churn.
    """
    dtype = jnp.bfloat16 if dtype is None else dtype
    fmt = bitfields.word_format(dtype)
    sharding = NamedSharding(mesh, spec_for(axis, len(shape)))

    @functools.partial(jax.jit, out_shardings=(sharding, sharding))
    def gen():
        k1, k2 = jax.random.split(jax.random.key(seed))
        xa = (0.02 * jax.random.normal(k1, shape, jnp.float32)).astype(dtype)
        bits = bitfields.to_bits(xa)
        one = jnp.asarray(1, bits.dtype)
        flip = jax.random.uniform(k2, shape) < change_rate
        exp_bit = jnp.where(flip, one << fmt.mantissa_bits, jnp.zeros_like(one))
        return xa, bitfields.from_bits(bits ^ one ^ exp_bit, dtype)

    return gen()


# P(|d| <= k) at steady state, small 1e-3 (shared/studies/word_delta/report.md): |d| in ulps.
STEADY_CDF = ((0, 0.43), (1, 0.74), (3, 0.88), (7, 0.94), (127, 0.997))
RAW_MAX = 4096  # |d| of the remaining 0.3%: up to 32 binades of bf16 ulps


def word_pair(mesh, shape, axis: int, seed: int = 0):
    """``(xa, xb)`` bf16 on the devices: xa ~ normal(0, 0.02), xb = xa with every word moved
    by d ulps (in the monotone order), |d| drawn from :data:`STEADY_CDF` (uniform inside each
    band), random sign. Alternating them is word mode's steady state."""
    sharding = NamedSharding(mesh, spec_for(axis, len(shape)))
    edges = [0] + [k for k, _ in STEADY_CDF] + [RAW_MAX]
    cdf = [p for _, p in STEADY_CDF] + [1.0]

    @functools.partial(jax.jit, out_shardings=(sharding, sharding))
    def gen():
        k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
        xa = (0.02 * jax.random.normal(k1, shape, jnp.float32)).astype(jnp.bfloat16)
        band = jnp.searchsorted(jnp.asarray(cdf), jax.random.uniform(k2, shape))
        lo = jnp.asarray([0] + [e + 1 for e in edges[1:-1]])[band]
        hi = jnp.asarray([0] + edges[2:])[band]
        mag = lo + jnp.floor(jax.random.uniform(k3, shape) * (hi - lo + 1)).astype(jnp.int32)
        d = jnp.where(jax.random.bernoulli(k4, 0.5, shape), mag, -mag)
        bits = wordcodec.apply_delta(bitfields.to_bits(xa), d)
        return xa, bitfields.from_bits(bits, jnp.bfloat16)

    return gen()


def block(x):
    return jax.block_until_ready(x)


def jit_shard_map(fn, mesh, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def gather_fns(mesh, ndim: int, axis: int) -> dict[str, Callable]:
    """Jitted gathers of a tensor sharded on ``axis``: ``plain`` (bits), ``plain_bf16``
    (``lax.all_gather`` of the floats) and ``ciera`` (``(x, cache) -> (full, cache, stats)``).
    Every one returns the gathered tensor, so nothing is optimized away."""
    spec = spec_for(axis, ndim)

    def plain(x):
        return plain_all_gather(x, AXIS, axis=axis)[None]

    def plain_bf16(x):
        return lax.all_gather(x, AXIS, axis=axis, tiled=True)[None]

    def ciera(x, cache):
        full, c, s = all_gather(x, cache, AXIS, axis=axis)
        return full[None], c, {k: s[k][None] for k in STAT_KEYS}

    return {
        "plain": jit_shard_map(plain, mesh, (spec,), P(AXIS)),
        "plain_bf16": jit_shard_map(plain_bf16, mesh, (spec,), P(AXIS)),
        "ciera": jit_shard_map(ciera, mesh, (spec, P()), (P(AXIS), P(), P(AXIS))),
    }


def replicated_cache(mesh, shape, dtype, mode: str = "exponent"):
    """A fresh (unprimed) cache of ``mode`` for a tensor of ``shape``, replicated on ``mesh``."""
    return jax.jit(lambda: init_cache(shape, dtype, mode),
                   out_shardings=NamedSharding(mesh, P()))()


class CieraStepper:
    """Alternates ``xa``/``xb`` through the CIERA gather carrying the cache (primed on build),
    so every call is a steady-state gather at the pair's churn. ``stats`` of the last call."""

    def __init__(self, fn, xa, xb, cache):
        self.fn, self.xs, self.flip = fn, (xa, xb), 0
        _, self.cache, _ = block(fn(xb, cache))  # priming gather (plain fallback)
        self.last = None

    def __call__(self):
        out, self.cache, self.last = self.fn(self.xs[self.flip], self.cache)
        self.flip ^= 1
        return block(out)

    def stats(self) -> dict:
        """Rank 0's stats of the last call as Python numbers (in multi-process: the first
        addressable shard)."""
        out = {}
        for k, v in self.last.items():
            shard = v.addressable_shards[0]
            out[k] = np.asarray(shard.data).reshape(-1)[0].item()
        return out


def fresh_bytes_so_far() -> int:
    """Bytes of memory this process has faulted in so far (minor page faults x page size): a
    call's difference is the fresh host memory it touched (the cost model's ``fault_Bps``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt * resource.getpagesize()


def time_interleaved(calls: dict[str, Callable[[], object]], reps: int = 7,
                     warmup: int = 2, fresh: dict | None = None,
                     sync: Callable[[], object] | None = None) -> dict[str, list[float]]:
    """Seconds per call of each callable, round-robin so drift and load hit all alike.
    ``fresh`` (a dict), if given, receives each callable's fresh bytes per timed call.
    ``sync``, if given, runs untimed before each timed call: across processes, a barrier, so a
    collective's time does not include its peers still finishing the call before it."""
    for _ in range(warmup):
        for f in calls.values():
            block(f())
    times = {k: [] for k in calls}
    faulted = {k: [] for k in calls}
    for _ in range(reps):
        for k, f in calls.items():
            if sync is not None:
                sync()
            f0 = fresh_bytes_so_far()
            t0 = time.perf_counter()
            block(f())
            times[k].append(time.perf_counter() - t0)
            faulted[k].append(fresh_bytes_so_far() - f0)
    if fresh is not None:
        fresh.update(faulted)
    return times


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def median_call(fn, *args, reps: int, warmup: int = 2) -> float:
    """Median seconds of ``fn(*args)`` over ``reps`` calls after ``warmup``."""
    return median(time_interleaved({"f": functools.partial(fn, *args)}, reps, warmup)["f"])


def measure_gathers(mesh, shape, axis: int, change_rate: float,
                    methods: Sequence[str] = ("plain", "ciera"), reps: int = 7,
                    warmup: int = 2, dtype=None, fns: dict | None = None,
                    sync: Callable[[], object] | None = None) -> list[dict]:
    """Median seconds per gather of a weight pair of ``shape`` for each method, interleaved.

    ``fns`` maps each method to a jitted gather (default :func:`gather_fns`); methods named
    ``ciera...`` take ``(x, cache)`` and carry the cache, the others take ``x``.

    Returns records for :func:`ciera_jax.sim.step.compare_to_measurements`: ``n_bytes`` (full
    tensor), ``N``, ``method`` (``plain_bf16`` maps to the model's ``plain``), ``seconds``,
    ``change_rate`` (measured: agreed changes / shard elements), CIERA's stats, ``fresh_bytes``
    (median fresh host memory this process faulted in per call).
    """
    dtype = jnp.bfloat16 if dtype is None else dtype
    N = mesh.devices.size
    fns = fns or gather_fns(mesh, len(shape), axis)
    xa, xb = weight_pair(mesh, shape, axis, change_rate, dtype)
    calls: dict[str, Callable] = {}
    for m in methods:
        if m.startswith("ciera"):  # carries a cache: (x, cache) -> (full, cache, stats)
            calls[m] = CieraStepper(fns[m], xa, xb, replicated_cache(mesh, shape, dtype))
        else:
            calls[m] = functools.partial(fns[m], xa)
    fresh: dict = {}
    times = time_interleaved(calls, reps=reps, warmup=warmup, fresh=fresh, sync=sync)
    n_bytes = math.prod(shape) * np.dtype(dtype).itemsize
    n_local = math.prod(shape) // N
    recs = []
    for m, ts in times.items():
        rec = dict(method=m, n_bytes=n_bytes, N=N, shape=list(shape), axis=axis,
                   seconds=median(ts), times=ts, target_change_rate=change_rate,
                   fresh_bytes=median(fresh[m]))
        if m.startswith("ciera"):
            stats = calls[m].stats()
            rec.update(stats=stats, change_rate=stats["agreed_changed"] / n_local,
                       wire_ratio=stats["sent_bytes"] / stats["plain_bytes"])
        else:
            rec.update(change_rate=0.0, wire_ratio=1.0)
        recs.append(rec)
    return recs
