"""Bit-level split and merge of floating-point words: exponent byte vs. sign + mantissa bytes.

Everything is a bitcast to the unsigned word of the *same width* (uint16 for bf16, uint32 for
float32) followed by shifts and masks, so every bit pattern (NaN payloads, infinities, signed
zeros, subnormals) round-trips exactly, and the same code lowers in Pallas/Triton, which refuses
width-changing bitcasts.

Payload layout is planar: ``payload_Pxn`` has one leading plane per payload byte (P=1 for bf16,
P=3 for float32), each plane shaped like the tensor.

Shape letters, one meaning each in the codec, the kernels and the collective: ``N`` ranks of
the gather axis, ``n`` elements (of a shard, or of the tensor where it says so), ``P`` payload
planes, ``L`` bytes of one rank's wire buffer, ``K`` a patch capacity. Planes keep kernels coalesced and let the
wire buffer be a plain concatenation.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True)
class WordFormat:
    """How one floating dtype splits into an 8-bit exponent and payload bytes."""

    dtype: np.dtype
    word: np.dtype  # same-width unsigned word
    mantissa_bits: int  # exponent sits just above the mantissa; sign is the top bit
    payload_bytes: int  # bytes of sign + mantissa on the wire per element

    @property
    def bits(self) -> int:
        return self.word.itemsize * 8


FORMATS: dict[np.dtype, WordFormat] = {
    np.dtype(jnp.bfloat16): WordFormat(np.dtype(jnp.bfloat16), np.dtype(np.uint16), 7, 1),
    np.dtype(np.float32): WordFormat(np.dtype(np.float32), np.dtype(np.uint32), 23, 3),
}


def is_compressible(dtype) -> bool:
    """True for dtypes with an exponent-reuse wire format (bf16, float32)."""
    return np.dtype(dtype) in FORMATS


def word_format(dtype) -> WordFormat:
    try:
        return FORMATS[np.dtype(dtype)]
    except KeyError:
        raise TypeError(
            f"CIERA compresses bfloat16 and float32 only, got {np.dtype(dtype)}; "
            "use a plain all-gather for this dtype (ciera_jax.all_gather does so automatically "
            "unless compression is forced)."
        ) from None


def unsigned_dtype_like(dtype) -> np.dtype:
    """Same-width unsigned integer dtype, for bit-preserving plain gathers of any dtype."""
    return np.dtype(f"uint{np.dtype(dtype).itemsize * 8}")


def to_bits(x: jnp.ndarray) -> jnp.ndarray:
    """Same-width unsigned view of ``x`` (identity for unsigned ints; ``bool``, which
    ``lax.bitcast_convert_type`` refuses, as its 0/1 bytes)."""
    word = unsigned_dtype_like(x.dtype)
    if x.dtype == np.bool_:
        return x.astype(word)
    return x if x.dtype == word else lax.bitcast_convert_type(x, word)


def from_bits(bits: jnp.ndarray, dtype) -> jnp.ndarray:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return bits.astype(dtype)
    return bits if bits.dtype == dtype else lax.bitcast_convert_type(bits, dtype)


def le_bytes(words_N: jnp.ndarray) -> jnp.ndarray:
    """Unsigned words' little-endian bytes, flat, by shifts: they fuse into the kernel that
    reads them, where a size-changing bitcast of a slice is a kernel of its own on XLA:GPU.
    A scalar shift per byte: an array of shifts XLA:GPU turns into an iota, computed by a
    kernel of its own."""
    word = np.dtype(words_N.dtype)
    if word.itemsize == 1:
        return words_N.reshape(-1)
    return jnp.stack([(words_N >> word.type(8 * k)) & word.type(0xFF)
                      for k in range(word.itemsize)], axis=-1).astype(jnp.uint8).reshape(-1)


def from_le_bytes(rows_NxB: jnp.ndarray, dtype, count: int) -> jnp.ndarray:
    """Each row's first ``count`` words of ``dtype`` from its little-endian bytes: (N, count),
    by shifts and ORs (:func:`le_bytes`' reason)."""
    width = np.dtype(dtype).itemsize
    if width == 1:
        return from_bits(rows_NxB, dtype)
    word = unsigned_dtype_like(dtype)
    grouped = rows_NxB.reshape(rows_NxB.shape[0], count, width).astype(word)
    bits = functools.reduce(jnp.bitwise_or, [grouped[:, :, k] << word.type(8 * k)
                                             for k in range(width)])
    return from_bits(bits, dtype)


def exponent(x: jnp.ndarray) -> jnp.ndarray:
    """The 8 exponent bits of every element, as uint8."""
    fmt = word_format(x.dtype)
    word = lax.bitcast_convert_type(x, fmt.word)
    return ((word >> fmt.mantissa_bits) & 0xFF).astype(jnp.uint8)


def split(x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Split ``x`` into ``(exp, payload_Pxn)``: exponent bytes, and planar sign+mantissa bytes.

    bf16: the single payload byte is ``sign << 7 | mantissa``.
    float32: bytes are mantissa[0:8], mantissa[8:16], ``sign << 7 | mantissa[16:23]``.
    """
    fmt = word_format(x.dtype)
    word = lax.bitcast_convert_type(x, fmt.word)
    exp = ((word >> fmt.mantissa_bits) & 0xFF).astype(jnp.uint8)
    sign = word >> (fmt.bits - 1)
    planes = [((word >> (8 * i)) & 0xFF).astype(jnp.uint8) for i in range(fmt.payload_bytes - 1)]
    top_mantissa = (word >> (8 * (fmt.payload_bytes - 1))) & 0x7F
    planes.append(((sign << 7) | top_mantissa).astype(jnp.uint8))
    return exp, jnp.stack(planes)


def merge(exp: jnp.ndarray, payload_Pxn: jnp.ndarray, dtype) -> jnp.ndarray:
    """Inverse of :func:`split`: rebuild the words bit for bit and view them as ``dtype``."""
    fmt = word_format(dtype)
    w = fmt.word.type
    top = payload_Pxn[fmt.payload_bytes - 1].astype(fmt.word)
    word = ((top >> 7) << (fmt.bits - 1)) | (exp.astype(fmt.word) << fmt.mantissa_bits)
    word = word | ((top & w(0x7F)) << (8 * (fmt.payload_bytes - 1)))
    for i in range(fmt.payload_bytes - 1):
        word = word | (payload_Pxn[i].astype(fmt.word) << (8 * i))
    return lax.bitcast_convert_type(word, fmt.dtype)
