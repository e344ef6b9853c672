"""Patch listing and application: block-wise compaction equals nonzero, bit packing round-trips."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ciera_jax import patches
from ciera_jax.costmodel import DEFAULT_LADDER


@settings(max_examples=25, deadline=None)
@given(n=st.sampled_from([1, 7, 64, 1000, 4099]),
       density=st.sampled_from([0.0, 0.001, 0.02, 0.3, 1.0]),
       k=st.sampled_from([1, 5, 64, 300]), seed=st.integers(0, 2**16))
def test_first_positions_equal_nonzero(n, density, k, seed):
    mask = np.random.default_rng(seed).random(n) < density
    got = _first_positions(jnp.asarray(mask), k)
    want = jnp.nonzero(mask, size=k, fill_value=n)[0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


_first_positions = jax.jit(patches.first_positions, static_argnums=1)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000])
def test_bits_round_trip(n):
    mask = np.random.default_rng(n).random((3, n)) < 0.5
    packed = jnp.stack([patches.pack_bits(jnp.asarray(m)) for m in mask])
    assert packed.shape == (3, -(-n // 8)) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(patches.unpack_bits(packed, n)), mask)


def test_prefix_sum_is_inclusive_cumsum():
    x = jnp.asarray(np.random.default_rng(0).integers(0, 3, (4, 999)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(patches.prefix_sum(x, axis=1)),
                                  np.cumsum(np.asarray(x), axis=1))


_compact = jax.jit(patches.compact, static_argnums=(4, 5, 6))


@pytest.mark.parametrize("count", [0, 3, 100, 600])
def test_compact_lists_changes_in_order_for_the_local_tier(count):
    rng = np.random.default_rng(count)
    shape = (4, 8, 64)  # 2048 elements; gather axis 1, rank 2 of 4
    exp = rng.integers(0, 256, shape).astype(np.uint8)
    changed = np.zeros(exp.size, bool)
    changed[rng.choice(exp.size, count, replace=False)] = True
    changed = changed.reshape(shape)
    tiers = DEFAULT_LADDER.tiers(exp.size)
    pos, exps = _compact(jnp.asarray(exp), jnp.asarray(changed), jnp.int32(count),
                         jnp.int32(2 * 8), 1, 4, tiers)
    local = np.flatnonzero(changed)
    np.testing.assert_array_equal(np.asarray(exps)[:count], exp.reshape(-1)[local])
    n_full = exp.size * 4
    sparse_cap = max(t.capacity for t in tiers if not t.bitmap)
    if count <= sparse_cap:  # sparse tiers also list positions in the full (8x... ) tensor
        outer, mid, inner = np.unravel_index(local, shape)
        want = np.ravel_multi_index((outer, mid + 16, inner), (4, 32, 64))
        np.testing.assert_array_equal(np.asarray(pos)[:count], want)
        assert (np.asarray(pos)[count:] == n_full).all()
    else:
        assert (np.asarray(pos) == n_full).all(), "bitmap tiers send bits, not positions"


def test_apply_bitmap_gives_each_change_its_exponent_in_order():
    rng = np.random.default_rng(1)
    n, k = 37, 20
    mask = rng.random((3, n)) < 0.4
    exps = rng.integers(0, 256, (3, k)).astype(np.uint8)
    bits = jnp.stack([patches.pack_bits(jnp.asarray(m)) for m in mask])
    got_mask, got_new = patches.apply_bitmap(bits, jnp.asarray(exps), n)
    np.testing.assert_array_equal(np.asarray(got_mask), mask)
    for r in range(3):
        np.testing.assert_array_equal(np.asarray(got_new)[r][mask[r]],
                                      exps[r][:mask[r].sum()])
