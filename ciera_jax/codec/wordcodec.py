"""Word mode's codec in pure jnp: order map, deltas, demand counts, code packing, dense decode.

Words are handled as the same-width unsigned integer (uint16 for bf16, uint32 for float32).
``ord`` maps a word to its monotone order, as the two's complement bit pattern of the same width:
non-negative words keep their bits, negative ones become ``-magnitude - 1`` (so +0 and -0 stay
distinct), which is ``bits ^ 0x7FFF`` for bf16. It is its own inverse. The delta
``d = ord(new) - ord(cached)`` is taken modulo the word width, so ``ord(cached) + d`` gives the
new word back for *every* pair of bit patterns (NaN payloads, infinities, sign flips): wrap-around
only ever makes a far move look near, which is still exact.

The code plane: ``b``-bit codes (``d + code_limit(b)``, or the escape code) packed 8 codes per
``b`` bytes and cut to ``ceil(n*b/8)`` bytes. The escapes travel out of line
(:mod:`ciera_jax.collective.word_mode`, :mod:`ciera_jax.codec.escapes`).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from ciera_jax.codec.word_ladder import CODE_BITS, LEVEL1_LIMIT, code_limit, escape_code

N_DEMANDS = len(CODE_BITS) + 2  # escapes at each code width, raw words, changed exponents
RAW, EXP_CHANGED = len(CODE_BITS), len(CODE_BITS) + 1  # indices into the demand vector


def signed_like(word_dtype) -> np.dtype:
    return np.dtype(f"int{np.dtype(word_dtype).itemsize * 8}")


def ord_bits(bits):
    """Monotone order of unsigned words as the same-width unsigned pattern; an involution."""
    w = bits.dtype.type
    top = np.dtype(bits.dtype).itemsize * 8 - 1
    return jnp.where(bits >> top != 0, bits ^ w((1 << top) - 1), bits)


def delta(new_bits, cached_bits):
    """``ord(new) - ord(cached)`` modulo the word width, as the same-width signed integer."""
    d = ord_bits(new_bits) - ord_bits(cached_bits)
    return lax.bitcast_convert_type(d, signed_like(new_bits.dtype))


def apply_delta(cached_bits, d):
    """Inverse of :func:`delta`: the new words from the cached words and signed deltas."""
    d_u = lax.bitcast_convert_type(d.astype(signed_like(cached_bits.dtype)), cached_bits.dtype)
    return ord_bits(ord_bits(cached_bits) + d_u)


def beyond(d, limit: int):
    """``|d| > limit`` without overflowing at the most negative value."""
    return (d > limit) | (d < -limit)


COUNT_BLOCK = 32  # elements per partial count: each of the 5 counts fits a 6-bit field


def demands(d, exp_changed):
    """This shard's demand vector, int32 (N_DEMANDS,): escapes for b = 2, 3, 4, raw words
    (``|d| > 127``), changed exponents (``exp_changed``: bool, for exponent mode).

    One pass: each element's five flags go into 6-bit fields of one int32, summed per block of
    32 (no field overflows), then the few block sums are split and added up. XLA:CPU runs a
    reduction at ~5 ns per element, so five separate ones cost more than the rest of the codec.
    """
    limits = [code_limit(b) for b in CODE_BITS] + [LEVEL1_LIMIT]
    packed = exp_changed.astype(jnp.int32) << (6 * len(limits))
    for k, lim in enumerate(limits):
        packed = packed | (beyond(d, lim).astype(jnp.int32) << (6 * k))
    flat = packed.reshape(-1)
    flat = jnp.pad(flat, (0, -flat.shape[0] % COUNT_BLOCK))
    sums = jnp.sum(flat.reshape(-1, COUNT_BLOCK), axis=1, dtype=jnp.int32)
    fields = (sums[:, None] >> (6 * jnp.arange(N_DEMANDS, dtype=jnp.int32))) & 63
    return jnp.sum(fields, axis=0, dtype=jnp.int32)


def codes_of(d, b: int):
    """uint8 code per element: ``d + code_limit(b)``, or the escape code when ``|d|`` is over."""
    lim = code_limit(b)
    safe = jnp.clip(d, -lim, lim).astype(jnp.int32) + lim
    return jnp.where(beyond(d, lim), escape_code(b), safe).astype(jnp.uint8)


def code_bytes(n: int, b: int) -> int:
    return -(-n * b // 8)


def pack_codes(codes_N, b: int):
    """uint8 codes (n,) of ``b`` bits -> uint8 (ceil(n*b/8),): 8 codes per ``b`` bytes,
    code i of a group at bit ``b*i`` of the group's little-endian ``b``-byte integer."""
    n = codes_N.shape[0]
    groups = jnp.pad(codes_N, (0, -n % 8)).reshape(-1, 8).astype(jnp.uint32)
    # Elementwise ORs of the group's fields (they do not overlap), not a sum over an axis:
    # XLA:GPU fuses them with the bytes' split, where a reduction may be a kernel of its own.
    value = functools.reduce(jnp.bitwise_or, [groups[:, k] << np.uint32(b * k)
                                              for k in range(8)])
    out = jnp.stack([(value >> np.uint32(8 * j)) & np.uint32(0xFF) for j in range(b)], axis=1)
    return out.astype(jnp.uint8).reshape(-1)[:code_bytes(n, b)]


def unpack_codes(bytes_RxB, b: int, n: int):
    """Inverse of :func:`pack_codes` per row: uint8 (R, ceil(n*b/8)) -> uint8 codes (R, n)."""
    rows = bytes_RxB.shape[0]
    groups = -(-n // 8)
    padded = jnp.pad(bytes_RxB, ((0, 0), (0, groups * b - bytes_RxB.shape[1])))
    grouped = padded.reshape(rows, groups, b).astype(jnp.uint32)
    value = jnp.sum(grouped << (8 * jnp.arange(b, dtype=jnp.uint32)), axis=2, dtype=jnp.uint32)
    codes = (value[:, :, None] >> (b * jnp.arange(8, dtype=jnp.uint32))) & (2 ** b - 1)
    return codes.astype(jnp.uint8).reshape(rows, groups * 8)[:, :n]


def dense_decode(cached_bits, codes, b: int):
    """Every element as if no code escaped: ``ord(cached) + code - code_limit(b)``.
    Escaped elements get garbage here; :func:`escape_words` supplies them."""
    d = codes.astype(jnp.int32) - code_limit(b)
    return apply_delta(cached_bits, d)
