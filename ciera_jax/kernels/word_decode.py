"""Word-mode decode kernel: the dense part of the rebuild, one read of the cached words and the
unpacked codes, one write of the new words.

Per element: ``new = ord⁻¹(ord(cached) + code - code_limit(b))`` modulo the word width. Escaped
elements come out as garbage here and are overwritten by the caller from the level-1/level-2
lists (a scatter of at most the rung's capacity, found block-wise: see
:func:`ciera_jax.wordcodec.escape_positions`), so this kernel is a pure stream.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ciera_jax import codec, wordcodec
from ciera_jax.kernels import _layout
from ciera_jax.kernels.backend import compiler_params
from ciera_jax.kernels.encode import BLOCK, NUM_WARPS
from ciera_jax.word_ladder import code_limit


def word_decode_reference(cached_bits: jnp.ndarray, codes: jnp.ndarray, code_bits: int):
    """The pure-jnp dense decode the kernel must match bit for bit."""
    return wordcodec.dense_decode(cached_bits, codes, code_bits)


def _word_decode_kernel(cache_ref, codes_ref, out_ref, *, fmt, code_bits):
    w = fmt.word.type
    top = w((1 << (fmt.bits - 1)) - 1)
    old = cache_ref[...]
    ord_old = jnp.where(old >> w(fmt.bits - 1) != w(0), old ^ top, old)
    # + (code - limit) modulo the word width: add the code, subtract the limit, both unsigned
    ord_new = ord_old + codes_ref[...].astype(fmt.word) - w(code_limit(code_bits))
    out_ref[...] = jnp.where(ord_new >> w(fmt.bits - 1) != w(0), ord_new ^ top, ord_new)


def word_decode_pallas(cached_bits: jnp.ndarray, codes: jnp.ndarray, code_bits: int, *,
                       block: int = BLOCK, num_warps: int = NUM_WARPS,
                       interpret: bool = False):
    """Pallas :func:`word_decode_reference`: ``cached_bits`` unsigned words, ``codes`` uint8 of
    the same shape."""
    fmt = codec.word_format(_float_of(cached_bits.dtype))
    _layout.check_block(block)
    shape = cached_bits.shape
    if codes.shape != shape:
        raise ValueError(f"codes shape {codes.shape} != cached words shape {shape}")
    if _layout.num_elements(shape) == 0:
        return jnp.zeros(shape, fmt.word)
    cache_N = _layout.flatten_padded(cached_bits, block)
    codes_N = _layout.flatten_padded(codes.astype(jnp.uint8), block)
    n_pad = cache_N.shape[0]
    vec = pl.BlockSpec((block,), lambda i: (i,))
    out_N = pl.pallas_call(
        functools.partial(_word_decode_kernel, fmt=fmt, code_bits=code_bits),
        out_shape=jax.ShapeDtypeStruct((n_pad,), fmt.word),
        grid=(n_pad // block,),
        in_specs=[vec, vec],
        out_specs=vec,
        compiler_params=compiler_params(num_warps),
        interpret=interpret,
        name=f"ciera_word_decode_{fmt.dtype.name}_b{code_bits}",
    )(cache_N, codes_N)
    return _layout.unflatten(out_N, shape)


def _float_of(word_dtype):
    return {2: jnp.bfloat16, 4: jnp.float32}[jnp.dtype(word_dtype).itemsize]
