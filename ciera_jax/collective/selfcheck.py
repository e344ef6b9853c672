"""The gather that checks itself: the sender's checksum travels at the end of its main plane.

Every rank appends a uint32 checksum of its true shard (:mod:`ciera_jax.codec.checksum`, at global
positions) to the bytes it sends; every receiver checks each shard it rebuilt. A cache that
drifted on one rank (a flipped bit, a stale restore) fails there, in the step it happens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ciera_jax.codec import checksum as checksums
from ciera_jax.codec.wire import CHECKSUM_BYTES

# Little-endian bytes, by a shift per byte as a scalar: an array of shifts XLA:GPU turns into
# an iota, computed by a kernel of its own and carried into the fallback's branch.
_SHIFTS = [np.uint32(8 * k) for k in range(CHECKSUM_BYTES)]


def shard_checksum(x: jax.Array, axis: int, axis_name) -> jax.Array:
    """This rank's shard checksum at its global positions (rank * shard size onwards)."""
    first = lax.axis_index(axis_name).astype(jnp.uint32) * jnp.uint32(x.size)
    return checksums.checksum(x, first, axis=axis)


def with_checksum(wire_L: jax.Array, csum: jax.Array) -> jax.Array:
    """A uint8 wire buffer with the checksum appended as its last CHECKSUM_BYTES
    (little-endian: shifts, not a bitcast, so XLA fuses it into the buffer's build)."""
    return jnp.concatenate([wire_L, _le_bytes(csum.astype(jnp.uint32))])


def sent_checksums(wire_NxL: jax.Array) -> jax.Array:
    """Every rank's checksum (N,), read off the tail of its gathered row (shifts and a sum:
    fused into the compare that reads it, where a bitcast would be a kernel of its own)."""
    tail = wire_NxL[:, -CHECKSUM_BYTES:].astype(jnp.uint32)
    return functools.reduce(jnp.bitwise_or, [tail[:, k] << s for k, s in enumerate(_SHIFTS)])


def without_checksums(wire_NxL: jax.Array) -> jax.Array:
    """The gathered rows without their checksum tails: a slice, so taken only where the bytes
    are needed whole (the fallback), and the common path reads the rows in place."""
    return wire_NxL[:, :-CHECKSUM_BYTES]


def failed_shards(full: jax.Array, sent_N: jax.Array, axis: int, got_N=None) -> jax.Array:
    """int32: shards of the rebuilt ``full`` whose checksum differs from what their rank sent
    (``got_N``: the rebuilt shards' checksums, when the decode pass computed them already)."""
    if got_N is None:
        got_N = checksums.checksum_shards(full, axis, sent_N.shape[0])
    bad_N = (got_N != sent_N).astype(jnp.int32)
    # A sum of the ranks' flags one by one (elementwise: fused into what reads the count),
    # where a reduction over a few ranks would be a kernel of its own on XLA:GPU.
    return functools.reduce(jnp.add, [bad_N[i] for i in range(bad_N.shape[0])], jnp.int32(0))


def _le_bytes(word: jax.Array) -> jax.Array:
    """A uint32 scalar's CHECKSUM_BYTES bytes, least significant first."""
    return jnp.stack([(word >> s) & np.uint32(0xFF) for s in _SHIFTS]).astype(jnp.uint8)
