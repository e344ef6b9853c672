"""The two-level flag bitmap on the receiver: escapes placed from the listed flag words.

Exponent mode sends its flags in two levels: a summary bit per 32-flag word (is it nonzero)
and the nonzero flag words in order. :func:`place` puts each flagged element's new value
straight into the destination in its own layout (the full tensor's, or any other the caller
maps element indices to), by one scatter of the listed words' flags: it rebuilds no dense
flag words, takes no running count over every flag word and moves no rank rows to the full
layout. Its work is the summary's bits (1/32 of the flag words) and 32 lanes per listed
word; the values it writes, and where, are exactly those of ``escapes.fill`` over the
flag words ``escapes.expand_dense`` rebuilds, wherever the listed words fit their buffer.

Shape letters as in :mod:`ciera_jax.codec.escapes`: R rows (one per rank), n elements per
row, W flag words per row, S summary words, C listed words, K values.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from ciera_jax.codec import escapes
from ciera_jax.codec.wire import FLAG_WORD_BITS, flag_words


def listed_words(summary_RxS: jax.Array, n_words: int, capacity: int,
                 scale: int = 1) -> jax.Array:
    """int32 (R, capacity): the flag word index of each row's ``c``-th listed word (the
    ``c``-th set bit of its summary), or ``n_words`` past the row's last; times ``scale``
    (the word's first element, for ``scale`` = 32: one scatter, no pass after it)."""
    rows = summary_RxS.shape[0]
    nonzero_RxW = escapes.unpack_flags(summary_RxS, n_words)
    slot_RxW = jnp.where(nonzero_RxW, escapes.ranks(summary_RxS, n_words), capacity)
    words = jnp.broadcast_to(jnp.arange(0, scale * n_words, scale, dtype=jnp.int32),
                             (rows, n_words))
    return jnp.full((rows, capacity), scale * n_words, jnp.int32).at[
        jnp.arange(rows)[:, None], slot_RxW].set(words, mode="drop")


def place(dest: jax.Array, summary_RxS: jax.Array, listed_RxC: jax.Array,
          values_RxK: jax.Array, limit, n: int,
          index_of: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """``dest`` with each row's first ``limit`` flagged elements set, in position order, to
    the row's ``values_RxK``. ``listed_RxC``: the row's nonzero flag words in order (entries
    past the summary's count are not read); ``index_of(row_R1, element_RxE)``: an element's
    flat index in ``dest``. Slots past ``limit`` (an int, or int32 (R,)) keep ``dest``."""
    rows, capacity = listed_RxC.shape
    if capacity == 0 or values_RxK.shape[1] == 0:
        return dest
    n_words = flag_words(n)
    # Listed words past the summary's count start at element 32 * n_words, past every one: their
    # flags are dropped, and only later such words count them.
    first_element_RxC = listed_words(summary_RxS, n_words, capacity, FLAG_WORD_BITS)
    listed = listed_RxC.astype(jnp.uint32)
    # each listed word's first slot: the flags in the listed words before it
    pop_RxC = escapes.popcount(listed)
    first_RxC = escapes.running_count(listed) - pop_RxC
    lanes = jnp.arange(FLAG_WORD_BITS, dtype=jnp.uint32)
    flag_RxCx32 = ((listed[:, :, None] >> lanes) & jnp.uint32(1)) != 0
    below = escapes.popcount(listed[:, :, None] & ((jnp.uint32(1) << lanes) - jnp.uint32(1)))
    slot = first_RxC[:, :, None] + below
    element = first_element_RxC[:, :, None] + lanes.astype(jnp.int32)
    limit_R = jnp.broadcast_to(jnp.asarray(limit, jnp.int32), (rows,))
    live = flag_RxCx32 & (slot < limit_R[:, None, None]) & (element < n)
    at = index_of(jnp.arange(rows, dtype=jnp.int32)[:, None],
                  jnp.minimum(element, n - 1).reshape(rows, -1))
    at = jnp.where(live.reshape(rows, -1), at, dest.size)  # past the end: dropped
    got = escapes.take(values_RxK, slot.reshape(rows, -1))
    flat = dest.reshape(-1).at[at.reshape(-1)].set(got.reshape(-1).astype(dest.dtype),
                                                   mode="drop")
    return flat.reshape(dest.shape)

