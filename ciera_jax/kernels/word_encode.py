"""Word-mode encode kernel: one read of the shard and its cached words, the deltas and the
per-block demand counts out.

Per element: ``d = ord(new) - ord(cached)`` modulo the word width (see
:mod:`ciera_jax.codec.wordcodec`), written as the same-width unsigned pattern and viewed as signed
outside; per block of ``block`` elements: how many escape at code widths 2, 3 and 4, how many
go raw (``|d| > 127``) and how many exponents changed. The caller sums the block counts (a tiny
reduction). Only shifts, masks, xor, wrapping subtraction, compares, selects and sums, and no
width-changing bitcast (the float -> unsigned view happens outside, where it is free).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from ciera_jax.codec import bitfields, wordcodec
from ciera_jax.kernels import _layout
from ciera_jax.kernels.backend import Operand, check_backend, stream_call
from ciera_jax.kernels.encode import BLOCK
from ciera_jax.codec.word_ladder import CODE_BITS, LEVEL1_LIMIT, code_limit

COUNT_SLOTS = 8  # the demand counts of a block, padded to a power of two


def word_encode_reference(x: jnp.ndarray, cached_bits: jnp.ndarray):
    """``x`` (bf16/float32) and its cached words -> ``(d, demand)``: signed deltas shaped like
    ``x`` and int32 (N_DEMANDS,) counts (see :func:`ciera_jax.codec.wordcodec.demands`)."""
    fmt = bitfields.word_format(x.dtype)
    bits = bitfields.to_bits(x)
    d = wordcodec.delta(bits, cached_bits)
    exp_changed = ((bits ^ cached_bits) >> fmt.mantissa_bits) & 0xFF != 0
    return d, wordcodec.demands(d, exp_changed)


def ord_word(word, fmt):
    """``ord`` on the unsigned pattern: magnitude if the sign is 0, else ``~magnitude`` (which is
    ``-magnitude - 1`` read as signed), both of the word width."""
    w = fmt.word.type
    return jnp.where(word >> w(fmt.bits - 1) != w(0), word ^ w((1 << (fmt.bits - 1)) - 1), word)


def word_encode_body(new, old, *, fmt):
    """One block: new and cached words -> (unsigned delta, [demand counts of the block])."""
    w = fmt.word.type
    d_u = ord_word(new, fmt) - ord_word(old, fmt)
    # |d| from the two's complement pattern, staying unsigned (no width-changing casts).
    neg = d_u >> w(fmt.bits - 1) != w(0)
    mag = jnp.where(neg, w(0) - d_u, d_u)  # |d|, with 2^(bits-1) for the most negative
    # Zero padding (both inputs) counts nowhere, so no tail mask is needed.
    limits = [code_limit(b) for b in CODE_BITS] + [LEVEL1_LIMIT]
    counts = [jnp.sum(jnp.where(mag > w(lim), 1, 0).astype(jnp.int32)) for lim in limits]
    changed = ((new ^ old) >> w(fmt.mantissa_bits)) & w(0xFF)
    counts.append(jnp.sum(jnp.where(changed != w(0), 1, 0).astype(jnp.int32)))
    return d_u, counts


def word_encode_pallas(x: jnp.ndarray, cached_bits: jnp.ndarray, *, block: int = BLOCK,
                       backend: str | None = None, interpret: bool = False, num_warps=None):
    """Pallas :func:`word_encode_reference`: same outputs, bit for bit."""
    del num_warps
    fmt = bitfields.word_format(x.dtype)
    _layout.check_block(block)
    backend = check_backend(backend)
    shape, n = x.shape, _layout.num_elements(x.shape)
    signed = wordcodec.signed_like(fmt.word)
    if n == 0:
        return jnp.zeros(shape, signed), jnp.zeros((wordcodec.N_DEMANDS,), jnp.int32)
    x_N = _layout.flatten_padded(bitfields.to_bits(x), block)
    cache_N = _layout.flatten_padded(cached_bits.astype(fmt.word), block)
    call = stream_call(
        functools.partial(word_encode_body, fmt=fmt),
        [Operand(fmt.word), Operand(fmt.word)],
        [Operand(fmt.word), Operand(jnp.int32, per_block=COUNT_SLOTS)],
        n_pad=x_N.shape[0], block=block, backend=backend, interpret=interpret,
        name=f"ciera_word_encode_{fmt.dtype.name}")
    d_N, counts = call(x_N, cache_N)
    d = lax.bitcast_convert_type(_layout.unflatten(d_N, shape), signed)
    return d, jnp.sum(counts, axis=0, dtype=jnp.int32)[:wordcodec.N_DEMANDS]
