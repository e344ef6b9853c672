"""Word mode's codec pieces against numpy: order map, deltas, code packing, demand counts
(the escape lists: tests/test_escapes.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from bitdata import BF16, F32, WORD, adversarial, bits_of, special_words
from ciera_jax.codec import wordcodec as W
from ciera_jax.codec.word_ladder import code_limit, escape_code


def test_ord_is_monotone_and_an_involution_on_every_bf16_word():
    bits = jnp.arange(1 << 16, dtype=jnp.uint32).astype(jnp.uint16)
    o = np.asarray(W.ord_bits(bits)).view(np.int16).astype(np.int64)
    np.testing.assert_array_equal(np.asarray(W.ord_bits(W.ord_bits(bits))), np.asarray(bits))
    with np.errstate(invalid="ignore"):  # the NaN words (signalling ones warn when widened)
        vals = np.asarray(bits).view(BF16).astype(np.float64)
    finite = ~np.isnan(vals)
    order = np.argsort(o[finite], kind="stable")
    assert (np.diff(vals[finite][order]) >= 0).all(), "ord sorts finite values"
    assert o[0x0000] == 0 and o[0x8000] == -1, "+0 and -0 stay distinct"


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_delta_round_trips_every_pair_of_special_and_random_words(dtype):
    rng = np.random.default_rng(0)
    sp = special_words(dtype)
    pairs_old = np.concatenate([np.repeat(sp, sp.size), bits_of(adversarial(rng, 4096, dtype))])
    pairs_new = np.concatenate([np.tile(sp, sp.size), bits_of(adversarial(rng, 4096, dtype))])
    d = W.delta(jnp.asarray(pairs_new), jnp.asarray(pairs_old))
    assert d.dtype == np.dtype(f"int{8 * np.dtype(WORD[dtype]).itemsize}")
    np.testing.assert_array_equal(np.asarray(W.apply_delta(jnp.asarray(pairs_old), d)),
                                  pairs_new)


@pytest.mark.parametrize("b", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 100, 1001])
def test_codes_pack_and_unpack(b, n):
    codes = np.random.default_rng(n + b).integers(0, 2 ** b, (3, n)).astype(np.uint8)
    packed = jnp.stack([W.pack_codes(jnp.asarray(c), b) for c in codes])
    assert packed.shape == (3, W.code_bytes(n, b)) == (3, -(-n * b // 8))
    np.testing.assert_array_equal(np.asarray(W.unpack_codes(packed, b, n)), codes)


@pytest.mark.parametrize("b", [2, 3, 4])
def test_codes_of_escape_beyond_the_limit(b):
    d = jnp.asarray([0, 1, -1, code_limit(b), -code_limit(b), code_limit(b) + 1, -32768, 32767],
                    jnp.int16)
    got = np.asarray(W.codes_of(d, b))
    lim = code_limit(b)
    want = [lim, lim + 1, lim - 1, 2 * lim, 0] + [escape_code(b)] * 3
    np.testing.assert_array_equal(got, want)


def test_demands_count_escapes_raw_and_exponents():
    d = jnp.asarray([0, 1, 2, 4, 8, 127, 128, -129, -32768], jnp.int16)
    changed = jnp.asarray([True, False] * 4 + [True])
    np.testing.assert_array_equal(np.asarray(W.demands(d, changed)), [7, 6, 5, 3, 5])
