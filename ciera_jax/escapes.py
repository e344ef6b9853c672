"""Escapes with implied positions: flags packed 32 to a word, ranks by popcount.

A compressed gather sends a few values per tensor out of line (changed exponents, far word
moves) in position order, and their positions are implied by a flag per element (the bitmap, or
the escape code in the code plane). The sender packs the flagged values into a capacity buffer;
the receiver gives every flagged element its value back. Both need each flag's rank: how many
flags come before it in its row. No scan over elements: the flags are packed 32 to a uint32
word, a cumulative sum runs over the words only (1/32 of the elements), and the rank inside a
word is ``population_count(word & ((1 << lane) - 1))``; on a GPU that is a warp ballot and a
popcount.

Shape letters: R rows (one per rank on the receiver, 1 on the sender), n elements per row,
W = ceil(n/32) flag words per row, C a capacity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ciera_jax.wire import FLAG_WORD_BITS



def _lanes():
    return jnp.arange(FLAG_WORD_BITS, dtype=jnp.uint32)


def pack_flags(flags_RxN: jax.Array) -> jax.Array:
    """bool (R, n) -> uint32 (R, W): element ``32*w + i`` is bit ``i`` of word ``w``."""
    rows, n = flags_RxN.shape
    pad = -n % FLAG_WORD_BITS
    f = jnp.pad(flags_RxN, ((0, 0), (0, pad))).reshape(rows, -1, FLAG_WORD_BITS)
    shifted = f.astype(jnp.uint32) << _lanes()
    return lax.reduce(shifted, jnp.uint32(0), lax.bitwise_or, (2,))


def unpack_flags(words_RxW: jax.Array, n: int) -> jax.Array:
    """Inverse of :func:`pack_flags`: uint32 (R, W) -> bool (R, n)."""
    rows = words_RxW.shape[0]
    bits = (words_RxW[:, :, None] >> _lanes()) & jnp.uint32(1)
    return bits.reshape(rows, -1)[:, :n].astype(jnp.bool_)


def count(words_RxW: jax.Array) -> jax.Array:
    """Flags per row, int32 (R,)."""
    return jnp.sum(lax.population_count(words_RxW).astype(jnp.int32), axis=1)


def ranks(words_RxW: jax.Array, n: int) -> jax.Array:
    """int32 (R, n): for every element, the number of flags before it in its row."""
    rows = words_RxW.shape[0]
    per_word = lax.population_count(words_RxW).astype(jnp.int32)
    before_word = jnp.cumsum(per_word, axis=1) - per_word
    below_lane = (jnp.uint32(1) << _lanes()) - jnp.uint32(1)
    in_word = lax.population_count(words_RxW[:, :, None] & below_lane).astype(jnp.int32)
    return (before_word[:, :, None] + in_word).reshape(rows, -1)[:, :n]


def pack(values_N: jax.Array, flags_N: jax.Array, words_W: jax.Array,
         capacity: int) -> jax.Array:
    """Sender: the flagged ``values_N`` (one row; ``flags_N`` and the same flags packed in
    ``words_W``, which the caller has made already) in position order, in a (capacity,) buffer
    (zeros after the last; flags past ``capacity`` dropped: the agreement sends such a step to
    the fallback)."""
    n = values_N.shape[0]
    if capacity == 0:
        return jnp.zeros((0,), values_N.dtype)
    slot = jnp.where(flags_N, ranks(words_W[None], n)[0], capacity)
    return jnp.zeros((capacity,), values_N.dtype).at[slot].set(values_N, mode="drop")


def slots(words_RxW: jax.Array, n: int, capacity: int) -> jax.Array:
    """Receiver: int32 (R, n), each flagged element's slot in its row's section (clamped, so
    elements without a flag point somewhere valid: mask them)."""
    return jnp.minimum(ranks(words_RxW, n), max(capacity - 1, 0))


def expand(section_RxC: jax.Array, slot_RxN: jax.Array) -> jax.Array:
    """Receiver: (R, n), every element's value at its slot of its row's section (zero when the
    section is empty)."""
    if section_RxC.shape[1] == 0:
        return jnp.zeros(slot_RxN.shape, section_RxC.dtype)
    return jnp.take_along_axis(section_RxC, slot_RxN, axis=1)
