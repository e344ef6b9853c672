"""Word-mode decode kernel: the dense part of the rebuild, one read of the cached words and the
unpacked codes, one write of the new words.

Per element: ``new = ord⁻¹(ord(cached) + code - code_limit(b))`` modulo the word width. Escaped
elements come out as garbage here and are overwritten by the caller from the level-1/level-2
lists (a scatter of at most the rung's capacity, found block-wise: see
:func:`ciera_jax.codec.wordcodec.escape_positions`), so this kernel is a pure stream.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from ciera_jax.codec import bitfields, layout, wordcodec
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


def reads_in_place(shard_shape, axis: int, block: int = BLOCK) -> bool:
    """Whether :func:`word_decode_rows_pallas` can read a full-layout cache in place: a rank's
    run of the full tensor (its part of the gather axis and the dims after it) is a whole
    number of blocks, so each block of a rank's row lies in one place of the full layout."""
    _, s, post = layout.dims(shard_shape, axis)
    return math.prod(shard_shape) % block == 0 and (s * post) % block == 0


def word_decode_rows_pallas(cached_full, codes_Nxn, code_bits: int, shard_shape, axis: int, *,
                            block: int = BLOCK, backend: str | None = None,
                            interpret: bool = False):
    """:func:`word_decode_pallas` of ``full_to_rows(cached_full)`` and the codes' rank rows,
    without that transpose: each program reads its block of the cache where it lies in the
    full layout (:func:`reads_in_place`). Returns the new words as rank rows (N, n)."""
    fmt = bitfields.word_format(_float_of(cached_full.dtype))
    backend = check_backend(backend)
    n_ranks, n = codes_Nxn.shape
    if not reads_in_place(shard_shape, axis, block) or n != math.prod(shard_shape):
        raise ValueError(f"word_decode_rows: shard {tuple(shard_shape)} (axis {axis}) does not "
                         f"split into whole {block}-element runs; use word_decode_rows(...)")
    _, s, post = layout.dims(shard_shape, axis)
    per_shard, per_run = n // block, s * post // block

    def cache_block(i):  # program i: rank r's block k; in the full layout (before, rank, run)
        r, k = i // per_shard, i % per_shard
        return ((k // per_run) * n_ranks + r) * per_run + k % per_run

    call = stream_call(
        lambda old, c: (word_decode_body(old, c, fmt=fmt, code_bits=code_bits),),
        [Operand(fmt.word, blocks=cache_block), Operand(jnp.uint8)], [Operand(fmt.word)],
        n_pad=n_ranks * n, block=block, backend=backend, interpret=interpret,
        name=f"ciera_word_decode_rows_{fmt.dtype.name}_b{code_bits}")
    (out,) = call(cached_full.reshape(-1), codes_Nxn.astype(jnp.uint8).reshape(-1))
    return out.reshape(n_ranks, n)


def _float_of(word_dtype):
    return {2: jnp.bfloat16, 4: jnp.float32}[jnp.dtype(word_dtype).itemsize]
