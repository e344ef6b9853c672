"""Word-mode encode kernel: one read of the shard and its cached words, the deltas and the
per-block demand counts out.

Per element: ``d = ord(new) - ord(cached)`` modulo the word width (see
:mod:`ciera_jax.wordcodec`), written as the same-width signed integer; per block of ``block``
elements: how many escape at code widths 2, 3 and 4, how many go raw (``|d| > 127``) and how
many exponents changed. The caller sums the block counts (a tiny reduction). Only shifts,
masks, xor, wrapping subtraction, compares and sums: all in Pallas' Triton lowering, and no
width-changing bitcast (the float -> unsigned view happens outside, where it is free).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ciera_jax import codec, wordcodec
from ciera_jax.kernels import _layout
from ciera_jax.kernels.backend import compiler_params
from ciera_jax.kernels.encode import BLOCK, NUM_WARPS
from ciera_jax.word_ladder import CODE_BITS, LEVEL1_LIMIT, code_limit

COUNT_SLOTS = 8  # the demand counts of a block, padded to a power of two


def word_encode_reference(x: jnp.ndarray, cached_bits: jnp.ndarray):
    """``x`` (bf16/float32) and its cached words -> ``(d, demand)``: signed deltas shaped like
    ``x`` and int32 (N_DEMANDS,) counts (see :func:`ciera_jax.wordcodec.demands`)."""
    fmt = codec.word_format(x.dtype)
    bits = codec.to_bits(x)
    d = wordcodec.delta(bits, cached_bits)
    exp_changed = ((bits ^ cached_bits) >> fmt.mantissa_bits) & 0xFF != 0
    return d, wordcodec.demands(d, exp_changed)


def _word_encode_kernel(x_ref, cache_ref, d_ref, counts_ref, *, fmt):
    w = fmt.word.type
    top = w((1 << (fmt.bits - 1)) - 1)
    new, old = x_ref[...], cache_ref[...]
    ord_new = jnp.where(new >> w(fmt.bits - 1) != w(0), new ^ top, new)
    ord_old = jnp.where(old >> w(fmt.bits - 1) != w(0), old ^ top, old)
    d_u = ord_new - ord_old
    # |d| from the two's complement pattern, staying unsigned (no width-changing casts).
    neg = d_u >> w(fmt.bits - 1) != w(0)
    mag = jnp.where(neg, (w(0) - d_u), d_u)  # |d|, with 2^(bits-1) for the most negative
    d_ref[...] = d_u
    # Zero padding (both inputs) counts nowhere, so no tail mask is needed.
    counts = [jnp.sum(jnp.where(mag > w(code_limit(b)), 1, 0)) for b in CODE_BITS]
    counts.append(jnp.sum(jnp.where(mag > w(LEVEL1_LIMIT), 1, 0)))
    changed = ((new ^ old) >> w(fmt.mantissa_bits)) & w(0xFF)
    counts.append(jnp.sum(jnp.where(changed != w(0), 1, 0)))
    # One power-of-two row per block (Triton blocks are powers of two): counts, then zeros.
    slot = lax.broadcasted_iota(jnp.int32, (1, COUNT_SLOTS), 1)
    row = jnp.zeros((1, COUNT_SLOTS), jnp.int32)
    for k, c in enumerate(counts):
        row = jnp.where(slot == k, c.astype(jnp.int32), row)
    counts_ref[...] = row


def word_encode_pallas(x: jnp.ndarray, cached_bits: jnp.ndarray, *, block: int = BLOCK,
                       num_warps: int = NUM_WARPS, interpret: bool = False):
    """Pallas :func:`word_encode_reference`: same outputs, bit for bit."""
    fmt = codec.word_format(x.dtype)
    _layout.check_block(block)
    shape, n = x.shape, _layout.num_elements(x.shape)
    signed = wordcodec.signed_like(fmt.word)
    if n == 0:
        return jnp.zeros(shape, signed), jnp.zeros((wordcodec.N_DEMANDS,), jnp.int32)
    x_N = _layout.flatten_padded(codec.to_bits(x), block)
    cache_N = _layout.flatten_padded(cached_bits.astype(fmt.word), block)
    n_pad = x_N.shape[0]
    n_blocks = n_pad // block
    vec = pl.BlockSpec((block,), lambda i: (i,))
    d_N, counts = pl.pallas_call(
        functools.partial(_word_encode_kernel, fmt=fmt),
        out_shape=(jax.ShapeDtypeStruct((n_pad,), fmt.word),
                   jax.ShapeDtypeStruct((n_blocks, COUNT_SLOTS), jnp.int32)),
        grid=(n_blocks,),
        in_specs=[vec, vec],
        out_specs=(vec, pl.BlockSpec((1, COUNT_SLOTS), lambda i: (i, 0))),
        compiler_params=compiler_params(num_warps),
        interpret=interpret,
        name=f"ciera_word_encode_{fmt.dtype.name}",
    )(x_N, cache_N)
    d = lax.bitcast_convert_type(_layout.unflatten(d_N, shape), signed)
    return d, jnp.sum(counts, axis=0, dtype=jnp.int32)[:wordcodec.N_DEMANDS]
