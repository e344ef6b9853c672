"""Word mode's codec in pure jnp: order map, deltas, code packing, escape compaction, decode.

Words are handled as the same-width unsigned integer (uint16 for bf16, uint32 for float32).
``ord`` maps a word to its monotone order, as the two's complement bit pattern of the same width:
non-negative words keep their bits, negative ones become ``-magnitude - 1`` (so +0 and -0 stay
distinct), which is ``bits ^ 0x7FFF`` for bf16. It is its own inverse. The delta
``d = ord(new) - ord(cached)`` is taken modulo the word width, so ``ord(cached) + d`` gives the
new word back for *every* pair of bit patterns (NaN payloads, infinities, sign flips): wrap-around
only ever makes a far move look near, which is still exact.

Wire of one rank for a rung ``(b, C1, C2)`` (see :mod:`ciera_jax.word_ladder`): ``b``-bit codes
(``d + code_limit(b)``, or the escape code) packed 8 codes per ``b`` bytes and cut to
``ceil(n*b/8)`` bytes; level 1: one int8 per escape in position order (``d``, or ``LEVEL2`` for
``|d| > 127``); level 2: the raw word of each ``LEVEL2`` escape, in order. Escape positions are
implied by the codes; :func:`escape_positions` finds them block-wise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ciera_jax import patches
from ciera_jax.word_ladder import CODE_BITS, LEVEL1_LIMIT, LEVEL2, code_limit, escape_code

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
    value = jnp.sum(groups << (b * jnp.arange(8, dtype=jnp.uint32)), axis=1, dtype=jnp.uint32)
    out = (value[:, None] >> (8 * jnp.arange(b, dtype=jnp.uint32))) & 0xFF
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


def escape_positions(esc_N, capacity: int):
    """Flat positions of the first ``capacity`` escapes, in order (``n`` where absent).

    Block-wise: per-block escape counts, an exclusive scan over the blocks, and a search inside
    only the blocks that hold escapes (:func:`ciera_jax.patches.first_positions`); no
    full-length prefix sum.
    """
    if capacity == 0:
        return jnp.zeros((0,), jnp.int32)
    return patches.first_positions(esc_N, capacity)


def compact(d_N, bits_N, b: int, c1: int, c2: int):
    """Sender side: level 1 (int8 (c1,)) and level 2 (words (c2,)) of one flat shard.

    Holds this shard's escapes if they fit (the agreement guarantees it for the chosen rung).
    """
    n = d_N.shape[0]
    pos = escape_positions(beyond(d_N, code_limit(b)), c1)
    valid = pos < n
    safe = jnp.minimum(pos, n - 1)
    d_esc = d_N[safe]
    raw = beyond(d_esc, LEVEL1_LIMIT) & valid
    level1 = jnp.where(raw, LEVEL2, jnp.where(valid, d_esc, 0)).astype(jnp.int8)
    if c2 == 0:
        return level1, jnp.zeros((0,), bits_N.dtype)
    slot = escape_positions(raw, c2)  # the j-th raw escape's slot in level 1
    words = bits_N[safe[jnp.minimum(slot, c1 - 1)]]
    return level1, jnp.where(slot < c1, words, 0).astype(bits_N.dtype)


def encode_wire(d_N, bits_N, b: int, c1: int, c2: int):
    """One uint8 buffer: packed codes, level 1, level 2 (as little-endian bytes)."""
    level1, level2 = compact(d_N, bits_N, b, c1, c2)
    parts = [pack_codes(codes_of(d_N, b), b), lax.bitcast_convert_type(level1, jnp.uint8)]
    if c2:
        parts.append(lax.bitcast_convert_type(level2, jnp.uint8).reshape(-1))
    return jnp.concatenate(parts)


def wire_size(n: int, b: int, c1: int, c2: int, word_bytes: int) -> int:
    return code_bytes(n, b) + c1 + c2 * word_bytes


def split_wire(wire_RxL, n: int, b: int, c1: int, c2: int, word_dtype):
    """Receiver side: rows of wire -> (codes (R, n) uint8, level 1 (R, c1) int8,
    level 2 (R, c2) words)."""
    rows = wire_RxL.shape[0]
    cb = code_bytes(n, b)
    codes = unpack_codes(wire_RxL[:, :cb], b, n)
    level1 = lax.bitcast_convert_type(wire_RxL[:, cb:cb + c1], jnp.int8)
    wb = np.dtype(word_dtype).itemsize
    raw = wire_RxL[:, cb + c1:cb + c1 + c2 * wb].reshape(rows, c2, wb)
    level2 = (lax.bitcast_convert_type(raw, np.dtype(word_dtype)) if c2
              else jnp.zeros((rows, 0), word_dtype))
    return codes, level1, level2


def dense_decode(cached_bits, codes, b: int):
    """Every element as if no code escaped: ``ord(cached) + code - code_limit(b)``.
    Escaped elements get garbage here; :func:`escape_words` supplies them."""
    d = codes.astype(jnp.int32) - code_limit(b)
    return apply_delta(cached_bits, d)


def escape_words(cached_at_pos_RxC, level1_RxC, level2_RxK):
    """The new word of every level-1 slot: raw from level 2, or ``ord(cached) + d``."""
    rows, c1 = level1_RxC.shape
    is_raw = level1_RxC == LEVEL2
    if level2_RxK.shape[1]:
        raw_rank = patches.prefix_sum(is_raw.astype(jnp.int32), axis=1) - is_raw
        idx = jnp.minimum(raw_rank, level2_RxK.shape[1] - 1)
        raw_word = jnp.take_along_axis(level2_RxK, idx, axis=1)
    else:
        raw_word = jnp.zeros_like(cached_at_pos_RxC)
    moved = apply_delta(cached_at_pos_RxC, level1_RxC.astype(jnp.int32))
    return jnp.where(is_raw, raw_word, moved)


def escape_positions_rows(codes_RxN, b: int, capacity: int):
    """:func:`escape_positions` of every row of a code plane: int32 (R, capacity)."""
    esc = codes_RxN == escape_code(b)
    return jax.vmap(lambda row: escape_positions(row, capacity))(esc)


