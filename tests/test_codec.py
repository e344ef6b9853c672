"""bitfields.py on its own: split/merge round-trip bit for bit, the payload layout, the exponent,
same-width views, and clear errors for dtypes it does not compress."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bitdata import BF16, F32, WORD, adversarial, bits_of, special_words
from ciera_jax.codec import bitfields

DTYPES = [BF16, F32]
IDS = ["bf16", "f32"]


def _split_merge(x):
    exp, payload = jax.jit(bitfields.split)(x)
    back = jax.jit(bitfields.merge, static_argnums=2)(exp, payload, x.dtype)
    return np.asarray(exp), np.asarray(payload), np.asarray(back)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_split_merge_round_trips_every_bit(dtype):
    """Adversarial words (NaN payloads incl. signalling, +-inf, +-0, subnormals, max finite)
    plus, for bf16, every one of the 65536 bit patterns."""
    rng = np.random.default_rng(0)
    x = adversarial(rng, (8, 129), dtype)
    if dtype == BF16:
        x = np.concatenate([x.reshape(-1), np.arange(2**16, dtype=np.uint16).view(BF16)])
    _, _, back = _split_merge(jnp.asarray(x))
    assert back.dtype == dtype and back.shape == x.shape
    np.testing.assert_array_equal(bits_of(back), bits_of(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_special_words_survive_sign_flips(dtype):
    w = special_words(dtype)
    top = np.array(1 << (8 * w.dtype.itemsize - 1), w.dtype)
    words = np.concatenate([w, w ^ top])
    _, _, back = _split_merge(jnp.asarray(words.view(dtype)))
    np.testing.assert_array_equal(bits_of(back), words)


def test_bf16_payload_is_sign_and_mantissa_in_one_plane():
    words = np.array([0x0000, 0x8000, 0x7F81, 0xFF81, 0x3F80, 0xBFFF, 0x007F, 0x807F], np.uint16)
    exp, payload, _ = _split_merge(jnp.asarray(words.view(BF16)))
    assert payload.shape == (1,) + words.shape and payload.dtype == np.uint8
    np.testing.assert_array_equal(payload[0], ((words >> 15) << 7) | (words & 0x7F))
    np.testing.assert_array_equal(exp, (words >> 7) & 0xFF)


def test_f32_payload_planes_are_low_mid_and_sign_high_mantissa():
    words = np.array([0x7F800001, 0xFFC00000, 0x00000001, 0x80000000, 0x3F8A5A5A, 0xC2B2AE35],
                     np.uint32)
    exp, payload, _ = _split_merge(jnp.asarray(words.view(F32)))
    assert payload.shape == (3,) + words.shape and payload.dtype == np.uint8
    np.testing.assert_array_equal(payload[0], words & 0xFF)
    np.testing.assert_array_equal(payload[1], (words >> 8) & 0xFF)
    np.testing.assert_array_equal(payload[2], ((words >> 31) << 7) | ((words >> 16) & 0x7F))
    np.testing.assert_array_equal(exp, (words >> 23) & 0xFF)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_exponent_matches_split(dtype):
    x = jnp.asarray(adversarial(np.random.default_rng(1), (64,), dtype))
    exp = np.asarray(bitfields.exponent(x))
    assert exp.dtype == np.uint8
    np.testing.assert_array_equal(exp, np.asarray(bitfields.split(x)[0]))
    mant = bitfields.word_format(dtype).mantissa_bits
    np.testing.assert_array_equal(exp, (bits_of(np.asarray(x)) >> mant) & 0xFF)


@pytest.mark.parametrize("dtype", [BF16, F32, np.dtype(np.float16), np.dtype(np.int8),
                                   np.dtype(np.uint16)], ids=str)
def test_to_bits_and_from_bits_are_same_width_views(dtype):
    x = np.arange(-8, 8).astype(dtype)
    bits = bitfields.to_bits(jnp.asarray(x))
    assert bits.dtype == bitfields.unsigned_dtype_like(dtype)
    assert bits.dtype.itemsize == np.dtype(dtype).itemsize
    np.testing.assert_array_equal(np.asarray(bits), bits_of(x))
    back = bitfields.from_bits(bits, dtype)
    assert back.dtype == dtype
    np.testing.assert_array_equal(bits_of(np.asarray(back)), bits_of(x))


def test_formats_describe_the_wire():
    for dtype, mant, payload in ((BF16, 7, 1), (F32, 23, 3)):
        fmt = bitfields.word_format(dtype)
        assert (fmt.word, fmt.mantissa_bits, fmt.payload_bytes) == (WORD[dtype], mant, payload)
        assert fmt.bits == 8 * np.dtype(dtype).itemsize == 1 + 8 + mant
        assert bitfields.is_compressible(dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.uint8], ids=str)
def test_unsupported_dtypes_fail_with_the_fix(dtype):
    assert not bitfields.is_compressible(dtype)
    with pytest.raises(TypeError, match="plain all-gather"):
        bitfields.word_format(dtype)
    with pytest.raises(TypeError, match="bfloat16 and float32 only"):
        bitfields.split(jnp.zeros((4,), dtype))
    with pytest.raises(TypeError, match="bfloat16 and float32 only"):
        bitfields.exponent(jnp.zeros((4,), dtype))
    with pytest.raises(TypeError, match="bfloat16 and float32 only"):
        bitfields.merge(jnp.zeros((4,), jnp.uint8), jnp.zeros((1, 4), jnp.uint8), dtype)
