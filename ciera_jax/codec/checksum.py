"""A 32-bit position-mixing checksum of a shard's true words, for a gather that checks itself.

Every rank sends ``checksum(shard, offset)`` of the words it holds; every receiver computes
``checksum_shards(full, axis, n_ranks)`` over the tensor it rebuilt and compares one value per
rank. A cache that drifted on one rank (a flipped bit, a stale restore) then shows up in the
step it happens.

The sum is ``sum_i fmix32(term_i ^ key(pos_i)) mod 2**32`` with ``key(p) = p * 0x9E3779B9 +
seed``; a term is one word widened to uint32, or for 2-byte words (bf16) a pair ``lo | hi <<
16``, which halves the hashing. ``fmix32`` (murmur3's finalizer), XOR with a key and the pairing
are bijections, so a change of any single word changes its term and hence the sum, with
certainty; several changed words cancel with probability about 2**-32. The key mixes in the
position, so words moved to the wrong place (a shard in the wrong slot, a transposed block) are
caught too.

Positions are global: element ``p`` is the flat index in ``moveaxis(full, axis, 0)``, the
order in which a rank's shard on ``axis`` is one contiguous run starting at ``rank *
shard.size``. So a receiver can check each rank's slice of a rebuilt tensor against the value
that rank sent, with no transpose (:func:`checksum_shards`).

All bit work is a same-width unsigned bitcast, then ``astype(uint32)`` to widen: plain ``jnp``
ops that run inside ``shard_map`` and ``jax.jit`` and lower in Pallas, which refuses
width-changing bitcasts.

Shape letters: B the dims before the shard axis (flattened), R ranks, D the shard axis (one
rank's part), A the dims after it (flattened).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ciera_jax.codec.bitfields import to_bits

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
    w_BxRxDxA = words32(shard, "shard").reshape(pre, 1, d, post)
    return _sums(w_BxRxDxA, shard.dtype.itemsize, jnp.asarray(offset, jnp.uint32), seed)[0]


def checksum_shards(full: jax.Array, axis: int, n_ranks: int, *, seed: int = 0) -> jax.Array:
    """uint32[n_ranks]: entry r equals ``checksum(shard_r, r * shard_r.size, axis=axis)`` where
    ``shard_r`` is rank r's slice of ``full`` on ``axis``. The receiver's call."""
    axis = _axis(full, axis, "full")
    if full.shape[axis] % n_ranks:
        raise ValueError(f"checksum_shards: axis {axis} of full {full.shape} does not split into "
                         f"{n_ranks} ranks; pass the gather axis and the mesh size")
    pre, d, post = _split_dims(full.shape, axis)
    w_BxRxDxA = words32(full, "full").reshape(pre, n_ranks, d // n_ranks, post)
    return _sums(w_BxRxDxA, full.dtype.itemsize, jnp.uint32(0), seed)


def _sums(w_BxRxDxA: jax.Array, itemsize: int, offset: jax.Array, seed: int) -> jax.Array:
    """Per-rank sums of ``fmix32(term ^ key(position))``, the term being one word, or for 2-byte
    words a pair ``lo | hi << 16`` of the two halves of the last dimension (A, else D) that
    splits evenly, at the position of ``lo``. A pair is a bijection of its two words, so a
    change in either still changes the sum with certainty, and it halves the hashing."""
    pre, R, d, post = w_BxRxDxA.shape
    n_local = pre * d * post
    pair_dim = next((dim for dim in (3, 2) if itemsize == 2 and w_BxRxDxA.shape[dim] % 2 == 0),
                    None)
    x = w_BxRxDxA
    if pair_dim is not None:
        lo, hi = jnp.split(w_BxRxDxA, 2, axis=pair_dim)
        x = lo | (hi << 16)
    b, r, i, a = (lax.broadcasted_iota(jnp.uint32, x.shape, dim) for dim in range(4))
    pos = (offset + r * jnp.uint32(n_local) + i * jnp.uint32(pre * post) + b * jnp.uint32(post)
           + a)
    key = pos * jnp.uint32(GOLDEN) + jnp.uint32(seed & 0xFFFFFFFF)
    return jnp.sum(fmix32(x ^ key), axis=(0, 2, 3), dtype=jnp.uint32)


def _split_dims(shape: tuple[int, ...], axis: int) -> tuple[int, int, int]:
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])


def _axis(x: jax.Array, axis: int, name: str) -> int:
    if x.ndim == 0:
        raise ValueError(f"checksum of {name}: a scalar has no shard axis; reshape it to (1,)")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"checksum of {name}: axis {axis} out of range for shape {x.shape}")
    return axis % x.ndim


def checksum_np(words: np.ndarray, offset: int = 0, *, axis: int = 0, seed: int = 0) -> int:
    """NumPy reference of :func:`checksum`, written from the definition (for tests and
    host-side checks): terms in ``moveaxis(words, axis, 0)`` order, 2-byte words paired."""
    a = np.asarray(words)
    a = a.view(f"uint{a.dtype.itemsize * 8}")
    pre, d, post = _split_dims(a.shape, axis)
    a = a.reshape(pre, d, post).astype(np.uint64)
    pos = np.moveaxis(np.arange(a.size, dtype=np.uint64).reshape(d, pre, post), 0, 1) + offset
    pair_dim = next((dim for dim in (2, 1) if words.dtype.itemsize == 2 and a.shape[dim] % 2 == 0),
                    None)
    if pair_dim is not None:
        (lo, hi), (pos, _) = np.split(a, 2, axis=pair_dim), np.split(pos, 2, axis=pair_dim)
        a = lo | (hi << np.uint64(16))
    m = np.uint64(0xFFFFFFFF)
    h = (a ^ ((pos * np.uint64(GOLDEN) + np.uint64(seed)) & m)) & m
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(FMIX_C1)) & m
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(FMIX_C2)) & m
    h ^= h >> np.uint64(16)
    return int(h.sum() & m)
