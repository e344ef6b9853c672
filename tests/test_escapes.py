"""Escapes with implied positions: packed flags, ranks by popcount, pack and expand, against
numpy on any length (not only multiples of 32) and any density."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ciera_jax import escapes


@jax.jit
def _packed(flags_RxN):
    words = escapes.pack_flags(flags_RxN)
    return (words, escapes.unpack_flags(words, flags_RxN.shape[1]), escapes.count(words),
            escapes.ranks(words, flags_RxN.shape[1]))


@settings(max_examples=20, deadline=None)
@given(n=st.sampled_from([1, 31, 32, 33, 100, 1000]), rows=st.integers(1, 3),
       density=st.sampled_from([0.0, 0.01, 0.3, 1.0]), seed=st.integers(0, 2**16))
def test_flags_round_trip_count_and_rank(n, rows, density, seed):
    flags = np.random.default_rng(seed).random((rows, n)) < density
    words, back, count, ranks = _packed(jnp.asarray(flags))
    assert words.shape == (rows, -(-n // 32)) and words.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(back), flags)
    np.testing.assert_array_equal(np.asarray(count), flags.sum(axis=1))
    np.testing.assert_array_equal(np.asarray(ranks), np.cumsum(flags, axis=1) - flags)


@settings(max_examples=20, deadline=None)
@given(n=st.sampled_from([5, 64, 777]), density=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
       slack=st.sampled_from([0, 3]), seed=st.integers(0, 2**16))
def test_pack_lists_flagged_values_in_order_and_expand_puts_them_back(n, density, slack, seed):
    rng = np.random.default_rng(seed)
    flags = rng.random(n) < density
    values = rng.integers(0, 1 << 16, n).astype(np.uint16)
    cap = int(flags.sum()) + slack
    if cap == 0:
        cap = 1

    @jax.jit
    def roundtrip(values, flags):
        words = escapes.pack_flags(flags[None])[0]
        section = escapes.pack(values, flags, words, cap)
        back = escapes.expand(section[None], escapes.slots(words[None], n, cap))[0]
        return section, back

    section, back = map(np.asarray, roundtrip(jnp.asarray(values), jnp.asarray(flags)))
    k = int(flags.sum())
    np.testing.assert_array_equal(section[:k], values[flags])
    assert (section[k:] == 0).all(), "slots after the last flagged value stay zero"
    np.testing.assert_array_equal(back[flags], values[flags])


def test_pack_drops_what_does_not_fit():
    """More flags than capacity: the first ``capacity`` values, in order (the agreement sends
    such a step to the plain fallback, so what is dropped never matters)."""
    flags = jnp.ones((40,), jnp.bool_)
    values = jnp.arange(40, dtype=jnp.uint8)
    words = escapes.pack_flags(flags[None])[0]
    np.testing.assert_array_equal(np.asarray(escapes.pack(values, flags, words, 8)),
                                  np.arange(8))
