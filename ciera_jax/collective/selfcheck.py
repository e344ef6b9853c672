"""The gather that checks itself: the sender's checksum travels at the end of its main plane.

Every rank appends a uint32 checksum of its true shard (:mod:`ciera_jax.codec.checksum`, at global
positions) to the bytes it sends; every receiver checks each shard it rebuilt. A cache that
drifted on one rank (a flipped bit, a stale restore) fails there, in the step it happens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ciera_jax.codec import bitfields
from ciera_jax.codec import checksum as checksums
from ciera_jax.codec.wire import CHECKSUM_BYTES


def shard_checksum(x: jax.Array, axis: int, axis_name) -> jax.Array:
    """This rank's shard checksum at its global positions (rank * shard size onwards)."""
    first = lax.axis_index(axis_name).astype(jnp.uint32) * jnp.uint32(x.size)
    return checksums.checksum(x, first, axis=axis)


def with_checksum(wire_L: jax.Array, csum: jax.Array) -> jax.Array:
    """A uint8 wire buffer with the checksum appended as its last CHECKSUM_BYTES
    (little-endian: shifts, not a bitcast, so XLA fuses it into the buffer's build)."""
    return jnp.concatenate([wire_L, bitfields.le_bytes(csum.astype(jnp.uint32))])


def sent_checksums(wire_NxL: jax.Array) -> jax.Array:
    """Every rank's checksum (N,), read off the tail of its gathered row (shifts and ORs:
    fused into the compare that reads it, where a bitcast would be a kernel of its own)."""
    return bitfields.from_le_bytes(wire_NxL[:, -CHECKSUM_BYTES:], jnp.uint32, 1)[:, 0]


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
