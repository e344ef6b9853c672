"""The experts' grouped matmul in blocks of rows, which XLA:GPU keeps as small as one block.

``lax.ragged_dot(x, w, sizes)`` multiplies each group of rows of ``x`` (rows sorted by group)
by its group's matrix of ``w``. XLA:GPU (jaxlib 0.10.2) rewrites it into a dense dot over every
group: OLMoE's shapes need float32 ``[64, 32768, 2048]`` buffers, several times a layer's
weights with the gradient. JAX's Pallas Triton lowering behind
``jax_ragged_dot_use_gpu_pallas_triton_lowering`` is not in the 0.10.2 wheel
(``jax._src.lax.pallas_lowerings`` is missing), so this module does the grouped matmul itself,
as MegaBlocks does: each group's rows are cut into blocks of ``block`` rows (a group's last
block is partial), and a loop runs over the blocks in use (``sum_g ceil(size_g / block)``, at
most ``rows / block + groups``), one ``[block, K] x [K, N]`` dot each against its group's
matrix. Its backward is its own custom VJP: one loop gives each block's input gradient and
adds its ``x_blk^T dy_blk`` to the group's weight gradient (a float32 ``[G, K, N]`` carry).
Temporaries: the output (its gradient) and that carry; nothing of ``groups x rows``.

Numbers: bf16 operands, float32 accumulation, like ``ragged_dot(...,
preferred_element_type=float32)``; the backward multiplies the float32 cotangent by the
bf16 operands, as ``ragged_dot``'s transpose does. Equal to it on CPU up to the order of the
float32 sums (tests/test_grouped_matmul.py), not bitwise, but the
same function in every gather mode, so ``--gather plain`` and ``ciera`` stay bitwise equal.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ciera_jax.runtime.varying import varying_like

F32 = jnp.float32
# MegaBlocks' block. Its speed on a GPU is not measured (no GPU here): OLMoE's 32768 rows x 64
# experts take at most 320 trips of the loop per matmul, each one [128, K] x [K, N] dot.
BLOCK_ROWS = 128


def _blocks(sizes_G, block: int):
    """Per group: its first block's index, its first row; and the number of blocks in use."""
    nblk_G = (sizes_G + block - 1) // block
    blk_end_G = jnp.cumsum(nblk_G)
    row_start_G = jnp.cumsum(sizes_G) - sizes_G
    return blk_end_G - nblk_G, blk_end_G, row_start_G, blk_end_G[-1]


def _where(b, blocks, sizes_G, block: int, rows_total: int):
    """Block ``b``'s group, where its slice of ``block`` rows starts, and the mask of the rows
    of that slice inside the block. A group's last block may reach past the last row: its slice
    then starts earlier (no padded copy of the operands) and the mask moves with it."""
    blk_start_G, blk_end_G, row_start_G, _ = blocks
    g = jnp.sum(blk_end_G <= b, dtype=jnp.int32)  # one fused compare (searchsorted: a loop)
    j = b - blk_start_G[g]
    row0 = row_start_G[g] + j * block
    end = row0 + jnp.minimum(sizes_G[g] - j * block, block)
    start = jnp.minimum(row0, rows_total - block)
    at = start + jnp.arange(block)
    return g, start, (at >= row0) & (at < end)


def _forward(x_AxK, w_GxKxN, sizes_G, block: int):
    A, N = x_AxK.shape[0], w_GxKxN.shape[2]
    blocks = _blocks(sizes_G, block)

    def body(b, y):
        g, start, rows = _where(b, blocks, sizes_G, block, A)
        x_blk = lax.dynamic_slice_in_dim(x_AxK, start, block)
        y_blk = jnp.dot(x_blk, w_GxKxN[g], preferred_element_type=F32)
        old = lax.dynamic_slice_in_dim(y, start, block)
        return lax.dynamic_update_slice_in_dim(y, jnp.where(rows[:, None], y_blk, old), start, 0)

    y0 = varying_like(jnp.zeros((A, N), F32), (x_AxK, w_GxKxN, sizes_G), None)
    return lax.fori_loop(0, blocks[3], body, y0)  # (in shard_map: typed like its inputs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(x_AxK, w_GxKxN, sizes_G, block):
    return _forward(x_AxK, w_GxKxN, sizes_G, block)


def _grouped_fwd(x_AxK, w_GxKxN, sizes_G, block):
    return _forward(x_AxK, w_GxKxN, sizes_G, block), (x_AxK, w_GxKxN, sizes_G)


def _grouped_bwd(block, res, dy_AxN):
    x_AxK, w_GxKxN, sizes_G = res
    A, K = x_AxK.shape
    dy_AxN = dy_AxN.astype(F32)
    blocks = _blocks(sizes_G, block)

    def body(b, carry):
        dx, dw = carry
        g, start, rows = _where(b, blocks, sizes_G, block, A)
        x_blk = jnp.where(rows[:, None], lax.dynamic_slice_in_dim(x_AxK, start, block), 0)
        dy_blk = lax.dynamic_slice_in_dim(dy_AxN, start, block)
        w = w_GxKxN[g]
        dx_blk = lax.dot_general(dy_blk, w, (((1,), (1,)), ((), ())), preferred_element_type=F32)
        old = lax.dynamic_slice_in_dim(dx, start, block)
        dx = lax.dynamic_update_slice_in_dim(dx, jnp.where(rows[:, None], dx_blk, old), start, 0)
        dw_blk = lax.dot_general(x_blk, dy_blk, (((0,), (0,)), ((), ())),
                                 preferred_element_type=F32)
        dw = lax.dynamic_update_index_in_dim(dw, dw[g] + dw_blk, g, 0)
        return dx, dw

    init = tuple(varying_like(z, (x_AxK, w_GxKxN, sizes_G, dy_AxN), None) for z in (
        jnp.zeros((A, K), F32), jnp.zeros(w_GxKxN.shape, F32)))
    dx, dw = lax.fori_loop(0, blocks[3], body, init)
    return dx.astype(x_AxK.dtype), dw.astype(w_GxKxN.dtype), None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_matmul(x_AxK, w_GxKxN, sizes_G, block: int = BLOCK_ROWS):
    """``y[i] = x[i] @ w[group of row i]`` in float32, the rows of ``x`` sorted by group
    (``sizes_G`` rows each, summing to at most ``x``'s rows; rows past the sum give 0).
    ``x`` and ``w`` must share a dtype (bf16 in the model)."""
    if x_AxK.dtype != w_GxKxN.dtype:
        raise ValueError(f"grouped_matmul: x is {x_AxK.dtype}, w is {w_GxKxN.dtype}")
    if x_AxK.shape[0] == 0:
        return jnp.zeros((0, w_GxKxN.shape[2]), F32)
    return _grouped(x_AxK, w_GxKxN, sizes_G.astype(jnp.int32), min(block, x_AxK.shape[0]))
