"""The two-level bitmap's placement (``codec.two_level``): each flagged element gets the value
``escapes.fill`` gives it over the flag words ``escapes.expand_dense`` rebuilds, bit for bit,
in the full tensor's layout, for any gather axis, capacity and limit."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ciera_jax.codec import escapes, two_level
from ciera_jax.codec.layout import full_index, full_to_rows, rows_to_full
from ciera_jax.codec.wire import flag_words


def _two_level(flags_RxN, capacity):
    """What a sender packs: (summary, listed words at ``capacity``, zeros after the last)."""
    words_RxW = escapes.pack_flags(jnp.asarray(flags_RxN))
    summary = escapes.pack_flags(words_RxW != 0)
    running = escapes.running_count((words_RxW != 0).astype(jnp.uint32))
    listed = jnp.stack([escapes.pack_nonzero(w, capacity, r)
                        for w, r in zip(words_RxW, running)])
    return words_RxW, summary, listed


def _by_fill(cache_full, words_RxW, values_RxK, limit_R, shard_shape, axis, n_ranks):
    rows = full_to_rows(cache_full, shard_shape, axis, n_ranks)
    filled = escapes.fill(rows, words_RxW, limit_R,
                          lambda slot, _, __, c: (escapes.take(values_RxK, slot), c),
                          walk="dense")
    return rows_to_full(filled, shard_shape, axis)


@pytest.mark.parametrize("shard_shape,axis", [((4, 40, 24), 1), ((3, 100), 0), ((6, 5, 64), 2)])
@pytest.mark.parametrize("density", [0.0, 0.002, 0.05, 0.6, 1.0])
def test_place_is_the_fill_over_the_expanded_flags(shard_shape, axis, density):
    rng = np.random.default_rng(int(density * 1000) + axis)
    n_ranks = 4
    n = int(np.prod(shard_shape))
    full_shape = list(shard_shape)
    full_shape[axis] *= n_ranks
    cache = jnp.asarray(rng.integers(0, 256, full_shape, dtype=np.uint8))
    flags = rng.random((n_ranks, n)) < density
    k = max(int(flags.sum(axis=1).max()), 1)
    values = jnp.asarray(rng.integers(0, 256, (n_ranks, k), dtype=np.uint8))
    words, summary, listed = _two_level(flags, min(k, flag_words(n)))
    for limit in (k, max(k // 2, 1)):
        limit_R = jnp.full((n_ranks,), limit, jnp.int32)
        want = _by_fill(cache, escapes.expand_dense(listed, summary, flag_words(n)), values,
                        limit_R, shard_shape, axis, n_ranks)
        assert np.array_equal(escapes.expand_dense(listed, summary, flag_words(n)), words)
        got = two_level.place(
            cache, summary, listed, values, limit_R, n,
            lambda r, i: full_index(i, shard_shape, axis, n_ranks, r * shard_shape[axis]))
        assert np.array_equal(np.asarray(got), np.asarray(want))
    if density:
        assert not np.array_equal(np.asarray(got), np.asarray(cache))


def test_listed_words_past_the_summary_count_are_not_read():
    """A traced rung's section holds other bytes past its prefix: they change nothing."""
    n, n_ranks = 4096, 2
    flags = np.zeros((n_ranks, n), bool)
    flags[0, [3, 100, 2000]] = True
    flags[1, [4095]] = True
    _, summary, listed = _two_level(flags, 8)
    junk = listed.at[:, 4:].set(jnp.uint32(0xFFFFFFFF))
    values = jnp.arange(1, 2 * 8 + 1, dtype=jnp.uint8).reshape(n_ranks, 8)
    dest = jnp.zeros((n_ranks, n), jnp.uint8)
    index = lambda r, i: r * n + i  # noqa: E731
    clean = two_level.place(dest, summary, listed, values, 8, n, index)
    assert np.array_equal(two_level.place(dest, summary, junk, values, 8, n, index), clean)
    assert np.flatnonzero(np.asarray(clean)).tolist() == [3, 100, 2000, n + 4095]
    assert np.asarray(clean).reshape(-1)[[3, 100, 2000, n + 4095]].tolist() == [1, 2, 3, 9]


def test_listed_words_map_each_summary_bit_to_its_word():
    summary = escapes.pack_flags(jnp.asarray([[False, True, False, True, True] + [False] * 59]))
    got = two_level.listed_words(summary, 64, 4)
    assert got.tolist() == [[1, 3, 4, 64]]
