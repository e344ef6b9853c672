"""Word mode's codec pieces against numpy: order map, deltas, packing, escape lists."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bitdata import BF16, F32, WORD, adversarial, bits_of, special_words
from ciera_jax import wordcodec as W
from ciera_jax.word_ladder import LEVEL2, code_limit, escape_code


def test_ord_is_monotone_and_an_involution_on_every_bf16_word():
    bits = jnp.arange(1 << 16, dtype=jnp.uint32).astype(jnp.uint16)
    o = np.asarray(W.ord_bits(bits)).view(np.int16).astype(np.int64)
    np.testing.assert_array_equal(np.asarray(W.ord_bits(W.ord_bits(bits))), np.asarray(bits))
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


@functools.partial(jax.jit, static_argnums=(2,))
def _round_trip(new, old, b):
    """Sender lists and wire at capacity n, then the receiver's decode of that wire."""
    n = new.shape[0]
    d = W.delta(new, old)
    level1, level2 = W.compact(d, new, b, n, n)
    wire = W.encode_wire(d, new, b, n, n)
    codes, l1, l2 = W.split_wire(wire[None], n, b, n, n, new.dtype)
    pos = W.escape_positions_rows(codes, b, n)
    dense = W.dense_decode(old, codes[0], b)
    words = W.escape_words(old[jnp.minimum(pos, n - 1)], l1, l2)[0]
    out = dense.at[pos[0]].set(words, mode="drop")
    return d, level1, level2, wire.shape[0], pos[0], out


@settings(max_examples=12, deadline=None)
@given(n=st.sampled_from([100, 4099]), b=st.sampled_from([2, 3, 4]),
       seed=st.integers(0, 2**16), spread=st.sampled_from([1, 4, 40, 400, 1 << 15]))
def test_compact_lists_escapes_in_order_and_decode_restores(n, b, seed, spread):
    """The sender's lists match numpy; the receiver's dense + escape words give the new words."""
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    d_true = rng.integers(-spread, spread + 1, n)
    new = np.asarray(W.apply_delta(jnp.asarray(old), jnp.asarray(d_true, jnp.int32)))
    d, level1, level2, size, pos, out = _round_trip(jnp.asarray(new), jnp.asarray(old), b)
    dn = np.asarray(d).astype(np.int64)
    esc = np.flatnonzero(np.abs(dn) > code_limit(b))
    raw = esc[np.abs(dn[esc]) > 127]
    want1 = np.where(np.abs(dn[esc]) > 127, LEVEL2, dn[esc]).astype(np.int8)
    np.testing.assert_array_equal(np.asarray(level1)[:esc.size], want1)
    np.testing.assert_array_equal(np.asarray(level2)[:raw.size], new[raw])
    assert int(size) == W.wire_size(n, b, n, n, 2)
    np.testing.assert_array_equal(np.asarray(pos)[:esc.size], esc)
    assert (np.asarray(pos)[esc.size:] == n).all()
    np.testing.assert_array_equal(np.asarray(out), new)


def test_demands_count_escapes_raw_and_exponents():
    d = jnp.asarray([0, 1, 2, 4, 8, 127, 128, -129, -32768], jnp.int16)
    changed = jnp.asarray([True, False] * 4 + [True])
    np.testing.assert_array_equal(np.asarray(W.demands(d, changed)), [7, 6, 5, 3, 5])
