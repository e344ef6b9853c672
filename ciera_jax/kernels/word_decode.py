"""Word-mode decode kernel: the dense part of the rebuild, one read of the cached words and the
unpacked codes, one write of the new words.

Per element: ``new = ord⁻¹(ord(cached) + code - code_limit(b))`` modulo the word width. Escaped
elements come out as garbage here and are overwritten by the caller from the level-1/level-2
lists (a scatter of at most the rung's capacity, found block-wise: see
:func:`ciera_jax.codec.wordcodec.escape_positions`), so this kernel is a pure stream.
"""

from __future__ import annotations

import jax.numpy as jnp

from ciera_jax.codec import bitfields, wordcodec
from ciera_jax.kernels import _layout
from ciera_jax.kernels.backend import Operand, check_backend, stream_call
from ciera_jax.kernels.encode import BLOCK
from ciera_jax.kernels.word_encode import ord_word
from ciera_jax.codec.word_ladder import code_limit


def word_decode_reference(cached_bits: jnp.ndarray, codes: jnp.ndarray, code_bits: int):
    """The pure-jnp dense decode the kernel must match bit for bit."""
    return wordcodec.dense_decode(cached_bits, codes, code_bits)


def word_decode_body(old, codes, *, fmt, code_bits):
    """One block: cached words + codes -> new words (``ord`` is its own inverse)."""
    w = fmt.word.type
    # + (code - limit) modulo the word width: add the code, subtract the limit, both unsigned
    ord_new = ord_word(old, fmt) + codes.astype(fmt.word) - w(code_limit(code_bits))
    return ord_word(ord_new, fmt)


def word_decode_pallas(cached_bits: jnp.ndarray, codes: jnp.ndarray, code_bits: int, *,
                       block: int = BLOCK, backend: str | None = None,
                       interpret: bool = False, num_warps=None):
    """Pallas :func:`word_decode_reference`: ``cached_bits`` unsigned words, ``codes`` uint8 of
    the same shape."""
    del num_warps
    fmt = bitfields.word_format(_float_of(cached_bits.dtype))
    _layout.check_block(block)
    backend = check_backend(backend)
    shape = cached_bits.shape
    if codes.shape != shape:
        raise ValueError(f"codes shape {codes.shape} != cached words shape {shape}")
    if _layout.num_elements(shape) == 0:
        return jnp.zeros(shape, fmt.word)
    cache_N = _layout.flatten_padded(cached_bits, block)
    codes_N = _layout.flatten_padded(codes.astype(jnp.uint8), block)
    call = stream_call(
        lambda old, c: (word_decode_body(old, c, fmt=fmt, code_bits=code_bits),),
        [Operand(fmt.word), Operand(jnp.uint8)], [Operand(fmt.word)],
        n_pad=cache_N.shape[0], block=block, backend=backend, interpret=interpret,
        name=f"ciera_word_decode_{fmt.dtype.name}_b{code_bits}")
    (out_N,) = call(cache_N, codes_N)
    return _layout.unflatten(out_N, shape)


def _float_of(word_dtype):
    return {2: jnp.bfloat16, 4: jnp.float32}[jnp.dtype(word_dtype).itemsize]
