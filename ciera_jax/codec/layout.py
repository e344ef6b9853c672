"""Rank rows and the full tensor's layout: how gathered shards are laid out.

A gather's wire arrives rank-major: row ``r`` holds rank ``r``'s shard, flattened in the
shard's own order (``n`` elements). The full tensor tiles the shards on the gather ``axis``.
Decoding works on rows (each rank's escapes are in its own position order); the result moves to
the full layout once. For ``axis=0`` both are the same bytes and the moves are reshapes.

Shape letters: N ranks, n elements per shard, ``[P,]`` optional leading planes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def gathered_shape(shard_shape, axis: int, n_ranks: int) -> tuple[int, ...]:
    """The full tensor's shape: ``n_ranks`` shards tiled on ``axis``."""
    shape = list(shard_shape)
    shape[axis] *= n_ranks
    return tuple(shape)


def dims(shard_shape, axis: int) -> tuple[int, int, int]:
    """(elements before the gather axis, the shard's part of it, elements after it)."""
    return math.prod(shard_shape[:axis]), shard_shape[axis], math.prod(shard_shape[axis + 1:])


def rows_to_full(a_NxPxn: jax.Array, shard_shape, axis: int) -> jax.Array:
    """Rank-major (N, [P,] n) rows -> the full tensor's layout ([P,] *full_shape)."""
    n_ranks = a_NxPxn.shape[0]
    pre, s, post = dims(shard_shape, axis)
    lead = a_NxPxn.shape[1:-1]
    a = a_NxPxn.reshape((n_ranks,) + lead + (pre, s, post))
    a = jnp.moveaxis(a, 0, len(lead) + 1)  # (lead..., pre, N, s, post)
    return a.reshape(lead + gathered_shape(shard_shape, axis, n_ranks))


def full_to_rows(full: jax.Array, shard_shape, axis: int, n_ranks: int) -> jax.Array:
    """Inverse of :func:`rows_to_full` (no planes): full tensor -> (N, n) rank rows."""
    pre, s, post = dims(shard_shape, axis)
    a = full.reshape(pre, n_ranks, s, post)
    return jnp.moveaxis(a, 1, 0).reshape(n_ranks, pre * s * post)


def full_index(i: jax.Array, shard_shape, axis: int, n_ranks: int, first: jax.Array):
    """The flat index in the full tensor of the shard's flat element ``i`` (any shape of int32
    indices), for the shard that starts at index ``first`` of ``axis``: index arithmetic, so
    a few elements of a cache can be read in place instead of slicing out the shard."""
    pre, s, post = dims(shard_shape, axis)
    del pre
    inner, t = i % post, i // post
    return ((t // s) * (s * n_ranks) + first + t % s) * post + inner
