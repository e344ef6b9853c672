"""Bit-pattern generators for exactness tests: adversarial values and controlled exponent churn."""

from __future__ import annotations

import numpy as np
import ml_dtypes

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
WORD = {BF16: np.uint16, F32: np.uint32}
MANT = {BF16: 7, F32: 23}


def bits_of(x) -> np.ndarray:
    """uint view of an array (numpy or jax) of bf16 / float32 / any dtype."""
    a = np.asarray(x)
    return a.view(np.dtype(f"uint{a.dtype.itemsize * 8}"))


def from_bits(bits: np.ndarray, dtype) -> np.ndarray:
    return np.ascontiguousarray(bits).view(np.dtype(dtype))


def special_words(dtype) -> np.ndarray:
    """NaNs with varied payloads and signs (quiet and signalling), ±inf, ±0, subnormals, max."""
    dtype = np.dtype(dtype)
    if dtype == BF16:
        w = [0x7F81, 0xFF81, 0x7FC0, 0xFFC0, 0x7FFF, 0xFFFF, 0x7FA5, 0x7F80, 0xFF80, 0x0000,
             0x8000, 0x0001, 0x8001, 0x007F, 0x807F, 0x7F7F, 0xFF7F, 0x0080, 0x3F80, 0xBF80]
    else:
        w = [0x7F800001, 0xFF800001, 0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0x7FA5A5A5, 0x7F800000,
             0xFF800000, 0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x7F7FFFFF,
             0xFF7FFFFF, 0x00800000, 0x3F800000, 0xBF800000]
    return np.array(w, dtype=WORD[dtype])


def random_words(rng, shape, dtype) -> np.ndarray:
    """Uniformly random bit patterns: every exponent, NaN payload and sign shows up."""
    word = WORD[np.dtype(dtype)]
    return rng.integers(0, np.iinfo(word).max, size=shape, dtype=word, endpoint=True)


def adversarial(rng, shape, dtype) -> np.ndarray:
    """Random bits with special words sprinkled in at random positions, as ``dtype``."""
    bits = random_words(rng, shape, dtype).reshape(-1)
    sp = special_words(dtype)
    k = min(bits.size, 4 * sp.size)
    pos = rng.choice(bits.size, size=k, replace=False)
    bits[pos] = sp[np.arange(k) % sp.size]
    return from_bits(bits.reshape(shape), dtype)


def weights(rng, shape, dtype, scale=0.02) -> np.ndarray:
    """Weight-like values: normal, so exponents cluster the way trained weights' do."""
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def churn(rng, x: np.ndarray, exp_frac: float, flip_signs: float = 0.0) -> np.ndarray:
    """Next step's tensor: every mantissa moves; ``exp_frac`` of exponents change for sure.

    Changed exponents get a different random exponent, so the data stays adversarial (the new
    value may be a NaN, inf or subnormal). ``flip_signs`` flips that fraction of sign bits.
    """
    dtype = x.dtype
    word, mant = WORD[dtype], MANT[dtype]
    bits = bits_of(x).reshape(-1).copy()
    top = np.array(1 << (8 * np.dtype(word).itemsize - 1), word)
    mant_mask = np.array((1 << mant) - 1, word)
    bits ^= rng.integers(0, int(mant_mask) + 1, size=bits.size).astype(word) & mant_mask
    n_change = int(round(exp_frac * bits.size))
    if n_change:
        pos = rng.choice(bits.size, size=n_change, replace=False)
        old = (bits[pos] >> mant) & 0xFF
        new = (old + rng.integers(1, 256, size=n_change)) % 256
        bits[pos] = (bits[pos] & ~np.array(0xFF << mant, word)) | (new.astype(word) << mant)
    if flip_signs:
        pos = rng.random(bits.size) < flip_signs
        bits[pos] ^= top
    return from_bits(bits.reshape(x.shape), dtype)


def exponents(x: np.ndarray) -> np.ndarray:
    return ((bits_of(x) >> MANT[x.dtype]) & 0xFF).astype(np.uint8)


def ord_np(bits):
    top = np.array(1 << (bits.dtype.itemsize * 8 - 1), bits.dtype)
    return np.where(bits & top, bits ^ (top - np.array(1, bits.dtype)), bits)


def moved(x, d):
    """``x`` with every word moved by ``d`` (int64) ulps in ord space, modulo the width."""
    bits = bits_of(x)
    wide = ord_np(bits).astype(np.int64) + d
    return from_bits(ord_np((wide % (1 << (8 * bits.dtype.itemsize))).astype(bits.dtype)),
                     x.dtype)


def word_deltas(rng, shape, scale=1.0):
    """A steady-state-like move per word (word_delta study: |d|<=1 ~80%, <=7 ~95%,
    |d|>127 ~0.3%), widened by ``scale``."""
    u = rng.random(shape)
    small = rng.integers(-1, 2, shape)
    mid = rng.integers(-7, 8, shape)
    far = rng.integers(-127, 128, shape)
    raw = rng.integers(-(1 << 20), 1 << 20, shape)
    d = np.where(u < 0.8, small, np.where(u < 0.95, mid, np.where(u < 0.997, far, raw)))
    return np.round(d * scale).astype(np.int64)
