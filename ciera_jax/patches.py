"""Exponent patches: listing the changed exponents of a shard, and applying them on receipt.

Two encodings (see :class:`ciera_jax.costmodel.Tier`): *sparse* patches are (position in the
full tensor, new exponent) pairs; *bitmap* patches are one changed-bit per element plus the new
exponents in position order. Listing changes is stream compaction; a plain ``jnp.nonzero`` is a
full prefix sum followed by a scatter, which XLA:CPU runs at ~12 ns per element, slower than the
gather it serves. So sparse positions are found block-wise (a reduction per block, a prefix sum
over block counts, then a search inside only the blocks that hold changes), and the sender's
compaction runs only at the capacity its own change count needs.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from ciera_jax.costmodel import Tier


PREFIX_BLOCK = 64


def prefix_sum(x, axis: int = -1):
    """Inclusive prefix sum, block-wise: a cumsum inside blocks of 64, the same over the block
    totals (recursively), then each block adds its start. On CPU this runs ~2.5x faster than a
    log-depth ``associative_scan`` and compiles ~10x faster (the scan's unrolled graph made
    compile time grow with every gather branch)."""
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    if n <= PREFIX_BLOCK:
        out = jnp.cumsum(x, axis=-1, dtype=x.dtype)
    else:
        m = -(-n // PREFIX_BLOCK)
        pad = [(0, 0)] * (x.ndim - 1) + [(0, m * PREFIX_BLOCK - n)]
        within = jnp.cumsum(jnp.pad(x, pad).reshape(x.shape[:-1] + (m, PREFIX_BLOCK)),
                            axis=-1, dtype=x.dtype)
        totals = within[..., -1]
        starts = prefix_sum(totals, axis=-1) - totals
        out = (within + starts[..., None]).reshape(x.shape[:-1] + (m * PREFIX_BLOCK,))[..., :n]
    return jnp.moveaxis(out, -1, axis)


def first_positions(mask_N, k: int):
    """Indices of the first ``k`` True entries of a flat mask, in order; ``n`` where absent."""
    n = mask_N.shape[0]
    block = _block_for(n, k)
    if block == 8:  # many slots: one byte per block, the offset inside it from a table
        return _first_positions_bytes(mask_N, k)
    n_blocks = -(-n // block)
    blocks = jnp.pad(mask_N, (0, n_blocks * block - n)).reshape(n_blocks, block)
    counts = jnp.sum(blocks, axis=1, dtype=jnp.int32)
    ends = prefix_sum(counts)  # set bits up to and including each block
    j = jnp.arange(1, k + 1, dtype=jnp.int32)
    b = jnp.searchsorted(ends, j, side="left")  # the block holding the j-th set bit
    b_safe = jnp.minimum(b, n_blocks - 1)
    rank_in_block = j - (ends[b_safe] - counts[b_safe])
    seen = prefix_sum(blocks[b_safe].astype(jnp.int32), axis=1)  # (k, block)
    offset = jnp.argmax(seen >= rank_in_block[:, None], axis=1).astype(jnp.int32)
    return jnp.where(b < n_blocks, b_safe * block + offset, n)


def _first_positions_bytes(mask_N, k: int):
    """:func:`first_positions` for many slots: blocks of 8 packed in a byte, their popcounts
    prefix-summed, a search per slot, and the slot's bit inside its byte (no per-slot scan of
    a larger block)."""
    n = mask_N.shape[0]
    bytes_B = pack_bits(mask_N)
    counts = lax.population_count(bytes_B).astype(jnp.int32)
    ends = prefix_sum(counts)
    j = jnp.arange(1, k + 1, dtype=jnp.int32)
    b = jnp.searchsorted(ends, j, side="left")
    b_safe = jnp.minimum(b, bytes_B.shape[0] - 1)
    rank = j - (ends[b_safe] - counts[b_safe]) - 1  # 0-based rank inside the byte
    # The slot's bit inside its byte: the first bit whose running count passes the rank
    # (8 lanes per slot; a constant lookup table here would not vmap inside shard_map).
    bits_Kx8 = (bytes_B[b_safe][:, None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
    offset = jnp.argmax(jnp.cumsum(bits_Kx8.astype(jnp.int32), axis=1) > rank[:, None], axis=1)
    return jnp.where(b < bytes_B.shape[0], b_safe * 8 + offset, n).astype(jnp.int32)


def _block_for(n: int, k: int) -> int:
    """Block size balancing the per-block prefix (n/block) and the searched rows (k*block)."""
    return int(min(max(2 ** round(math.log2(max(n / max(k, 1), 1)) / 2), 8), 1024))


def to_full_positions(pos, shard_shape, axis: int, offset, n_ranks: int):
    """Flat positions in this rank's shard -> flat positions in the gathered tensor.

    Rank r's slab sits at ``offset = r * shard_shape[axis]`` along the gather axis.
    Positions equal to the shard size (absent) map to the full size, which scatters drop.
    """
    n_local = math.prod(shard_shape)
    s, post = shard_shape[axis], math.prod(shard_shape[axis + 1:])
    outer, mid, inner = pos // (s * post), (pos // post) % s, pos % post
    full = outer * (n_ranks * s * post) + (offset + mid) * post + inner
    return jnp.where(pos < n_local, full, n_local * n_ranks).astype(jnp.int32)


def compact(exp, changed, count, offset, axis: int, n_ranks: int, tiers: tuple[Tier, ...]):
    """This rank's patches, sized for the largest tier: ``(positions, exponents)``.

    Positions (full-tensor, for the sparse tiers) fill ``max sparse capacity`` slots and
    exponents ``top capacity`` slots, in position order. Only the work for the tier this
    rank's own ``count`` needs is done (a rank-local switch, no collective inside): the agreed
    tier may be larger, but never needs more of this rank's changes than it has.
    """
    n_local = exp.size
    n_pos = max(t.capacity for t in tiers if not t.bitmap)
    n_exp = tiers[-1].capacity
    flat_mask, flat_exp = changed.reshape(-1), exp.reshape(-1)

    def for_tier(tier: Tier):
        def run(flat_mask, flat_exp):
            # full_like, not full: constants must vary over the mesh axes as the other
            # branches' outputs do (and stay vmappable, which a pcast is not).
            absent_pos = lax.full_like(flat_exp, n_local * n_ranks, jnp.int32, (n_pos,))
            no_exp = lax.full_like(flat_exp, 0, jnp.uint8, (n_exp,))
            if tier.capacity == 0:
                return absent_pos, no_exp
            if tier.bitmap:  # positions travel as bits; list the exponents in order
                ranks = changes_before(pack_bits(flat_mask)[None])[0, :n_local]
                slot = jnp.where(flat_mask, ranks, n_exp)
                return absent_pos, no_exp.at[slot].set(flat_exp, mode="drop")
            pos = first_positions(flat_mask, tier.capacity)
            exps = flat_exp[jnp.minimum(pos, n_local - 1)]
            full = to_full_positions(pos, exp.shape, axis, offset, n_ranks)
            return (jnp.pad(full, (0, n_pos - tier.capacity), constant_values=n_local * n_ranks),
                    jnp.pad(exps, (0, n_exp - tier.capacity)))
        return run

    capacities = jnp.asarray([t.capacity for t in tiers], jnp.int32)
    local_tier = jnp.sum(count > capacities)
    local_tier = jnp.where(local_tier == len(tiers), 0, local_tier)  # plain anyway: no work
    return lax.switch(local_tier, [for_tier(t) for t in tiers], flat_mask, flat_exp)


def pack_bits(mask_N):
    """bool (n,) -> uint8 (ceil(n/8),): element 8j+i is bit i of byte j."""
    n = mask_N.shape[0]
    padded = jnp.pad(mask_N, (0, -n % 8)).reshape(-1, 8).astype(jnp.uint8)
    return jnp.sum(padded << jnp.arange(8, dtype=jnp.uint8), axis=1, dtype=jnp.uint8)


def unpack_bits(bits_NxB, n: int):
    """uint8 (N, B) -> bool (N, n), the inverse of :func:`pack_bits` per row."""
    bits = (bits_NxB[:, :, None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
    return bits.reshape(bits_NxB.shape[0], -1)[:, :n].astype(bool)


def changes_before(bits_NxB):
    """For every element of every row, how many set bits precede it in its row: int32 (N, 8B).

    Works on the packed bytes: a prefix sum over byte popcounts (8x shorter than one over the
    elements) plus the popcount of the lower bits of the element's own byte.
    """
    pc = lax.population_count(bits_NxB).astype(jnp.int32)
    before_byte = prefix_sum(pc, axis=1) - pc
    lower = (jnp.uint8(1) << jnp.arange(8, dtype=jnp.uint8)) - jnp.uint8(1)
    within = lax.population_count(bits_NxB[:, :, None] & lower).astype(jnp.int32)
    return (before_byte[:, :, None] + within).reshape(bits_NxB.shape[0], -1)


def apply_bitmap(bits_NxB, exps_NxK, n: int):
    """Each rank's changed mask and new exponents per element, both (N, n): the j-th set bit
    of row r takes ``exps_NxK[r, j]`` (new exponents where the bit is clear are meaningless)."""
    k = exps_NxK.shape[1]
    ranks = changes_before(bits_NxB)[:, :n]
    new = jnp.take_along_axis(exps_NxK, jnp.minimum(ranks, k - 1), axis=1)
    return unpack_bits(bits_NxB, n), new


def apply_sparse(cache_exp, pos, vals):
    """Scatter sparse patches into the full exponent tensor (absent positions are dropped)."""
    flat = cache_exp.reshape(-1).at[pos].set(vals, mode="drop")
    return flat.reshape(cache_exp.shape)
