"""Word-mode Pallas kernels vs their jnp references, bit for bit, on both Pallas GPU backends
(each backend's interpreter on CPU; the real kernels under ``benchmarks/gpu_check.sh``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ciera_jax import kernels as K
from ciera_jax.codec import wordcodec as W
from ciera_jax.codec.word_ladder import CODE_BITS, escape_code
from test_kernels import (BACKENDS, BLOCK, DTYPES, ON_GPU, WORDS, adversarial_bits, bits_of,
                          make_x)


def cached_like(bits: np.ndarray, how: str, seed: int = 1) -> np.ndarray:
    """Cached words: equal, near (|d| <= 9), far (random words) or sign-flipped."""
    rng = np.random.default_rng(seed)
    if how == "same":
        return bits.copy()
    if how == "flipped":
        return bits ^ np.array(1 << (8 * bits.dtype.itemsize - 1), bits.dtype)
    if how == "far":
        return rng.integers(0, np.iinfo(bits.dtype).max, bits.shape, dtype=bits.dtype,
                            endpoint=True)
    return bits + rng.integers(-9, 10, bits.shape).astype(bits.dtype)  # wraps: still exact


def check_word_kernels(bits, dtype, how, shape=None, backend=None, code_bits=CODE_BITS, **kw):
    x = make_x(bits, dtype, shape)
    cached = jnp.asarray(cached_like(bits, how).reshape(x.shape))
    run = dict(backend=backend, interpret=not ON_GPU, **kw)
    d, counts = K.word_encode_pallas(x, cached, **run)
    d_ref, counts_ref = K.word_encode_reference(x, cached)
    assert d.dtype == d_ref.dtype and d.shape == x.shape
    np.testing.assert_array_equal(np.asarray(d), np.asarray(d_ref))
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(counts_ref))
    for b in code_bits:
        codes = W.codes_of(d_ref, b)
        got = K.word_decode_pallas(cached, codes, b, **run)
        want = K.word_decode_reference(cached, codes, b)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        esc = np.asarray(codes) == escape_code(b)  # the rest decode to the new words
        np.testing.assert_array_equal(np.asarray(got)[~esc], bits_of(x)[~esc])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
@pytest.mark.parametrize("how", ["same", "near", "far", "flipped"])
def test_word_kernels_match_reference(dtype, how, backend):
    check_word_kernels(adversarial_bits(dtype, 2 * BLOCK + 5, seed=5), dtype, how,
                       backend=backend, code_bits=(4,) if how != "near" else CODE_BITS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_word_kernels_shapes_and_small_blocks(backend):
    for dtype in DTYPES:
        bits = adversarial_bits(dtype, 5 * 128 + 3, seed=5)
        check_word_kernels(bits, dtype, "near", backend=backend, block=128, code_bits=(3,))
    check_word_kernels(adversarial_bits(jnp.bfloat16, 2 * 3 * 683, seed=6), jnp.bfloat16,
                       "far", shape=(2, 3, 683), backend=backend, code_bits=(2,))


def test_word_dispatch():
    bits = adversarial_bits(jnp.float32, 1000, seed=9)
    x = make_x(bits, jnp.float32)
    cached = jnp.asarray(cached_like(bits, "near"))
    for impl in ("xla", "pallas", "auto"):
        d, counts = K.word_encode(x, cached, impl=impl)
        d_ref, counts_ref = K.word_encode_reference(x, cached)
        np.testing.assert_array_equal(np.asarray(d), np.asarray(d_ref))
        np.testing.assert_array_equal(np.asarray(counts), np.asarray(counts_ref))
        codes = W.codes_of(d_ref, 4)
        np.testing.assert_array_equal(np.asarray(K.word_decode(cached, codes, 4, impl=impl)),
                                      np.asarray(K.word_decode_reference(cached, codes, 4)))


@settings(max_examples=3, deadline=None)
@given(dtype=st.sampled_from(DTYPES), n=st.sampled_from([1, 100, 3000]),
       seed=st.integers(0, 2**16),
       how=st.sampled_from(["same", "near", "far", "flipped"]))
def test_property_word_kernels(dtype, n, seed, how):
    rng = np.random.default_rng(seed)
    word = WORDS[dtype]
    check_word_kernels(rng.integers(0, np.iinfo(word).max, n, dtype=word, endpoint=True),
                       dtype, how, code_bits=(4,))


def test_empty_and_shape_errors():
    x = jnp.zeros((0, 3), jnp.bfloat16)
    d, counts = K.word_encode(x, jnp.zeros((0, 3), jnp.uint16), impl="pallas")
    assert d.shape == (0, 3) and (np.asarray(counts) == 0).all()
    with pytest.raises(ValueError, match="cached words shape"):
        K.word_encode(jnp.zeros((4,), jnp.float32), jnp.zeros((5,), jnp.uint32), impl="xla")
    with pytest.raises(ValueError, match="codes shape"):
        K.word_decode_pallas(jnp.zeros((4,), jnp.uint16), jnp.zeros((5,), jnp.uint8), 4)


# (shard shape, gather axis): a rank's run of the full layout is whole blocks (8 ranks)
ROWS = [((2, 4, 1024), 1), ((2, 2, 512, 2), 2), ((8, 512), 0)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shard_shape,axis", ROWS, ids=["axis 1", "axis 2", "axis 0"])
def test_word_decode_of_rows_reads_the_full_cache_in_place(shard_shape, axis, backend):
    """The decode of a gather's rank rows against a cache in the full layout equals the
    reference decode of the cache's rows, bit for bit, with no transpose of the cache; a
    shape whose runs are not whole blocks takes the transposing path, same values."""
    from ciera_jax.codec.layout import full_to_rows, gathered_shape

    n_ranks, block = 8, 1024
    full_shape = gathered_shape(shard_shape, axis, n_ranks)
    dtype = jnp.bfloat16
    bits = adversarial_bits(dtype, int(np.prod(full_shape)), seed=9)
    cached = jnp.asarray(cached_like(bits, "near").reshape(full_shape))
    rng = np.random.default_rng(3)
    codes = jnp.asarray(rng.integers(0, 8, (n_ranks, int(np.prod(shard_shape))), np.uint8))
    want = K.word_decode_reference(full_to_rows(cached, shard_shape, axis, n_ranks), codes, 3)
    got = K.word_decode_rows_pallas(cached, codes, 3, shard_shape, axis, block=block,
                                    backend=backend, interpret=not ON_GPU)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="whole 8192-element runs"):
        K.word_decode_rows_pallas(cached, codes, 3, shard_shape, axis, block=8192,
                                  backend=backend, interpret=not ON_GPU)
    for impl in ("xla", "pallas"):
        np.testing.assert_array_equal(np.asarray(K.word_decode_rows(
            cached, codes, 3, shard_shape, axis, impl=impl)), np.asarray(want))
