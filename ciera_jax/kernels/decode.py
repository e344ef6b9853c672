"""Fused exponent-mode decode: one read of the exponents and payload planes, one write of the
weights.

Exactly ``codec.merge``: rebuild the same-width unsigned word from the exponent byte and the
planar sign+mantissa bytes with shifts and ors, then bitcast (same width) to bf16/float32
outside the kernel, so NaN payloads, signalling NaNs, infinities, signed zeros and subnormals
come back bit for bit. The backend lives in ``backend.py``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ciera_jax.codec import bitfields
from ciera_jax.kernels import _layout
from ciera_jax.kernels.backend import Operand, check_backend, stream_call
from ciera_jax.kernels.encode import BLOCK


def decode_reference(exp: jnp.ndarray, payload_Pxn: jnp.ndarray, dtype) -> jnp.ndarray:
    """The pure-jnp decode the kernel must match bit for bit."""
    return bitfields.merge(exp, payload_Pxn, dtype)


def decode_body(exp, planes, *, fmt):
    """One block: exponent bytes + payload planes -> unsigned words."""
    w = fmt.word.type
    top = fmt.payload_bytes - 1
    hi = planes[top].astype(fmt.word)
    word = ((hi & w(0x80)) << w(fmt.bits - 8)) | ((hi & w(0x7F)) << w(8 * top))
    word = word | (exp.astype(fmt.word) << w(fmt.mantissa_bits))
    for i in range(top):  # float32: the two low mantissa bytes
        word = word | (planes[i].astype(fmt.word) << w(8 * i))
    return word


def decode_pallas(exp: jnp.ndarray, payload_Pxn: jnp.ndarray, dtype, *, block: int = BLOCK,
                  backend: str | None = None, interpret: bool = False,
                  num_warps=None) -> jnp.ndarray:
    """Pallas decode: ``exp`` uint8 of any shape, ``payload_Pxn`` uint8 of shape
    (P, *exp.shape)."""
    del num_warps
    fmt = bitfields.word_format(dtype)
    _layout.check_block(block)
    backend = check_backend(backend)
    shape = exp.shape
    P = fmt.payload_bytes
    if payload_Pxn.shape != (P, *shape):
        raise ValueError(
            f"payload_Pxn must have shape {(P, *shape)} for {np.dtype(dtype).name}, "
            f"got {payload_Pxn.shape}"
        )
    n = _layout.num_elements(shape)
    if n == 0:
        return jnp.zeros(shape, fmt.dtype)
    exp_N = _layout.flatten_padded(exp.astype(jnp.uint8), block)
    n_pad = exp_N.shape[0]
    payload = payload_Pxn.astype(jnp.uint8).reshape(P, n)
    if n_pad != n:
        payload = jnp.pad(payload, ((0, 0), (0, n_pad - n)))
    call = stream_call(
        lambda e, p: (decode_body(e, p, fmt=fmt),),
        [Operand(jnp.uint8), Operand(jnp.uint8, planes=P)], [Operand(fmt.word)],
        n_pad=n_pad, block=block, backend=backend, interpret=interpret,
        name=f"ciera_decode_{fmt.dtype.name}")
    (out_N,) = call(exp_N, payload)
    # Slice the padding off the unsigned words, then view them as floats: XLA:CPU's copies of
    # bf16 canonicalise NaN payloads, copies of unsigned words keep every bit.
    return bitfields.from_bits(_layout.unflatten(out_N, shape), fmt.dtype)
