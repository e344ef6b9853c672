"""Fused encode kernel: one read of ``x`` and the cached exponents, one write of everything out.

Per element it writes the exponent byte, the planar sign+mantissa payload bytes (exactly
``codec.split``) and the ``changed`` flag (exponent differs from the cache). Word-level bit work
only: the input is bitcast to the same-width unsigned word (uint16 / uint32) outside the kernel
(free in XLA, and bit-preserving where XLA:CPU's bf16 copies are not), and the kernel uses only
shifts, masks, a compare and truncating ``astype`` to uint8, all of which Pallas' Triton
lowering supports (``shrui``, ``andi``, ``ori``, ``trunci``, ``cmpi``).

Why Triton (the default ``pl.pallas_call`` GPU lowering) and not Mosaic GPU: this is a plain
1-D streaming elementwise kernel with no matmul, no shared-memory pipelining and no warp
specialisation to exploit; Triton vectorises such blocks well on Ampere/Hopper (H100/H200), takes
plain ``BlockSpec`` blocks on any power-of-two size, and the same kernel body runs in
``interpret=True`` mode on CPU for the tests. Mosaic GPU would need explicit SMEM/TMA staging
(and Hopper-only features) to win anything on a bandwidth-bound kernel.

``changed`` is produced as uint8 0/1 inside the kernel and turned into bool outside: uint8 stores
are the plainest thing Triton does, and under ``jit`` XLA fuses the ``!= 0`` into its consumer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ciera_jax import codec
from ciera_jax.kernels import _layout
from ciera_jax.kernels.backend import compiler_params

BLOCK = 4096  # elements per program: 8 KB of bf16 in, >= 12 KB out; power of two for Triton
NUM_WARPS = 4  # 128 threads x 32 elements: 16-byte vector loads/stores of the byte planes


def encode_reference(x: jnp.ndarray, cache_exp: jnp.ndarray):
    """The pure-jnp encode the kernel must match bit for bit: ``codec.split`` + a compare."""
    exp, payload_Pxn = codec.split(x)
    return exp, payload_Pxn, exp != cache_exp


def _encode_kernel(x_ref, cache_ref, exp_ref, payload_ref, changed_ref, *, fmt):
    w = fmt.word.type
    word = x_ref[...]  # the same-width unsigned word (bitcast outside, see encode_pallas)
    exp = ((word >> w(fmt.mantissa_bits)) & w(0xFF)).astype(jnp.uint8)
    exp_ref[...] = exp
    changed_ref[...] = (exp != cache_ref[...]).astype(jnp.uint8)
    top = fmt.payload_bytes - 1
    for i in range(top):  # float32: the two low mantissa bytes
        payload_ref[i, :] = ((word >> w(8 * i)) & w(0xFF)).astype(jnp.uint8)
    # top payload byte: sign << 7 | the mantissa's highest 7 bits
    sign = (word >> w(fmt.bits - 8)) & w(0x80)
    high = (word >> w(8 * top)) & w(0x7F)
    payload_ref[top, :] = (sign | high).astype(jnp.uint8)


def encode_pallas(
    x: jnp.ndarray,
    cache_exp: jnp.ndarray,
    *,
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
    interpret: bool = False,
):
    """Pallas encode of ``x`` (any shape, bf16/float32) against ``cache_exp`` (uint8, same shape)."""
    fmt = codec.word_format(x.dtype)
    _layout.check_block(block)
    shape = x.shape
    n = _layout.num_elements(shape)
    P = fmt.payload_bytes
    if n == 0:
        return (
            jnp.zeros(shape, jnp.uint8),
            jnp.zeros((P, *shape), jnp.uint8),
            jnp.zeros(shape, jnp.bool_),
        )
    # Bitcast (same width, free in XLA) before any pad/reshape: XLA:CPU's copies of bf16 are
    # not bit-preserving (they canonicalise NaN payloads), copies of unsigned words are.
    x_N = _layout.flatten_padded(codec.to_bits(x), block)
    cache_N = _layout.flatten_padded(cache_exp.astype(jnp.uint8), block)
    n_pad = x_N.shape[0]
    vec = pl.BlockSpec((block,), lambda i: (i,))
    exp_N, payload_Pxn, changed_N = pl.pallas_call(
        functools.partial(_encode_kernel, fmt=fmt),
        out_shape=(
            jax.ShapeDtypeStruct((n_pad,), jnp.uint8),
            jax.ShapeDtypeStruct((P, n_pad), jnp.uint8),
            jax.ShapeDtypeStruct((n_pad,), jnp.uint8),
        ),
        grid=(n_pad // block,),
        in_specs=[vec, vec],
        out_specs=(vec, pl.BlockSpec((P, block), lambda i: (0, i)), vec),
        compiler_params=compiler_params(num_warps),
        interpret=interpret,
        name=f"ciera_encode_{fmt.dtype.name}",
    )(x_N, cache_N)
    return (
        _layout.unflatten(exp_N, shape),
        _layout.unflatten(payload_Pxn, shape),
        _layout.unflatten(changed_N, shape) != 0,
    )
