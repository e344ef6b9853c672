"""Fault injection for the self-checking gather: corrupt one rank's copy of a replicated cache,
as an HBM bit flip, a zeroed buffer or a stale restore would.

Test and drill tooling (``ciera train --inject-cache-fault``), not part of a training step: it
rewrites one device's buffer of a global array on the host, so replicas that JAX assumes equal
stop being equal, which is exactly the fault a cache that remembers can suffer.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

from ciera_jax.collective.cache import ExponentCache, WordCache


def corrupt_replica(x: jax.Array, device, fn: Callable[[np.ndarray], np.ndarray]) -> jax.Array:
    """``x`` (a replicated global array) with the copy on ``device`` replaced by ``fn(copy)``;
    the other copies are untouched. A process that does not hold ``device`` passes it on."""
    buffers = []
    for shard in x.addressable_shards:
        data = shard.data
        if shard.device == device:
            data = jax.device_put(np.asarray(fn(np.array(data))), shard.device)
        buffers.append(data)
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, buffers)


def flip_bits(a: np.ndarray, rng: np.random.Generator, n_bits: int = 1) -> np.ndarray:
    """``a`` with ``n_bits`` distinct random bits flipped."""
    raw = np.ascontiguousarray(a).view(np.uint8).reshape(-1).copy()
    at = rng.choice(raw.size * 8, size=min(n_bits, raw.size * 8), replace=False)
    np.bitwise_xor.at(raw, at // 8, (1 << (at % 8)).astype(np.uint8))
    return raw.view(a.dtype).reshape(a.shape)


def cache_data(cache) -> str:
    """The field of a cache that holds what it remembers."""
    if isinstance(cache, WordCache):
        return "words"
    if isinstance(cache, ExponentCache):
        return "exp"
    raise TypeError(f"not a CIERA cache: {type(cache).__name__}")


def corrupt_cache(cache, device, fn: Callable[[np.ndarray], np.ndarray]):
    """``cache`` with ``fn`` applied to what ``device`` remembers (exponents or words)."""
    field = cache_data(cache)
    return dataclasses.replace(cache, **{field: corrupt_replica(getattr(cache, field), device,
                                                                fn)})


def flip_cache_bits(cache, device, *, seed: int = 0, n_bits: int = 1):
    """One rank's cache with ``n_bits`` random bits flipped (default: one, an HBM upset)."""
    rng = np.random.default_rng(seed)
    return corrupt_cache(cache, device, lambda a: flip_bits(a, rng, n_bits))
