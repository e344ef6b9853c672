"""Fused decode kernel: one read of the exponents and payload planes, one write of the weights.

Exactly ``codec.merge``: rebuild the same-width unsigned word from the exponent byte and the
planar sign+mantissa bytes with shifts and ors, then bitcast (same width) to bf16/float32, so
NaN payloads, signalling NaNs, infinities, signed zeros and subnormals come back bit for bit.
See ``encode.py`` for why the kernels use the Triton lowering.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from ciera_jax import codec
from ciera_jax.kernels import _layout
from ciera_jax.kernels.backend import compiler_params
from ciera_jax.kernels.encode import BLOCK, NUM_WARPS


def decode_reference(exp: jnp.ndarray, payload_Pxn: jnp.ndarray, dtype) -> jnp.ndarray:
    """The pure-jnp decode the kernel must match bit for bit."""
    return codec.merge(exp, payload_Pxn, dtype)


def _decode_kernel(exp_ref, payload_ref, out_ref, *, fmt):
    w = fmt.word.type
    top = fmt.payload_bytes - 1
    hi = payload_ref[top, :].astype(fmt.word)
    word = ((hi & w(0x80)) << w(fmt.bits - 8)) | ((hi & w(0x7F)) << w(8 * top))
    word = word | (exp_ref[...].astype(fmt.word) << w(fmt.mantissa_bits))
    for i in range(top):  # float32: the two low mantissa bytes
        word = word | (payload_ref[i, :].astype(fmt.word) << w(8 * i))
    out_ref[...] = word  # bitcast to fmt.dtype outside, after the unpadding slice


def decode_pallas(
    exp: jnp.ndarray,
    payload_Pxn: jnp.ndarray,
    dtype,
    *,
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
    interpret: bool = False,
) -> jnp.ndarray:
    """Pallas decode: ``exp`` uint8 of any shape, ``payload_Pxn`` uint8 of shape (P, *exp.shape)."""
    fmt = codec.word_format(dtype)
    _layout.check_block(block)
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
    vec = pl.BlockSpec((block,), lambda i: (i,))
    out_N = pl.pallas_call(
        functools.partial(_decode_kernel, fmt=fmt),
        out_shape=jax.ShapeDtypeStruct((n_pad,), fmt.word),
        grid=(n_pad // block,),
        in_specs=[vec, pl.BlockSpec((P, block), lambda i: (0, i))],
        out_specs=vec,
        compiler_params=compiler_params(num_warps),
        interpret=interpret,
        name=f"ciera_decode_{fmt.dtype.name}",
    )(exp_N, payload)
    # Slice the padding off the unsigned words, then view them as floats: XLA:CPU's copies of
    # bf16 canonicalise NaN payloads, copies of unsigned words keep every bit.
    return codec.from_bits(_layout.unflatten(out_N, shape), fmt.dtype)
