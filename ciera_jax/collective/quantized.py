"""Blockwise absmax int8 all-gather (ZeRO++ qwZ style): the lossy baseline.

Each rank splits its flattened shard into blocks of ``BLOCK`` elements, scales each block by its
absolute maximum to int8 (round to nearest), and all-gathers the int8 codes plus one float32
scale per block; every rank dequantizes the full tensor. Wire: 1 byte per element + 4 bytes per
block, about half a bf16 gather, but the weights the model computes with are no longer the
weights the optimizer holds. Backward is the transpose of an all-gather (``psum_scatter``),
straight through the quantizer.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ciera_jax.codec import wire
from ciera_jax.collective.gather import attach_gather_grad

BLOCK = wire.INT8_BLOCK
SCALE_DTYPE = jnp.float32  # priced as wire.INT8_SCALE_BYTES


def _nblocks(n: int, block: int = BLOCK) -> int:
    return -(-n // block)


def wire_bytes(shard_elems: int, block: int = BLOCK) -> int:
    """Bytes one rank contributes to the gather: int8 codes + one float32 scale per block
    (the cost model prices exactly this: ``wire.int8_wire_bytes``)."""
    return _nblocks(shard_elems, block) * (block + jnp.dtype(SCALE_DTYPE).itemsize)


def quantize(x, block: int = BLOCK):
    """Flattened ``x`` -> (int8 codes [nb, block], float32 scales [nb])."""
    flat = x.reshape(-1).astype(SCALE_DTYPE)
    nb = _nblocks(flat.size, block)
    flat = jnp.pad(flat, (0, nb * block - flat.size)).reshape(nb, block)
    amax = jnp.max(jnp.abs(flat), axis=1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(flat / scale[:, None]), -127, 127).astype(jnp.int8)
    return q, scale


def dequantize(q, scale, shape, dtype):
    n = 1
    for s in shape:
        n *= s
    return (q.astype(jnp.float32) * scale[..., None]).reshape(*q.shape[:-2], -1)[..., :n].reshape(
        *q.shape[:-2], *shape).astype(dtype)


def int8_all_gather(x, axis_name: str, *, axis: int = 0, block: int = BLOCK):
    """Quantize the local shard, all-gather codes + scales, dequantize; tiled along ``axis``.

    Differentiable w.r.t. ``x``: the backward is ``psum_scatter`` of the cotangent.
    """
    full = _int8_gather(lax.stop_gradient(x), axis_name, axis, block)
    return attach_gather_grad(x, full, axis_name, axis)


def _int8_gather(x, axis_name, axis, block):
    q, scale = quantize(x, block)
    q_all = lax.all_gather(q, axis_name, axis=0, tiled=False)  # [N, nb, block]
    s_all = lax.all_gather(scale, axis_name, axis=0, tiled=False)  # [N, nb]
    parts = dequantize(q_all, s_all, x.shape, x.dtype)  # [N, *shard]
    parts = jnp.moveaxis(parts, 0, axis)  # [..., N, shard_axis, ...]
    shape = list(x.shape)
    shape[axis] *= parts.shape[axis]
    return parts.reshape(shape)
