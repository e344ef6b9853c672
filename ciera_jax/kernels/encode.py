"""Fused exponent-mode encode: one read of ``x`` and the cached exponents, one write of the
exponent byte, the planar sign+mantissa payload bytes (exactly ``codec.split``) and the
``changed`` flags (exponent differs from the cache).

Word-level bit work only: the input is bitcast to the same-width unsigned word (uint16 /
uint32) outside the kernel (free in XLA, and bit-preserving where XLA:CPU's bf16 copies are
not), and the body uses only shifts, masks, a compare and truncating ``astype`` to uint8, which
both Pallas GPU backends lower. ``changed`` leaves the kernel as uint8 0/1 and becomes bool
outside (XLA fuses the ``!= 0`` into its consumer). The backend (Mosaic GPU or Triton) and how
a block is launched live in ``backend.py``.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from ciera_jax.codec import bitfields
from ciera_jax.kernels import _layout
from ciera_jax.kernels.backend import Operand, check_backend, stream_call

BLOCK = 4096  # elements per program: 8 KB of bf16 in, >= 12 KB out; a power of two


def encode_reference(x: jnp.ndarray, cache_exp: jnp.ndarray):
    """The pure-jnp encode the kernel must match bit for bit: ``codec.split`` + a compare."""
    exp, payload_Pxn = bitfields.split(x)
    return exp, payload_Pxn, exp != cache_exp


def encode_body(word, cache_exp, *, fmt):
    """One block: unsigned words + cached exponents -> (exp, [payload planes], changed u8)."""
    w = fmt.word.type
    exp = ((word >> w(fmt.mantissa_bits)) & w(0xFF)).astype(jnp.uint8)
    changed = (exp != cache_exp).astype(jnp.uint8)
    top = fmt.payload_bytes - 1
    planes = [((word >> w(8 * i)) & w(0xFF)).astype(jnp.uint8) for i in range(top)]
    # top payload byte: sign << 7 | the mantissa's highest 7 bits
    sign = (word >> w(fmt.bits - 8)) & w(0x80)
    high = (word >> w(8 * top)) & w(0x7F)
    planes.append((sign | high).astype(jnp.uint8))
    return exp, planes, changed


def encode_pallas(x: jnp.ndarray, cache_exp: jnp.ndarray, *, block: int = BLOCK,
                  backend: str | None = None, interpret: bool = False, num_warps=None):
    """Pallas encode of ``x`` (any shape, bf16/float32) against ``cache_exp`` (uint8, same
    shape) on ``backend`` (None: the one ``impl="pallas"`` picks). ``num_warps`` is accepted
    for compatibility and ignored (Triton runs ``backend.TRITON_WARPS``)."""
    del num_warps
    fmt = bitfields.word_format(x.dtype)
    _layout.check_block(block)
    backend = check_backend(backend)
    shape = x.shape
    n = _layout.num_elements(shape)
    P = fmt.payload_bytes
    if n == 0:
        return (jnp.zeros(shape, jnp.uint8), jnp.zeros((P, *shape), jnp.uint8),
                jnp.zeros(shape, jnp.bool_))
    # Bitcast (same width, free in XLA) before any pad/reshape: XLA:CPU's copies of bf16 are
    # not bit-preserving (they canonicalise NaN payloads), copies of unsigned words are.
    x_N = _layout.flatten_padded(bitfields.to_bits(x), block)
    cache_N = _layout.flatten_padded(cache_exp.astype(jnp.uint8), block)
    call = stream_call(
        functools.partial(encode_body, fmt=fmt),
        [Operand(fmt.word), Operand(jnp.uint8)],
        [Operand(jnp.uint8), Operand(jnp.uint8, planes=P), Operand(jnp.uint8)],
        n_pad=x_N.shape[0], block=block, backend=backend, interpret=interpret,
        name=f"ciera_encode_{fmt.dtype.name}")
    exp_N, payload_Pxn, changed_N = call(x_N, cache_N)
    return (_layout.unflatten(exp_N, shape), _layout.unflatten(payload_Pxn, shape),
            _layout.unflatten(changed_N, shape) != 0)
