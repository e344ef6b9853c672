"""Flat, block-padded layout shared by the kernels: any shape <-> (n_pad,) with n_pad % block == 0.

Kernels never see a ragged tail: the flat view is padded up to a whole number of blocks
(a no-op, and no copy, when the size already is one; weight shards usually are) and the
outputs are sliced back. Pallas' Triton lowering does not mask a partial last block, so this
is what keeps every load and store in bounds.
"""

from __future__ import annotations

import math

import jax.numpy as jnp


def num_elements(shape) -> int:
    return math.prod(shape)


def padded_size(n: int, block: int) -> int:
    return -(-n // block) * block


def flatten_padded(x: jnp.ndarray, block: int) -> jnp.ndarray:
    """``x`` as a flat vector padded with zeros to a multiple of ``block``."""
    flat = x.reshape(-1)
    pad = padded_size(flat.shape[0], block) - flat.shape[0]
    return jnp.pad(flat, (0, pad)) if pad else flat


def unflatten(flat: jnp.ndarray, shape) -> jnp.ndarray:
    """Inverse of :func:`flatten_padded` on the last axis: drop the padding, restore ``shape``."""
    n = num_elements(shape)
    lead = flat.shape[:-1]
    if flat.shape[-1] != n:
        flat = flat[..., :n]
    return flat.reshape(*lead, *shape)


def check_block(block: int) -> int:
    if block <= 0 or block & (block - 1):
        raise ValueError(f"block size must be a positive power of two, got {block}")
    return block
