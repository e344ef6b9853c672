"""A 32-bit position-mixing checksum of a shard's true words, for a gather that checks itself.

Every rank sends ``checksum(shard, offset)`` of the words it holds; every receiver computes
``checksum_shards(full, axis, n_ranks)`` over the tensor it rebuilt and compares one value per
rank. A cache that drifted on one rank (a flipped bit, a stale restore) then shows up in the
step it happens.

The sum is ``sum_i fmix32(word_i ^ key(pos_i)) mod 2**32`` with ``key(p) = p * 0x9E3779B9 +
seed``. ``fmix32`` (murmur3's finalizer) and XOR with a key are bijections on uint32, so a change
of any single word changes its term and hence the sum, with certainty; several changed words
cancel with probability about 2**-32. The key mixes in the position, so words moved to the
wrong place (a shard in the wrong slot, a transposed block) are caught too.

Positions are global: element ``p`` is the flat index in ``moveaxis(full, axis, 0)``, the
order in which a rank's shard on ``axis`` is one contiguous run starting at ``rank *
shard.size``. So a receiver can check each rank's slice of a rebuilt tensor against the value
that rank sent, with no transpose (:func:`checksum_shards`).

All bit work is a same-width unsigned bitcast, then ``astype(uint32)`` to widen: plain ``jnp``
ops that run inside ``shard_map`` and ``jax.jit`` and lower in Pallas, which refuses
width-changing bitcasts.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ciera_jax.codec import to_bits

GOLDEN = 0x9E3779B9  # odd: p -> p * GOLDEN is a bijection, and spreads neighbouring positions
FMIX_C1, FMIX_C2 = 0x85EBCA6B, 0xC2B2AE35  # murmur3 fmix32 constants (both odd)


def fmix32(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer: a bijection on uint32 with full avalanche."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(FMIX_C1)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(FMIX_C2)
    return h ^ (h >> 16)


def words32(x: jax.Array, name: str = "x") -> jax.Array:
    """``x``'s words widened to uint32: a same-width unsigned bitcast, then ``astype``."""
    if x.dtype.itemsize > 4 or x.dtype == jnp.bool_:
        raise TypeError(f"checksum of {name}: dtype {x.dtype} is not 1, 2 or 4 bytes a word; "
                        "checksum a 32-bit view (e.g. lax.bitcast_convert_type to uint32 pairs)")
    return to_bits(x).astype(jnp.uint32)


def checksum(shard: jax.Array, offset=0, *, axis: int = 0, seed: int = 0) -> jax.Array:
    """uint32 checksum of ``shard``'s words, at global positions starting at ``offset``.

    The sender's call: ``offset`` is ``rank * shard.size`` for a tensor sharded on ``axis`` (a
    traced value is fine, e.g. ``lax.axis_index(name) * shard.size``). Elements are taken in
    ``moveaxis(shard, axis, 0)`` order, computed by index arithmetic, not a transpose.
    """
    axis = _axis(shard, axis, "shard")
    pre, d, post = _split_dims(shard.shape, axis)
    w_PxDxQ = words32(shard, "shard").reshape(pre, d, post)
    pos_PxDxQ = _positions(pre, d, post, jnp.asarray(offset, jnp.uint32))
    return jnp.sum(fmix32(w_PxDxQ ^ _key(pos_PxDxQ, seed)), dtype=jnp.uint32)


def checksum_shards(full: jax.Array, axis: int, n_ranks: int, *, seed: int = 0) -> jax.Array:
    """uint32[n_ranks]: entry r equals ``checksum(shard_r, r * shard_r.size, axis=axis)`` where
    ``shard_r`` is rank r's slice of ``full`` on ``axis``. The receiver's call."""
    axis = _axis(full, axis, "full")
    if full.shape[axis] % n_ranks:
        raise ValueError(f"checksum_shards: axis {axis} of full {full.shape} does not split into "
                         f"{n_ranks} ranks; pass the gather axis and the mesh size")
    pre, d, post = _split_dims(full.shape, axis)
    d_local = d // n_ranks
    w_PxRxDxQ = words32(full, "full").reshape(pre, n_ranks, d_local, post)
    n_local = pre * d_local * post
    rank_R = lax.broadcasted_iota(jnp.uint32, (1, n_ranks, 1, 1), 1)
    pos = _positions(pre, d_local, post, jnp.uint32(0))[:, None] + rank_R * jnp.uint32(n_local)
    return jnp.sum(fmix32(w_PxRxDxQ ^ _key(pos, seed)), axis=(0, 2, 3), dtype=jnp.uint32)


def _key(pos: jax.Array, seed: int) -> jax.Array:
    return pos * jnp.uint32(GOLDEN) + jnp.uint32(seed & 0xFFFFFFFF)


def _positions(pre: int, d: int, post: int, offset: jax.Array) -> jax.Array:
    """uint32[pre, d, post]: flat index in (d, pre, post) order (the axis first), + offset."""
    shape = (pre, d, post)
    p = lax.broadcasted_iota(jnp.uint32, shape, 0)
    j = lax.broadcasted_iota(jnp.uint32, shape, 1)
    q = lax.broadcasted_iota(jnp.uint32, shape, 2)
    return offset + j * jnp.uint32(pre * post) + p * jnp.uint32(post) + q


def _split_dims(shape: tuple[int, ...], axis: int) -> tuple[int, int, int]:
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])


def _axis(x: jax.Array, axis: int, name: str) -> int:
    if x.ndim == 0:
        raise ValueError(f"checksum of {name}: a scalar has no shard axis; reshape it to (1,)")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"checksum of {name}: axis {axis} out of range for shape {x.shape}")
    return axis % x.ndim


def checksum_np(words: np.ndarray, offset: int = 0, *, axis: int = 0, seed: int = 0) -> int:
    """NumPy reference of :func:`checksum` (for tests and host-side checks)."""
    w = np.moveaxis(np.asarray(words), axis, 0).reshape(-1)
    w = w.view(f"uint{w.dtype.itemsize * 8}").astype(np.uint64)
    pos = np.arange(offset, offset + w.size, dtype=np.uint64)
    h = (w ^ ((pos * GOLDEN + seed) & 0xFFFFFFFF)) & 0xFFFFFFFF
    h ^= h >> 16
    h = (h * FMIX_C1) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * FMIX_C2) & 0xFFFFFFFF
    h ^= h >> 16
    return int(h.sum() & 0xFFFFFFFF)
